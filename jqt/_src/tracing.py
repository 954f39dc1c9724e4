"""Tracing a user function to a jaxpr and analysing it, cached per input types.

The arrays among ``f``'s arguments (JAX and NumPy arrays and scalars, typed PRNG
keys, tracers) are traced; every other leaf (a Python ``bool``, ``int``, ``float``
or ``str``, any hashable object) reaches ``f`` as it is, as if ``f`` were called
directly: a static value, part of the cache key, like ``jax.jit``'s
``static_argnums`` (:func:`mark_static`). NumPy arrays of strings or objects and
unhashable objects cannot be either, and are refused with an error naming the
argument.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics, inplace, kvcache, validate
from .analysis import Analyzer, path_str
from .hops import enter_call, leave_call
from .interpreter import Ctx, eval_jaxpr
from .plan import DATA, Plan, VarInfo
from .qparams import WeightSource, restored_bare


@dataclasses.dataclass
class Traced:
    closed: object
    out_tree: object
    plan: Plan
    analyzer: Analyzer
    leaf_paths: dict = dataclasses.field(default_factory=dict)  # (arg, leaf index) -> path
    arg_prefixes: frozenset = frozenset()  # f's parameter names that its keys start with
    weight_invars: dict = dataclasses.field(default_factory=dict)  # jaxpr input -> leaf path
    keys_checked: bool = False  # jqt.quantize checked its qparams' keys against it

    def uses(self, arg, leaf):
        """The site keys that read leaf ``leaf`` of weight argument ``arg`` as their weight
        operand, with ``"float"`` if anything else reads it (``Analyzer.leaf_uses``)."""
        return self.analyzer.leaf_uses.get((arg, leaf), set())

    def run(self, args, handler, state, dropped=frozenset()):
        """Interprets the traced function on ``args`` (the pytree it was traced with) under
        ``handler`` (``handlers.py``) with per-op ``state``: ``(flat outputs, the state the
        handler wrote)``. The one driver of calibrate, quantize, report and gptq.

        A key/value cache ``f`` takes and returns written (``Plan.boundary``) runs in the
        handler's form (:func:`hops.enter_call`) and is returned so; every other
        quantized cache among the arguments and outputs is decoded to float. ``dropped``:
        the keys of ops whose weight ``jqt.pack`` dropped (``hops._packed_in``)."""
        ctx = Ctx(handler, state, dropped=frozenset(dropped))
        jaxpr = self.closed.jaxpr
        # jqt's rules broadcast as NumPy does ((M, N) - (N,)); f's own ops, traced under the
        # user's jax_numpy_rank_promotion, are bound again as they were: "raise" for f
        # failed the integer path of a model that runs under it (hunt81_jaxconfig)
        with jax.numpy_rank_promotion("allow"):
            flat, entered = enter_call(self.plan, ctx, leaves(args), jaxpr.invars,
                                       lambda k: leaf_path(args, k))
            outs = eval_jaxpr(jaxpr, self.closed.consts, flat, self.plan, ctx)
            return leave_call(self.plan, outs, entered, jaxpr.outvars), ctx.state_out

    def sites(self):
        """The function's ops in evaluation order, one per key (the ops of a
        ``lax.map`` remainder share the keys of the map's body: the first stands
        for them)."""
        first = {}
        for s in self.plan.all_sites():
            first.setdefault(s.key, s)
        return list(first.values())


@jax.tree_util.register_static
class Static:
    """A non-array argument leaf, carried in the pytree structure (no children), so
    that ``jax.jit``, ``vmap`` and the tracer's cache key on its type and value."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        if not isinstance(other, Static) or type(other.value) is not type(self.value):
            return False
        if isinstance(self.value, (float, complex)):  # -0.0 is not 0.0 to f (copysign, 1 / s)
            return repr(other.value) == repr(self.value)
        try:
            return other.value is self.value or bool(other.value == self.value)
        except Exception:  # noqa: BLE001 - an object whose == is not a truth value
            return False

    def __hash__(self):
        v = self.value
        return hash((type(v), repr(v) if isinstance(v, (float, complex)) else v))

    def __repr__(self):
        return f"Static({self.value!r})"


