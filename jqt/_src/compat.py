"""The one place where jqt touches JAX internals.

Everything here comes from public-but-low-level modules (``jax.extend`` and
``jax.interpreters``). When a JAX release moves something, this is the only
file to change.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import jax.extend.core as jex_core
from jax.extend import source_info_util
from jax.extend.core import Literal, Primitive  # noqa: F401
from jax.interpreters import ad, batching, mlir  # noqa: F401

DropVar = jex_core.DropVar
NOT_MAPPED = getattr(batching, "not_mapped", None)  # vmap: operand has no batch axis
try:  # what lax's ops call on their operands first inside jax.shard_map (bind_eqn)
    from jax._src.core import auto_insert_reshard as _auto_insert_reshard
except ImportError:  # a release that moved it: operands are bound as they are
    _auto_insert_reshard = None
try:  # what a value batched by jax.vmap is while it traces (is_vmapped)
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # a release that moved it: each example's rows decide, as before
    _BatchTracer = None
try:  # a spec as it reads on another mesh's axis types (to_current_mesh)
    from jax._src.core import modify_spec_for_auto_manual as _modify_spec
except ImportError:  # a release that moved it: keep the spec's names
    _modify_spec = lambda spec, mesh: spec  # noqa: E731
jaxprs_in_params = jex_core.jaxprs_in_params


def sharded_dims(x) -> tuple:
    """The dimensions of ``x`` split over mesh axes in its type (explicit sharding, JAX's
    default mesh axes since 0.7): slicing such a dimension to one element is not
    implemented there. Empty for arrays without sharding in their type (auto axes, one
    device).

    >>> import jax.numpy as jnp
    >>> sharded_dims(jnp.ones((2, 3)))
    ()
    """
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    return tuple(i for i, a in enumerate(spec) if a is not None)


def split_count(x, dim) -> int:
    """How many parts ``x``'s type splits dimension ``dim`` into over explicit mesh axes
    (the product of their sizes); 1 where it is not split so (auto axes, one device).

    >>> import jax.numpy as jnp
    >>> split_count(jnp.ones((4, 2)), 0)
    1
    """
    s = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(s, "spec", None) or ()
    if dim % max(x.ndim, 1) >= len(spec) or spec[dim % x.ndim] is None:
        return 1
    return math.prod(s.mesh.shape[a] for a in spec_names(spec[dim % x.ndim]))


def unsplit(x, dims):
    """``x`` with its ``dims`` no longer split over explicit mesh axes in its type (JAX
    cannot reshape a split dimension into groups); unchanged where they are not split.

    >>> import jax.numpy as jnp
    >>> unsplit(jnp.ones((4, 2)), (0,)).shape
    (4, 2)
    """
    split = sharded_dims(x)
    if not any(d % x.ndim in split for d in dims):
        return x
    keep = {d % x.ndim for d in dims}
    s = jax.typeof(x).sharding
    spec = jax.sharding.PartitionSpec(*(None if i in keep else a for i, a in enumerate(s.spec)))
    return jax.sharding.reshard(x, s.update(spec=spec))


def grouped(x, axis, size):
    """``x`` with dimension ``axis`` (length ``n``) reshaped into ``(n // size, size)``:
    groups of a weight, int4 codes in pairs. Where the axis is split over explicit mesh
    axes into parts that do not divide ``n // size`` (2 groups over 4 devices, 18 bytes of
    a K=36 row-parallel weight over 4), JAX cannot type that reshape: the axis is gathered
    first; otherwise its split stays (on the groups).

    >>> import jax.numpy as jnp
    >>> grouped(jnp.ones((2, 6)), 1, 3).shape
    (2, 2, 3)
    """
    ax = axis % x.ndim
    n = x.shape[ax]
    if (n // size) % split_count(x, ax):
        x = unsplit(x, (ax,))
    return x.reshape(x.shape[:ax] + (n // size, size) + x.shape[ax + 1:])


def whole(x):
    """``x`` not split over devices: a concrete array split over explicit mesh axes
    gathered through the host (eager device collectives, dispatched one after another, can
    stall XLA:CPU's in-process rendezvous), a traced one resharded in the program; others
    unchanged.

    >>> import jax.numpy as jnp
    >>> whole(jnp.ones((2, 3))).shape
    (2, 3)
    """
    if not getattr(x, "ndim", 0):
        return x
    if not is_tracer(x) and isinstance(x, jax.Array) and sharded_dims(x):
        return jnp.asarray(np.asarray(x))
    return unsplit(x, range(x.ndim))


def explicit_sharding(x, traced=False):
    """``x``'s ``NamedSharding`` where it splits a dimension over explicit mesh axes (a
    concrete array or a ``jax.ShapeDtypeStruct`` template placed so; with ``traced``, a
    traced one's, from its type), else ``None``.

    >>> import jax.numpy as jnp
    >>> explicit_sharding(jnp.ones((2, 3))) is None
    True
    """
    if not hasattr(x, "shape") or not sharded_dims(x):
        return None
    if is_tracer(x):
        return jax.typeof(x).sharding if traced else None
    return x.sharding


def zeros(shape, dtype, sharding=None):
    """Zeros of ``shape`` split as ``sharding`` says (``None``: as JAX places them): in
    their type under ``jax.jit``, else a concrete array placed so, where JAX asks for a
    mesh context to type them (outside ``jit``: eagerly, under ``jax.vmap``).

    >>> zeros((2, 3), "float32").shape
    (2, 3)
    """
    dtype = jax.dtypes.canonicalize_dtype(dtype)  # float64 recorded under x64: no JAX warning
    if sharding is None:
        return jnp.zeros(shape, dtype)
    try:
        return jnp.zeros(shape, dtype, out_sharding=sharding)
    except ValueError:
        return jnp.zeros(shape, dtype, device=sharding)


_OP_SCOPE = "jqt_op:"
_CACHE_SCOPE = "jqt_cache:"  # a key/value cache's writes and entry
_ACT_SCOPE = "jqt_act:"  # an op's activation rounded to codes
_AXA_SCOPE = "jqt_axa:"  # an activation x activation op's operands rounded to codes


def op_scope(key, cache=False, activation=False):
    """A name scope that marks the equations bound in it as op ``key``'s (``cache``: the
    key/value cache ``key``'s; ``activation``: op ``key``'s activation, ``"act_x_act"``:
    an operand of an activation x activation op), for errors raised
    while JAX differentiates them (:func:`scoped_op`); no equation parameter, so lowering
    and compiled programs are shared across ops as before."""
    prefix = (_CACHE_SCOPE if cache else _AXA_SCOPE if activation == "act_x_act"
              else _ACT_SCOPE if activation else _OP_SCOPE)
    return jax.named_scope(prefix + key)


def scoped_op(kind=False):
    """The op key of the innermost :func:`op_scope` around the equation being evaluated
    (JAX restores an equation's name stack when it differentiates a jaxpr), or ``None``;
    ``kind``: ``(key, "op" | "cache" | "activation" | "act_x_act")``, ``(None, None)`` outside every
    scope.

    >>> with op_scope("dense/kernel"):
    ...     scoped_op()
    'dense/kernel'
    >>> with op_scope("kv_cache"), op_scope("kv_cache", cache=True):
    ...     scoped_op(kind=True)
    ('kv_cache', 'cache')
    """
    kinds = {_OP_SCOPE: "op", _CACHE_SCOPE: "cache", _ACT_SCOPE: "activation",
             _AXA_SCOPE: "act_x_act"}
    for e in reversed(source_info_util.current_name_stack().stack):
        name = getattr(e, "name", "")
        for prefix, what in kinds.items():
            if isinstance(name, str) and name.startswith(prefix):
                key = name[len(prefix):]
                return (key, what) if kind else key
    return (None, None) if kind else None


def together(*trees, committed=False):
    """``trees`` with their committed arrays as host (NumPy) arrays where the arrays are
    not all placed alike (other devices, or meshes that differ: statistics of batches a
    loader put on devices round-robin, a last batch on fewer devices), so that one jitted
    function can take them, and its results are committed to no device (as from
    uncommitted inputs: a running sum, once merged so, is not copied again); else as they
    are. With ``committed=True`` (a running sum merged so before), arrays committed to the
    device an uncommitted one sits on are not placed alike either: the sum stays committed
    to no device (a later batch's statistics on that device would commit it).

    >>> import jax.numpy as jnp
    >>> a, b = together(jnp.ones(2), jnp.zeros(2))
    >>> a.devices() == b.devices()
    True
    """
    arrays = [x for x in jax.tree_util.tree_leaves(trees) if isinstance(x, jax.Array)]
    placed = {(frozenset(x.devices()), getattr(x.sharding, "mesh", None), committed and x.committed)
              for x in arrays}
    if len(placed) <= 1:
        return trees
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.committed else x, trees)


def merged(add, total, new, hosted):
    """``(add(total, new), hosted)``: a running sum (statistics, Hessians) and a batch's
    part merged where they sit, through the host where :func:`together` says so, with
    ``hosted`` (whether the sum went through the host, then or before) for the next merge.

    >>> import jax.numpy as jnp
    >>> merged(lambda a, b: a + b, jnp.ones(2), jnp.ones(2), False)[0].tolist()
    [2.0, 2.0]
    """
    pair = together(total, new, committed=hosted)
    return add(*pair), hosted or pair[0] is not total


class UntypedReshape(ValueError):
    """:func:`reshape`'s error; the integer path's handler adds the op's key."""


def reshape(x, shape):
    """``x.reshape(shape)``; where JAX cannot type that reshape on explicit mesh axes
    outside ``jax.set_mesh`` (it merges a dimension split over one axis with a minor one),
    a ``ValueError`` that says to run under ``jax.set_mesh``, where it runs (a replicated
    fallback would gather the operand without a word and give a result of another type,
    which a scan's carry refuses).

    >>> import jax.numpy as jnp
    >>> reshape(jnp.ones((2, 3, 4)), (6, 4)).shape
    (6, 4)
    """
    try:
        return x.reshape(shape)
    except Exception as e:  # jax's ShardingTypeError (not public)
        if type(e).__name__ != "ShardingTypeError":
            raise
        raise UntypedReshape(
            f"jqt: a quantized op flattens its operand (here {jax.typeof(x).str_short()}, "
            f"split over explicit mesh axes) into {tuple(shape)}, which JAX cannot type "
            "outside a context mesh. Run the quantized function under `with "
            "jax.set_mesh(mesh):`, where it runs.") from e


def replicated_if_split(*xs):
    """``out_sharding`` for a reduction of split rows into a small result (a Gram matrix, a
    histogram): replicated on the operand's mesh (an all-reduce) where an operand's type
    splits a dimension over explicit mesh axes, which JAX asks for there; else ``None``.

    >>> import jax.numpy as jnp
    >>> replicated_if_split(jnp.ones((4, 2))) is None
    True
    """
    for x in xs:
        if sharded_dims(x):
            # the operand's own (abstract) mesh: outside a jax.set_mesh a bare PartitionSpec
            # names no mesh, and the program takes the inputs' mesh
            return jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec())
    return None


def is_vmapped(x) -> bool:
    """Whether ``x`` is batched by a ``jax.vmap`` whose trace is the innermost around it (a
    ``BatchTracer`` with a mapped axis): its type shows one example, the program runs all.

    >>> import jax, jax.numpy as jnp
    >>> is_vmapped(jnp.ones(2)), bool(jax.vmap(lambda r: jnp.float32(is_vmapped(r)) + r)(jnp.ones(2))[0])
    (False, True)
    """
    return (_BatchTracer is not None and isinstance(x, _BatchTracer)
            and getattr(x, "batch_dim", NOT_MAPPED) is not NOT_MAPPED)


def _on_mesh(a) -> bool:
    s = getattr(a, "sharding", None)
    return getattr(s, "spec", None) is not None and bool(s.mesh.axis_names)


def _varying(a) -> frozenset:
    mat = getattr(a, "manual_axis_type", None)
    return frozenset() if mat is None else mat.varying


def varying_axes(x) -> tuple:
    """The manual mesh axes ``x``'s type varies over inside ``jax.shard_map`` (a block of
    an array its ``in_specs`` split), sorted; ``()`` elsewhere or for a non-JAX value.

    >>> import jax.numpy as jnp
    >>> varying_axes(jnp.ones(2))
    ()
    """
    try:
        return tuple(sorted(_varying(jax.typeof(x))))
    except TypeError:
        return ()


def vma_checked() -> bool:
    """Whether a ``jax.shard_map`` tracing here checks which manual axes values vary over
    (``check_vma=True``, the default, or outside any): under ``check_vma=False`` no
    value's type says it. True where this JAX does not tell (no guess is made then)."""
    try:
        from jax._src import config as _config
        return bool(_config._check_vma.value)
    except (ImportError, AttributeError):
        return True


def manual_axes() -> dict:
    """The manual mesh axes where this traces (inside ``jax.shard_map``) and their
    sizes: with ``check_vma=False`` no value's type says which of them it varies over.

    >>> manual_axes()
    {}
    """
    mesh = jax.sharding.get_abstract_mesh()
    return {n: mesh.shape[n] for n in getattr(mesh, "manual_axes", ())}


def vary_like(x, like):
    """``x`` typed as varying over every manual mesh axis ``like`` (an array, or the
    ``jax.ShapeDtypeStruct`` ``jax.eval_shape`` gives for one) varies over, inside
    ``jax.shard_map`` (a loop's accumulator of statistics that each device gathers
    itself); ``x`` itself elsewhere.

    >>> import jax.numpy as jnp
    >>> vary_like(jnp.zeros(2), jnp.ones(2)).shape
    (2,)
    """
    t = like if isinstance(like, jax.ShapeDtypeStruct) else jax.typeof(like)
    missing = tuple(sorted(_varying(t) - _varying(jax.typeof(x))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def shaped(shape, dtype, like=(), dims=()):
    """A ``ShapedArray`` for a primitive's abstract evaluation whose type keeps what its
    operands' types say about a mesh: output dimension ``i`` is split over explicit mesh
    axes as ``like[j]``'s dimension ``dims[i][j]`` (``None``: not split), and inside
    ``jax.shard_map`` the output varies over every manual axis some operand varies over
    (as JAX's own primitives type it). Without a mesh in the operands' types (one
    device, auto axes) the plain ``ShapedArray``.

    >>> import jax, jax.numpy as jnp
    >>> shaped((2, 5), jnp.float32, (jax.typeof(jnp.ones((2, 3))),), ((0,), (None,))).shape
    (2, 5)
    """
    typed = [a for a in like if _on_mesh(a)]
    if not typed:
        return jax.core.ShapedArray(shape, dtype)
    base = max(typed, key=lambda a: len(_varying(a)))  # its mesh; its manual axis type
    spec = []
    for per_out in dims:
        split = None
        for a, d in zip(like, per_out):
            if d is not None and split is None and _on_mesh(a) and len(a.sharding.spec):
                split = a.sharding.spec[d % a.ndim]
        spec.append(split)
    kw = {"sharding": base.sharding.update(spec=jax.sharding.PartitionSpec(*spec))}
    varying = frozenset().union(*map(_varying, typed))
    if varying != _varying(base):
        kw["manual_axis_type"] = base.manual_axis_type.update(varying=varying)
    return base.update(shape=tuple(shape), dtype=dtype, weak_type=False, **kw)


def _bind_params(eqn):
    r = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(r, tuple):  # older releases: (subfuns, params)
        return r
    return (), r


def bind_eqn(eqn, invals, *, kernel=False, **overrides):
    """Re-binds ``eqn`` on ``invals`` (what ``jax.core.eval_jaxpr`` does), keeping its
    name stack and context; ``overrides`` replace some of its parameters (e.g. a
    ``dot_general``'s ``preferred_element_type``). ``kernel``: the op is bound in a
    kernel, which :func:`as_typed` may run with the mesh's explicit axes auto; there the
    eqn's own mesh (explicit) is not re-entered, as its operands are typed on the
    region's."""
    subfuns, params = _bind_params(eqn)
    with eqn_context(eqn, mesh=not kernel or eqn_mesh(eqn) == current_mesh()):
        out = (eqn.primitive.bind(*subfuns, *invals, **{**params, **overrides}) if subfuns
               else bind(eqn.primitive, *invals, **{**params, **overrides}))
    return out if eqn.primitive.multiple_results else [out]


def bind(prim, *args, **params):
    """``prim.bind``, its operands first cast to vary over the same manual axes inside
    ``jax.shard_map`` (packed codes replicated, an index split), as lax's own functions
    cast them; outside ``shard_map`` nothing changes."""
    if _auto_insert_reshard is not None:
        args = _auto_insert_reshard(*args)
    return prim.bind(*args, **params)


@contextlib.contextmanager
def eqn_scope(eqn):
    """Enters ``eqn``'s name stack (its ``jax.named_scope``, a Flax module's name) for
    the ops a rule traces in its place, so that they keep the scope in the compiled
    program's metadata (profiles); yields ``eqn`` with an empty name stack, so that a
    :func:`bind_eqn` of it inside does not enter the scope twice."""
    stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
        yield eqn.replace(source_info=eqn.source_info.replace(
            name_stack=source_info_util.new_name_stack()))


@contextlib.contextmanager
def eqn_context(eqn, mesh=True):
    """Re-enters ``eqn``'s name stack (and its context manager, if any, which holds the
    mesh it was traced under: not where ``mesh`` is false) while binding."""
    stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
        ctx = getattr(eqn, "ctx", None)
        manager = getattr(ctx, "manager", None)
        if manager is None or not mesh:
            yield
        else:
            with manager:
                yield


def eqn_mesh(eqn):
    """The abstract mesh ``eqn`` was traced under (``None`` where JAX does not say): a
    different one than the function's is JAX's ``auto_axes`` region, which ``jnp``
    indexing with ``out_sharding=`` opens on explicit mesh axes."""
    return getattr(getattr(eqn, "ctx", None), "cur_abstract_mesh", None)


def current_mesh():
    """The abstract mesh of the current trace context (empty outside ``jax.set_mesh``)."""
    return jax.sharding.get_abstract_mesh()


def as_typed(fn, out_aval, *args):
    """``fn(*args)``, a kernel standing for one op whose float result has the type
    ``out_aval``, with that type's sharding on explicit mesh axes. There JAX asks each op
    for its output's sharding where its operands leave it open (a contraction split over a
    mesh axis: a row-parallel matmul), which the op's ``out_sharding=`` gave; the kernel's
    own ops (integer matmuls over rows, K-chunks, groups) cannot all repeat it. So the
    kernel runs with the mesh's explicit axes auto (``jax.sharding.auto_axes``: XLA places
    its intermediates and partial sums, as for auto axes), and its result is typed as the
    op's. Elsewhere (no explicit axes in the context, an output split over none and no
    operand split) ``fn(*args)`` as it is; outside ``jax.set_mesh``, where JAX cannot type
    the kernel's own ops on operands split over explicit axes (a group sliced out of a
    split K, a flattening that merges a split axis with a minor one), it runs as above on
    the mesh those operands are typed on.

    >>> import jax.numpy as jnp
    >>> as_typed(lambda a: a + 1, jax.typeof(jnp.ones(2)), jnp.ones(2)).tolist()
    [2.0, 2.0]
    """
    mesh = current_mesh()
    explicit = explicit_axes(mesh)
    if not explicit:  # (every op without a mesh: nothing more to look at)
        try:
            return fn(*args)
        except Exception as e:  # JAX's ShardingTypeError (not public), or compat.reshape's
            if not isinstance(e, UntypedReshape) and type(e).__name__ != "ShardingTypeError":
                raise
            mesh = next((m for m in map(_type_mesh, _split_leaves(args)) if explicit_axes(m)), None)
            if mesh is None:
                raise
        # outside jax.set_mesh, operands split over explicit axes that the kernel's own ops
        # (an int8 matmul per group of a split K, a flattening) cannot type: their mesh
        with jax.sharding.use_abstract_mesh(mesh):
            return as_typed(fn, out_aval, *args)
    spec = getattr(getattr(out_aval, "sharding", None), "spec", None)
    if not (spec is not None and any(a is not None for a in spec)) and not _split_leaves(args):
        return fn(*args)
    return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=spec)(*args)


def explicit_axes(mesh) -> tuple:
    """The names of ``mesh``'s Explicit axes (``jax.make_mesh``'s default in recent JAX);
    empty for no mesh, an empty one, or Auto axes only.

    >>> explicit_axes(jax.sharding.get_abstract_mesh())
    ()
    """
    return tuple(n for n, t in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
                 if t == jax.sharding.AxisType.Explicit)


def _type_mesh(x):
    return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def _split_leaves(tree):
    return [a for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "shape") and sharded_dims(a)]


def to_current_mesh(tree):
    """``tree``'s arrays retyped onto the current context's mesh where their type names
    another mesh, or none (into or out of an ``auto_axes`` region: jqt's packed weights
    and qparams go in, its calibration statistics come out), as ``auto_axes`` retypes
    its operands and results; their specs keep the axes explicit on both meshes.
    Outside ``jax.set_mesh`` nothing changes.

    >>> import jax.numpy as jnp
    >>> to_current_mesh({"scale": jnp.ones(3)})["scale"].shape
    (3,)
    """
    mesh = current_mesh()

    def one(x):
        s = getattr(jax.typeof(x), "sharding", None) if is_tracer(x) or isinstance(x, jax.Array) else None
        if s is None or not mesh.axis_names or s.mesh == mesh:
            return x
        return jax.sharding.reshard(x, _modify_spec(s.spec, mesh))

    return jax.tree_util.tree_map(one, tree)


def scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: its operands are the constants,
    then the carries, then the scanned inputs (its outputs the carries, then the stacked
    outputs, one for one with its body's). JAX 0.10 gives the two counts as parameters;
    JAX 0.11 gives ``ft_in``, a tree of the (consts, carries, xs) operands."""
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    ft_in = p.get("ft_in")
    if ft_in is not None and hasattr(ft_in, "unpack"):
        consts, carry, _ = ft_in.unpack()
        return len(consts), len(carry)
    import jax
    raise NotImplementedError(
        f"jqt: this JAX release ({jax.__version__}) represents lax.scan with parameters "
        f"jqt does not know ({sorted(p)}; jqt reads 'num_consts'/'num_carry' or 'ft_in'), so "
        "jqt cannot quantize a function that holds a lax.scan (or lax.map, fori_loop with a "
        "fixed trip count, flax nn.scan / nnx.scan) under it. Install a JAX that jqt "
        "supports: pip install 'jax>=0.10.2,<0.12' 'jaxlib>=0.10.2,<0.12'.")


def name_stack(eqn) -> str:
    return str(eqn.source_info.name_stack)


def where_called(eqn) -> str:
    """Names a call equation (a custom_jvp/custom_vjp function) for an error message:
    ``'clip' (defined at model.py:12), at 'Block_0'``, from the traced function's source
    (not when a wrapper of JAX's or a framework's traced it: Flax's ``nn.custom_vjp``),
    and the name scope it ran in (``'<top>'`` for none)."""
    info = getattr(eqn.params["call_jaxpr"].jaxpr, "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""
    name, _, at = src.partition(" at ")
    own = name and at and not any(os.path.abspath(at).startswith(d) for d in _framework_dirs())
    return (f"'{name}' (defined at {at}), " if own else "") + f"at '{name_stack(eqn) or '<top>'}'"


@functools.lru_cache(maxsize=None)
def _framework_dirs() -> tuple:
    """The installed packages of JAX and the frameworks whose wrappers trace a user's
    custom_vjp functions (Flax's ``nn.custom_vjp``): their own files name no user code."""
    import importlib.util
    dirs = []
    for lib in ("jax", "flax", "equinox"):
        spec = importlib.util.find_spec(lib)
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.join(os.path.abspath(d), "") for d in spec.submodule_search_locations]
    return tuple(dirs)


def is_literal(v) -> bool:
    return isinstance(v, Literal)


def is_zero_tangent(t) -> bool:
    """Whether a JVP rule's tangent ``t`` is JAX's symbolic zero (that input not perturbed).

    >>> is_zero_tangent(ad.Zero(jax.core.ShapedArray((), jnp.float32))), is_zero_tangent(1.0)
    (True, False)
    """
    return type(t) is ad.Zero


def is_zero_literal(v) -> bool:
    """A literal scalar 0 (``jnp.where(done, 0.0, cache)`` passes one to ``_where``)."""
    return isinstance(v, Literal) and np.ndim(v.val) == 0 and not isinstance(v.val, (bool, np.bool_)) \
        and v.val == 0


def is_dropvar(v) -> bool:
    return isinstance(v, DropVar)


_TRACE_SETTINGS = ("jax_enable_x64", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
                   "jax_default_matmul_precision")


def register_cache(obj, for_what: str) -> None:
    """Has ``jax.clear_caches()`` call ``obj.cache_clear()`` too (``obj`` held weakly), as
    it clears JAX's own trace caches, where this JAX keeps such a registry."""
    try:
        from jax._src import util as _util
        _util.register_cache(obj, for_what)
    except (ImportError, AttributeError):  # pragma: no cover - another JAX
        pass


def trace_settings() -> tuple:
    """The JAX settings a trace depends on (the dtype of ``jnp.asarray(1.0)``, promotion
    checks, matmul precision, ...): JAX's own trace context, which ``jax.jit`` keys its
    cache on, where this JAX has it; a jaxpr traced under others is not reused."""
    try:
        from jax._src import config as _config
        return _config.trace_context()
    except (ImportError, AttributeError):  # pragma: no cover - another JAX
        return tuple(getattr(jax.config, name, None) for name in _TRACE_SETTINGS)


def weak_typed(x):
    """``x`` (an array) as a weakly typed JAX array, as ``jnp.asarray(0.5)`` is: it takes
    the dtype of what it meets (a bfloat16 operand stays bfloat16). JAX has no public way
    to make one from an array."""
    from jax._src.lax.lax import _convert_element_type
    return _convert_element_type(x, weak_type=True)


def is_weak(x) -> bool:
    """Whether ``x`` is a weakly typed JAX array."""
    return bool(getattr(x, "weak_type", False))


def is_tracer(x) -> bool:
    """Whether ``x`` is a tracer (its values unknown: under ``jax.jit``, ``jax.grad``...)."""
    import jax
    return isinstance(x, jax.core.Tracer)


# The primitives jqt's tables are keyed by (one object per primitive: no name aliases).
from jax.extend.core import primitives as _prims  # noqa: E402

dot_general_p = _prims.dot_general_p
conv_general_dilated_p = _prims.conv_general_dilated_p
gather_p = _prims.gather_p
dynamic_update_slice_p = _prims.dynamic_update_slice_p
dynamic_slice_p = _prims.dynamic_slice_p
scatter_p = _prims.scatter_p
transpose_p = _prims.transpose_p
select_n_p = _prims.select_n_p
broadcast_in_dim_p = _prims.broadcast_in_dim_p
reshape_p = _prims.reshape_p
squeeze_p = _prims.squeeze_p
convert_element_type_p = _prims.convert_element_type_p
slice_p = _prims.slice_p
try:  # lax.ragged_dot's primitive (not in jax.extend's list)
    from jax._src.lax.lax import ragged_dot_general_p
except ImportError:  # pragma: no cover - a JAX without lax.ragged_dot
    ragged_dot_general_p = None


def is_plain_ragged_dot(eqn) -> bool:
    """Whether ``eqn`` is ``lax.ragged_dot(x, w, group_sizes)`` in its usual form: ``x (M, K)``
    ragged along M, ``w (G, K, N)`` one ``(K, N)`` matrix per group, no group offset."""
    rd = eqn.params.get("ragged_dot_dimension_numbers")
    return (rd is not None and eqn.params.get("group_offset") is None
            and tuple(map(tuple, rd.dot_dimension_numbers[0])) == ((1,), (1,))
            and not any(rd.dot_dimension_numbers[1]) and tuple(rd.lhs_ragged_dimensions) == (0,)
            and tuple(rd.rhs_group_dimensions) == (0,)
            and [v.aval.ndim for v in eqn.invars[:2]] == [2, 3])


def vjp_primal_values(tree):
    """A ``custom_vjp`` fwd's argument under ``symbolic_zeros=True`` (a pytree of
    ``CustomVJPPrimal``): ``(values, whether any leaf is perturbed)``."""
    from jax.custom_derivatives import CustomVJPPrimal
    is_p = lambda x: isinstance(x, CustomVJPPrimal)
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_p)
    return (jax.tree_util.tree_map(lambda x: x.value if is_p(x) else x, tree, is_leaf=is_p),
            any(x.perturbed for x in leaves if is_p(x)))


def instantiate_zeros(tree):
    """A ``custom_vjp`` bwd's cotangents under ``symbolic_zeros=True`` with each
    ``SymbolicZero`` made an array of zeros."""
    from jax.custom_derivatives import SymbolicZero
    z = lambda x: isinstance(x, SymbolicZero)
    return jax.tree_util.tree_map(
        lambda x: jax.numpy.zeros(x.shape, x.dtype) if z(x) else x, tree, is_leaf=z)


def jvp_tangents(tree):
    """A ``custom_jvp`` rule's tangents under ``symbolic_zeros=True``: ``(the tangents
    with each ``SymbolicZero`` made zeros of its tangent type, whether all were symbolic
    zeros)``."""
    from jax._src.ad_util import zeros_like_aval
    from jax.custom_derivatives import SymbolicZero
    z = lambda x: isinstance(x, SymbolicZero)
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=z)
    return (jax.tree_util.tree_map(lambda x: zeros_like_aval(x.aval) if z(x) else x, tree, is_leaf=z),
            all(z(x) for x in leaves))


jit_p = _prims.jit_p
closed_call_p = _prims.closed_call_p
call_p = _prims.call_p
remat_p = _prims.remat_p
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p
scan_p = _prims.scan_p
while_p = _prims.while_p
cond_p = _prims.cond_p
try:  # jax.shard_map's primitive (not in jax.extend's list)
    from jax._src.shard_map import shard_map_p
except ImportError:  # pragma: no cover - a release that moved it: shard_map stays float
    shard_map_p = None


def shard_map_axes(eqn) -> tuple:
    """The mesh axes a ``shard_map`` equation makes manual, in the mesh's order."""
    p = eqn.params
    manual = set(p["newly_manual_axes"])
    return tuple(a for a in p["mesh"].axis_names if a in manual)


def spec_names(entry) -> tuple:
    """A ``PartitionSpec`` entry's mesh axis names: ``()`` for ``None``, ``("x",)`` for
    ``"x"``, the tuple itself for ``("x", "y")``."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_map_bind(eqn, fn, args, in_specs, out_specs):
    """``jax.shard_map(fn)(*args)`` with the mesh, manual axes and ``check_vma`` of the
    ``shard_map`` equation ``eqn``. On explicit mesh axes each argument is first resharded
    to its spec (a prefix of its tree), as ``shard_map`` takes explicitly sharded inputs
    only as they are; arguments already so split are unchanged."""
    p = eqn.params
    mesh = p["mesh"]
    if explicit_axes(mesh) and isinstance(mesh, jax.sharding.Mesh):
        def put(spec, tree):
            sh = jax.sharding.NamedSharding(mesh, spec)
            return jax.tree_util.tree_map(lambda a: jax.reshard(a, sh), tree)
        args = jax.tree_util.tree_map(put, in_specs, args, is_leaf=lambda s: isinstance(
            s, jax.sharding.PartitionSpec))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(p["newly_manual_axes"]), check_vma=p["check_vma"])(*args)


def with_output_dtype(eqn, dtype):
    """``eqn`` (one output) with its output typed ``dtype`` (and its
    ``preferred_element_type``, where it names one): a kernel that casts its result to
    the output's dtype then keeps ``dtype``.

    >>> import jax, jax.numpy as jnp
    >>> e = jax.make_jaxpr(jnp.dot)(jnp.ones((2, 2), jnp.bfloat16), jnp.ones((2, 2), jnp.bfloat16)).eqns[0]
    >>> with_output_dtype(e, jnp.float32).outvars[0].aval.dtype
    dtype('float32')
    """
    aval = eqn.outvars[0].aval.update(dtype=np.dtype(dtype), weak_type=False)
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = np.dtype(dtype)
    return eqn.replace(outvars=[jex_core.Var(aval)], params=params)


@functools.lru_cache(maxsize=256)
def row_gather_eqn(shape, dtype, axes, sizes=None):
    """The ``gather`` equation that reads one row of a table of ``shape`` at ``axes``
    (the indexed axes; the others read whole), clamped into the table as
    ``dynamic_slice`` clamps, with the slice's shape (each indexed axis kept with length
    1). A 2-D table's row (``axes=(0,)``) or column (``(1,)``) takes an index of shape
    ``(1, 1)``; a larger table's row an index vector of shape ``(len(axes),)``, as does a
    slice of other ``sizes`` (a part of a row), read at its start. A window of ``T`` rows
    of a 2-D table (``sizes=(T, D)``; ``T`` may be symbolic) is ``T`` rows at indices of
    shape ``(T, 1)``: ``table[ids]``.

    >>> e = row_gather_eqn((5, 3), "float32", (0,))
    >>> e.primitive.name, e.outvars[0].aval.shape, e.params["slice_sizes"]
    ('gather', (1, 3), (1, 3))
    >>> e = row_gather_eqn((2, 5, 3), "float32", (0, 1))
    >>> e.invars[1].aval.shape, e.outvars[0].aval.shape
    ((2,), (1, 1, 3))
    >>> e = row_gather_eqn((5, 3), "float32", (0,), (2, 3))
    >>> e.invars[1].aval.shape, e.outvars[0].aval.shape
    ((2, 1), (2, 3))
    """
    t = jax.ShapeDtypeStruct(shape, dtype)
    one = tuple(1 if d in axes else n for d, n in enumerate(shape))
    sizes = one if sizes is None else tuple(sizes)
    if len(shape) == 2 and tuple(axes) == (0,) and (not isinstance(sizes[0], int) or sizes != one):
        i = jax.ShapeDtypeStruct((sizes[0], 1), "int32")
        dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                            start_index_map=(0,))
        sizes = one
    elif len(shape) == 2 and sizes == one and len(axes) == 1:
        (axis,) = axes
        i = jax.ShapeDtypeStruct((1, 1), "int32")
        dn = jax.lax.GatherDimensionNumbers(offset_dims=(1 - axis,), collapsed_slice_dims=(axis,),
                                            start_index_map=(axis,))
    else:
        i = jax.ShapeDtypeStruct((len(axes),), "int32")
        dn = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(len(shape))),
                                            collapsed_slice_dims=(), start_index_map=tuple(axes))
    gather = lambda t, i: jax.lax.gather(t, i, dn, sizes, mode=jax.lax.GatherScatterMode.CLIP)
    return jax.make_jaxpr(gather)(t, i).jaxpr.eqns[-1]


def pytree_serialization_registries():
    """jax.export's registries of custom pytree nodes ({type: (name, serialize)},
    {name: (type, deserialize, from_children)}), or empty ones if JAX moved them."""
    try:
        from jax._src.export import _export
        return _export.serialization_registry, _export.deserialization_registry
    except (ImportError, AttributeError):  # pragma: no cover - a JAX release moved them
        return {}, {}


def lowering_is_portable(ctx) -> bool:
    """Whether a lowering rule's context needs portable StableHLO, with no custom call
    that only this process registered: a ``jax.export`` lowering (its artifact runs in
    other processes), or an SPMD program over several devices (the partitioner does not
    know how to split a custom call). ``ctx``: an ``mlir.LoweringRuleContext``."""
    mod = ctx.module_context
    params = getattr(mod, "lowering_parameters", None)
    if params is None or getattr(params, "for_export", True):
        return True
    ax = mod.axis_context
    mesh = getattr(ax, "mesh", None)
    if mesh is not None:  # shard_map: per-device code where every mesh axis is manual
        return set(getattr(ax, "manual_axes", ())) != set(mesh.axis_names)
    return getattr(ax, "num_devices", 1) > 1


def register_cpu_lowering(prim, cpu_rule, reference_rule):
    """Lowers ``prim`` by ``cpu_rule`` (a custom call) in modules lowered for the CPU alone
    and by ``reference_rule`` in every other: another platform, or a ``jax.export`` for
    several at once (``platforms=("cpu", "cuda")``), where JAX (0.10) cannot build its
    per-platform dispatch around a rule registered for one platform that is not cached
    (``cacheable=False``: the rule depends on the context, :func:`lowering_is_portable`).
    One rule for every platform, choosing by the module's platforms, needs no dispatch."""

    def lower(ctx, *args, **params):
        if tuple(ctx.module_context.platforms) == ("cpu",):
            return cpu_rule(ctx, *args, **params)
        return reference_rule(ctx, *args, **params)

    mlir.register_lowering(prim, lower, cacheable=False)