def _jax_dtype(dtype) -> bool:
    """Whether JAX traces a NumPy array of ``dtype``: numbers and booleans, ml_dtypes'
    (bfloat16, float8, int4) included, whose NumPy kind is ``'V'`` as raw bytes' is (not
    ``timedelta64``, which NumPy counts as a signed integer)."""
    return dtype == np.bool_ or (jnp.issubdtype(dtype, np.number) and dtype.kind != "m")


def untraceable(leaf) -> str | None:
    """Why ``leaf`` can be neither traced nor passed to ``f`` as a static value, or
    ``None`` when it can."""
    if isinstance(leaf, (jax.Array, Static)) or compat.is_tracer(leaf):
        return None
    if isinstance(leaf, np.ndarray) and not _jax_dtype(leaf.dtype):
        return (f"a NumPy array of dtype {leaf.dtype}, which JAX cannot trace (only numbers, "
                "booleans and PRNG keys can)")
    if isinstance(leaf, (np.ndarray, np.generic)):
        return None
    if (why := validate.array_like(leaf) or validate.opaque_container(leaf)) is not None:
        return why
    try:
        hash(leaf)
    except TypeError:
        return (f"a {type(leaf).__name__}, neither an array nor hashable (jqt passes a "
                "non-array argument to f as a static value, like jax.jit's static_argnums, "
                "and a static value must be hashable)")
    return None


def untraceable_fix(leaf) -> str:
    """The advice after :func:`untraceable`'s reason: bind the value with functools.partial
    (not for an array-like, whose reason says to pass its value)."""
    if validate.array_like(leaf) is not None or validate.opaque_container(leaf) is not None:
        return ""
    return (" Bind it with functools.partial (f2 = functools.partial(f, ...)) and calibrate "
            "and quantize f2, or pass an array.")


def is_static(leaf) -> bool:
    """Whether ``leaf`` reaches ``f`` as a static value rather than traced."""
    if isinstance(leaf, (jax.Array, Static)) or compat.is_tracer(leaf):
        return False
    return not (isinstance(leaf, (np.ndarray, np.generic)) and _jax_dtype(leaf.dtype))


def owned(batch):
    """``batch`` with each NumPy array copied that could change: a writeable one, or a view
    of memory it does not own (a read-only view of a loader's buffer: the buffer may be
    writeable). JAX on CPU may read such an array in place after the step is dispatched
    (asynchronously), and a loader that refills one buffer for the next batch then changes
    what this batch's step sees (jax-ml/jax#37830).

    >>> buf = np.zeros(2, np.float32)
    >>> view = buf.view(); view.flags.writeable = False
    >>> (out, out_view) = owned((buf, view))
    >>> buf[0] = 1.0; float(out[0]), float(out_view[0])
    (0.0, 0.0)
    """
    own = lambda a: np.array(a) if isinstance(a, np.ndarray) and (
        a.flags.writeable or not a.flags.owndata) else a
    return jax.tree_util.tree_map(own, batch)


def mark_static(tree):
    """``tree`` with its static leaves wrapped in :class:`Static` (idempotent)."""
    return jax.tree_util.tree_map(lambda x: Static(x) if is_static(x) else x, tree,
                                  is_leaf=lambda x: isinstance(x, Static))


def mark_outputs(tree):
    """``f``'s outputs with the leaves that are not JAX values (a dtype or a string in a
    returned state: an Equinox module's plain field) wrapped in :class:`Static`, carried
    in the outputs' structure; Python numbers stay leaves (traced as constants, as
    ``jax.jit`` takes them)."""
    num = (bool, int, float, complex)
    return jax.tree_util.tree_map(lambda x: Static(x) if is_static(x) and not isinstance(x, num)
                                  else x, tree)


def unmark(tree):
    """``tree`` with :class:`Static` leaves unwrapped: what ``f`` receives."""
    return jax.tree_util.tree_map(lambda x: x.value if isinstance(x, Static) else x, tree,
                                  is_leaf=lambda x: isinstance(x, Static))


def jit_static(f):
    """``jax.jit(f)`` whose non-array argument leaves (a config string among the weights)
    reach ``f`` as they are, static, as jqt's quantized functions pass them; keyword
    arguments too (a metric calling ``g(params, x, train=False)``).

    >>> import jax.numpy as jnp
    >>> jit_static(lambda p, x: x * p["k"] if p["op"] == "mul" else x)({"op": "mul", "k": 2.0}, 3.0)
    Array(6., dtype=float32, weak_type=True)
    >>> jit_static(lambda x, scale=1.0, op="add": x * scale if op == "mul" else x)(3.0, op="mul", scale=2.0)
    Array(6., dtype=float32, weak_type=True)
    """
    jf = jax.jit(lambda a, kw: f(*unmark(a), **unmark(kw)))
    return functools.wraps(f)(lambda *a, **kw: jf(mark_static(a), mark_static(kw)))


def leaves(args) -> list:
    """The traced leaves of ``args``: the inputs of the traced jaxpr, in order (a quantized
    key/value cache, which stands for one float buffer, whole)."""
    return jax.tree_util.tree_leaves(mark_static(args), is_leaf=kvcache.is_cache)


def leaf_path(args, k) -> str:
    """How an error names the ``k``-th of :func:`leaves` of ``args``: ``[1]['k']``."""
    return leaf_names(args)[k]


def leaf_names(args) -> list:
    """:func:`leaf_path` of every one of :func:`leaves` of ``args``."""
    paths = jax.tree_util.tree_flatten_with_path(mark_static(args), is_leaf=kvcache.is_cache)[0]
    return [jax.tree_util.keystr(p) for p, _ in paths]