def define_by_reference(prim, reference, batch=None):
    """Rules for a primitive whose meaning is ``reference`` (a function of its operands and
    params built of JAX ops), whose CPU lowering a caller registers (a custom call):
    eager calls compiled, the lowering on other platforms ``reference``'s, ``jax.vmap``
    by ``batch`` (default: ``reference`` mapped) and ``jax.jvp`` ``reference``'s.
    Returns the reference lowering, for the CPU rule to fall back to."""

    @prim.def_impl
    def _impl(*args, **params):
        with jax.disable_jit(False):  # compiled even under jax.disable_jit (else bind recurses)
            return jax.jit(functools.partial(prim.bind, **params))(*args)

    def lower(ctx, *args, **params):
        return mlir.lower_fun(functools.partial(reference, **params),
                              multiple_results=False)(ctx, *args)

    def mapped(args, dims, **params):
        axes = tuple(None if d is NOT_MAPPED else d for d in dims)
        return jax.vmap(functools.partial(reference, **params), in_axes=axes)(*args), 0

    def jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return jax.jvp(functools.partial(reference, **params), tuple(primals), tuple(tangents))

    mlir.register_lowering(prim, lower, cacheable=False)
    batching.primitive_batchers[prim] = batch or mapped
    ad.primitive_jvps[prim] = jvp
    return lower