def check_traceable(args, where="jqt"):
    """Raises ``TypeError`` naming the first argument leaf that :func:`untraceable`
    refuses, with the fix."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            list(args), is_leaf=lambda x: isinstance(x, Static))[0]:
        why = untraceable(leaf)
        if why is not None:
            raise TypeError(f"{where}: argument {jax.tree_util.keystr(path)} of f is {why}."
                            + untraceable_fix(leaf))


def signature(traced) -> tuple:
    """What must be the same in two traces of ``f`` for one set of qparams to serve
    both: each op's key, operation, weight (leaf, layout ops, contracted axes) and which
    of its operands are complex (such an op is kept float). The shape of a weight ``f``
    computes is not: where its op is quantized, calibrate checks it
    (:func:`computed_shapes`)."""
    out = []
    for s in traced.sites():
        w, src = s.weight_operand, s.source
        out.append((s.key, s.op, w, None if src is None else (src.path, src.chain),
                    None if w is None else tuple(s.contract[w]),
                    tuple(jnp.issubdtype(v.aval.dtype, jnp.complexfloating)
                          for v in s.eqn.invars[:2])))
    return tuple(out)


def computed_shapes(traced) -> dict:
    """``{op key: shape}`` of the weights ``f`` computes (no leaf reaches them; not a matrix
    built from iota and literals, which stays float): their scales follow that shape, so
    one sized by an input's length (relative positions) is another weight at another
    length."""
    return {s.key: tuple(s.eqn.invars[s.weight_operand].aval.shape) for s in traced.sites()
            if s.computes_weight}


def refuse_mutable(x, path, fn):
    """Raises where weight leaf ``x`` is read through a reference: a ``jax.Ref`` (flax nnx's
    ``nnx.var_defaults(ref=True)``) or an nnx hijax Variable (``hijax=True``). ``f`` reads
    those with ref primitives jqt does not follow: its ops got positional keys, pack stored
    nothing, and a jitted quantized call failed."""
    try:  # (an attribute dict, __getattr__ = dict.__getitem__, raises KeyError)
        aval = getattr(x, "aval", None)
    except Exception:
        aval = None
    if isinstance(x, jax.Ref):
        mode = "a jax.Ref (nnx.var_defaults(ref=True))"
    elif type(x).__name__ == "HijaxVariable" or type(aval).__name__ == "AbstractVariable":
        mode = "an nnx hijax Variable (nnx.var_defaults(hijax=True))"
    else:
        return
    raise TypeError(
        f"{fn}: weight '{path}' is {mode}: f reads it through a reference, which jqt does not "
        "follow to a weight (its ops would get positional keys and jqt.pack could store none). "
        "Pass the model with its Variables holding arrays: nnx.with_vars(model, ref=False, "
        "hijax=False), or build it without that mode.")


def normalize_argnums(weight_argnums) -> tuple[int, ...]:
    is_int = lambda n: isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
    nums = (weight_argnums,) if is_int(weight_argnums) else weight_argnums
    try:
        nums = tuple(nums)
    except TypeError:
        nums = ()
    if not nums or not all(is_int(n) and n >= 0 for n in nums):
        raise ValueError(f"weight_argnums={weight_argnums!r}: expected a non-negative int or a "
                         "tuple of them (the positions of the weight arguments of f).")
    if len(set(nums)) != len(nums):
        raise ValueError(f"weight_argnums={weight_argnums!r} names a position twice; give each "
                         "weight argument's position once.")
    return tuple(int(n) for n in nums)


def _unbound(f, n):
    """Why ``f``'s signature does not take ``n`` positional arguments, or ``None`` (it
    takes them, or it has no signature to read)."""
    why = None
    for follow in (True, False):  # a decorator's functools.wraps may name the inner signature
        try:
            inspect.signature(f, follow_wrapped=follow).bind(*range(n))
        except TypeError as e:
            why = why or str(e)
        except ValueError:
            return None
        else:
            return None
    return why


def call_signature(f) -> inspect.Signature:
    """The signature a call of ``f`` binds. ``inspect.signature`` follows a
    ``functools.wraps`` wrapper's ``__wrapped__`` to the inner function even where the
    wrapper takes other parameters (reordered, one added); that is read only for a
    pass-through wrapper: ``*args`` (and ``**kwargs``) after no more positional parameters
    than the inner function has (the decorators of jax.checkpoint, jax.vmap, custom_jvp; a
    logging decorator's ``(*args)``; ``(params, *args, **kwargs)``). Raises as
    ``inspect.signature`` does where ``f`` has none.

    >>> import functools
    >>> def g(p, x): return x
    >>> @functools.wraps(g)
    ... def swapped(x, p): return g(p, x)
    >>> str(call_signature(swapped)), str(call_signature(functools.wraps(g)(lambda *a, **k: g(*a, **k))))
    ('(x, p)', '(p, x)')
    """
    try:
        own = inspect.signature(f, follow_wrapped=False)
    except (TypeError, ValueError):
        return inspect.signature(f)
    P = inspect.Parameter
    if not any(q.kind == P.VAR_POSITIONAL for q in own.parameters.values()):
        return own
    try:
        follow = inspect.signature(f)
    except (TypeError, ValueError):
        return own
    # (its keyword-only parameters, a decorator's debug=False, are its own; its first
    # parameters may be named otherwise: def w(params, *args, **kwargs) over f(p, x))
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    named = [n for n, q in own.parameters.items() if q.kind in positional]
    inner = [n for n, q in follow.parameters.items() if q.kind in positional]
    if len(named) > len(inner):
        return own
    # the wrapper's own keyword-only parameters are kept, so that a call naming one is told
    # how keyword-only arguments reach f (functools.partial), not "unexpected keyword"
    mine = [q for n, q in own.parameters.items() if q.kind == P.KEYWORD_ONLY and n not in follow.parameters]
    params = list(follow.parameters.values())
    at = next((i for i, q in enumerate(params) if q.kind == P.VAR_KEYWORD), len(params))
    return follow.replace(parameters=params[:at] + mine + params[at:]) if mine else follow


def _keyword_only(f) -> list:
    """The names of ``f``'s keyword-only arguments without a default (``[]`` where it
    has no signature to read)."""
    try:
        params = call_signature(f).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]


def _arg_names(f, n):
    try:
        params = list(call_signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params[:n]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = positional[:]
    for i in range(len(positional), n):  # in *args (or no signature): made-up, none taken
        name = f"arg{i}"
        while name in positional:  # def f(arg1, *rest): rest[0] is not 'arg1' too
            name += "_"
        names.append(name)
    return names


def _note_one_tuple(e: BaseException, args, argnums):
    """Adds a note to an error ``f`` raised while traced where a weight argument is a
    tuple or list of one pytree: with one weight argument, ``params`` is that argument
    itself (``weight_argnums=(0,)`` as ``0``), so ``params=(p,)`` gave ``f`` the tuple."""
    ones = [a for a in argnums if a < len(args) and type(args[a]) in (tuple, list)
            and len(args[a]) == 1]  # a plain one (a NamedTuple of params is no such mistake)
    if not ones or not isinstance(e, (TypeError, AttributeError, KeyError, IndexError)) \
            or not hasattr(e, "add_note"):  # those: what indexing a tuple as the params raises
        return
    got = f"jqt: f got a {type(args[ones[0]]).__name__} of one pytree as its weight argument {ones[0]}"
    if len(argnums) == 1:
        e.add_note(f"{got}. With one weight argument params is that argument itself "
                   f"(weight_argnums={argnums[0]} and ({argnums[0]},) alike): pass p, not (p,), "
                   "unless f takes a tuple there.")
    else:
        e.add_note(f"{got}: params holds one pytree per weight argument, each passed to f as it is.")


def _note_restored_bare(e: BaseException, args, f):
    """Adds a note to an error ``f`` raised while traced where an argument holds a plain
    dict shaped like a :class:`jqt.PackedParams` or a quantized cache (``QArray``): one a
    checkpointer restored without a template, its formats lost."""
    if not hasattr(e, "add_note"):
        return
    for i, a in enumerate(args):
        found = [(path, kind) for path, kind in _bare_dicts(a, ()) if kind != "jqt.OpQParams"]
        if found:
            path, kind = found[0]
            where = f"'{_arg_names(f, len(args))[i]}{path_str(path) and '/' + path_str(path)}'"
            e.add_note(
                f"jqt: argument {where} is a plain dict with the fields of a {kind}: one flattened "
                "to its arrays, as a checkpointer (orbax) restores it without a template. Its "
                "formats are not arrays, so they are lost. Restore with a template, e.g. "
                "jax.eval_shape(lambda: jqt.pack(qparams, params)) or of "
                "jqt.quantize_cache(cache, kind) for a cache, or use jqt.save_packed / "
                "jqt.load_packed.")
            return


def _bare_dicts(a, path):
    kind = restored_bare(a)
    if kind is not None:
        yield path, kind
    elif isinstance(a, dict):
        for k, v in a.items():
            yield from _bare_dicts(v, path + (jax.tree_util.DictKey(k),))
    elif isinstance(a, (list, tuple)):
        for k, v in enumerate(a):
            yield from _bare_dicts(v, path + (jax.tree_util.SequenceKey(k),))


def _aval_key(x):
    # the whole type: shape, dtype, weak type, and the sharding it names (explicit mesh
    # axes) or the manual axes it varies over (shard_map), which the jaxpr's ops carry
    return jax.typeof(x)


class Tracer:
    """Traces ``f`` once per input structure and types; keeps the last 32."""

    def __init__(self, f, weight_argnums, fn: str = "jqt"):
        if not callable(f):
            raise TypeError(f"{fn}: f is a {type(f).__name__}, not a function; pass the function "
                            "first (e.g. model.apply), then the weights and the data.")
        keras_model = lambda m: hasattr(m, "stateless_call") and any(
            c.__module__.split(".")[0] == "keras" for c in type(m).__mro__)  # a subclass too
        if keras_model(f) or (keras_model(getattr(f, "__self__", None))  # (stateless_call takes
                              and not getattr(f, "__name__", "").startswith("stateless")):  # them)
            what = (f"a Keras {type(f).__name__}" if keras_model(f) else
                    f"the method {getattr(f, '__name__', '?')} of a Keras {type(f.__self__).__name__}")
            raise TypeError(f"{fn}: f is {what}, which keeps its weights in "
                            "keras.Variables, not in the params jqt is given. Make it a function "
                            "of its weights first: f, params = jqt.from_keras(model).")
        self.f = f
        self.fn = fn
        self.argnums = normalize_argnums(weight_argnums)
        self.cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # threads calling one quantized function share the cache
        # the analysis' warnings given already: each once per function, not again at every
        # trace (a new batch shape, packed params, jax.jit of it)
        self._warned: set = set()
        compat.register_cache(self, "jqt's traces of f")  # jax.clear_caches() clears them too

    def cache_clear(self):
        """Forgets every trace (``jax.clear_caches()`` calls it): ``f`` is traced again."""
        with self._lock:
            self.cache.clear()

    def arg_names(self, n) -> list:
        """The names of ``f``'s first ``n`` positional parameters (made up within ``*args``),
        which begin the keys of its ops where several arguments hold weights."""
        return _arg_names(self.f, n)

    def __getstate__(self):  # pickled (a quantized function sent to a worker): no traces
        # (their jaxprs hold tracebacks) and no lock; they are made again there
        return {"f": self.f, "argnums": self.argnums, "fn": self.fn}

    def __setstate__(self, state):
        self.f, self.argnums, self.fn = state["f"], state["argnums"], state.get("fn", "jqt")
        self.cache, self._lock = OrderedDict(), threading.Lock()
        compat.register_cache(self, "jqt's traces of f")

    def __call__(self, args) -> Traced:
        check_traceable(args)
        args = mark_static(kvcache.placeholders(list(args)))
        flat, treedef = jax.tree_util.tree_flatten(args)
        key = (treedef, tuple(_aval_key(x) for x in flat), compat.trace_settings())
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                return hit
        for a in self.argnums:
            if a >= len(args):
                raise ValueError(f"jqt: weight_argnums={self.argnums} but f was called with "
                                 f"{len(args)} positional arguments.")
            for path, x in jax.tree_util.tree_flatten_with_path(unmark([args[a]])[0])[0]:
                refuse_mutable(x, path_str(path), self.fn)
                why = validate.template_leaf(x)  # (the others: untraceable, for every argument)
                if why is not None:
                    raise TypeError(f"{self.fn}: weight argument {a}, leaf {jax.tree_util.keystr(path)}, "
                                    f"is {why}.")
        # traced with jit on: under jax.disable_jit a lax.scan would trace unrolled, its
        # layers' ops under other keys than calibrate gave them
        changed = []

        def traced_f(*marked):
            a = unmark(marked)
            before = [jax.tree_util.tree_flatten_with_path(x) for x in a]
            out = self.f(*a)
            changed.extend(inplace.changed_leaves(marked, a, before, out))
            return mark_outputs(out)

        def new_leaves(marked, which):
            a = unmark(marked)
            out = self.f(*a)
            new = [jax.tree_util.tree_leaves(a[i])[j] for i, _, _, j in which]
            return ([x if compat.is_tracer(x) or isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex))
                     else jnp.zeros(()) for x in new]  # (a string: no value to follow, a change)
                    + [x for x in jax.tree_util.tree_leaves(out) if compat.is_tracer(x)])

        with jax.disable_jit(False):
            try:
                closed, out_shape = jax.make_jaxpr(functools.wraps(self.f)(traced_f), return_shape=True)(*args)
            except TypeError as e:
                why = _unbound(self.f, len(args))
                if why is None:
                    _note_one_tuple(e, args, self.argnums)
                    _note_restored_bare(e, args, self.f)
                    raise
                kwonly = _keyword_only(self.f)
                name = kwonly[0] if len(kwonly) == 1 else "name"
                also = (f" f's keyword-only argument(s) {kwonly} are not passed by jqt: bind them "
                        f"first, functools.partial(f, {kwonly[0]}=...); one that holds the weights "
                        "takes a wrapper that passes them on, jqt passing weights positionally: "
                        f"lambda params, *xs: f(*xs, {name}=params)"
                        + ("" if len(kwonly) == 1 else f" (name: the one of {kwonly} that holds them, "
                           "the others bound with functools.partial)")
                        + ", calibrated with weight_argnums=0 (the wrapper takes the weights first)."
                        ) if kwonly else ""
                raise TypeError(
                    f"jqt: f was called with {len(args)} positional arguments, which its signature "
                    f"does not take ({why}): the weight argument(s) at weight_argnums="
                    f"{self.argnums}, then the batch's. calibrate, gptq and report take each batch "
                    "as a tuple of f's remaining arguments (batches = [(x,) for x in xs]; report: "
                    f"(x,)).{also}") from e
            except Exception as e:
                _note_one_tuple(e, args, self.argnums)
                _note_restored_bare(e, args, self.f)
                raise
        out_tree = jax.tree_util.tree_structure(out_shape)
        names = _arg_names(self.f, len(args))
        if changed:
            with jax.disable_jit(False):
                lost = inplace.lost_changes(changed, new_leaves, args)
            if lost:
                inplace.warn_lost(self.fn, names, lost)
        infos, prefixes, leaf_names = [], set(), {}
        for i, a in enumerate(args):
            flat_a = jax.tree_util.tree_flatten_with_path(a, is_leaf=lambda x: isinstance(x, Static))[0]
            if i not in self.argnums:
                infos += [DATA for _, x in flat_a if not isinstance(x, Static)]
                continue
            for j, (path, x) in enumerate(flat_a):  # j: the leaf's index in the params pytree
                if isinstance(x, Static):
                    continue
                p = path_str(path)
                prefixed = len(self.argnums) > 1 or not p
                if prefixed:
                    p = f"{names[i]}/{p}" if p else names[i]
                    prefixes.add(names[i])
                infos.append(VarInfo(True, WeightSource(arg=i, path=p, leaf=j, shape=tuple(np.shape(x)),
                                                        prefixed=prefixed)))
                leaf_names[(i, j)] = jax.tree_util.keystr(path)
        analyzer = Analyzer(leaf_names, {v.source.path for v in infos if v.source is not None})
        with diagnostics.captured() as said:
            with diagnostics.grouped():  # a warning per kind, naming the ops, not one per op
                plan, _ = analyzer.analyze(closed.jaxpr, infos, top=True, consts=closed.consts)
        for message, category in said:
            with self._lock:
                new = message not in self._warned
                self._warned.add(message)
            if new:
                diagnostics.warn(message, category)
        paths = {(v.source.arg, v.source.leaf): v.source.path for v in infos if v.source is not None}
        traced = Traced(closed, out_tree, plan, analyzer, paths, frozenset(prefixes),
                        weight_invars={k: v.source.path for k, v in enumerate(infos)
                                       if v.source is not None})
        with self._lock:
            self.cache[key] = traced
            if len(self.cache) > 32:
                self.cache.popitem(last=False)
        return traced
