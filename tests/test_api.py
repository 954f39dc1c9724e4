"""Public API: recipes, qparams pytrees, pack, save/load, and the errors users hit."""
import copy
import dataclasses
import functools
import os

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt


def mlp(p, x):
    h = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"])
    return h @ p["l2"]["w"].T + p["l2"]["b"]  # l2 stored (out, in): reached through a transpose


@pytest.fixture(scope="module")
def setup():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"l1": {"w": jax.random.normal(k[0], (6, 16)), "b": jnp.zeros(16)},
         "l2": {"w": jax.random.normal(k[1], (3, 16)) / 4, "b": jnp.zeros(3)}}
    xs = [(jax.random.normal(k[2 + i % 2], (8, 6)) * (1 + i),) for i in range(3)]
    qp = jqt.calibrate(mlp, jqt.recipes.w8a8(), p, xs, progress=False)
    return p, xs, qp


def test_keys_scales_and_stats_merged_across_batches(setup):
    p, xs, qp = setup
    assert list(qp) == ["l1/w", "l2/w"]
    q = qp["l1/w"]
    assert q.weight_operand == 1 and q.rhs.scale.shape == (1, 16) and q.lhs.scale.shape == ()
    np.testing.assert_allclose(q.rhs.scale[0], jnp.abs(p["l1"]["w"]).max(0) / 127, rtol=1e-6)
    allx = jnp.concatenate([x for (x,) in xs])  # running min/max over every batch
    lo, hi = float(allx.min()), float(allx.max())
    np.testing.assert_allclose(q.lhs.scale, (hi - lo) / 255, rtol=1e-5)
    assert qp["l2/w"].source.chain == (("transpose", (1, 0)),)


def test_qparams_are_pytrees(setup):
    _, _, qp = setup
    leaves, tree = jax.tree_util.tree_flatten(qp)
    assert len(leaves) == 6  # 2 ops x (weight scale, act scale, act zero point)
    assert jax.tree_util.tree_unflatten(tree, leaves)["l1/w"].rhs.qtype == qp["l1/w"].rhs.qtype
    doubled = jax.tree_util.tree_map(lambda a: a * 2, qp)
    np.testing.assert_allclose(doubled["l1/w"].rhs.scale, 2 * qp["l1/w"].rhs.scale)
    # two qparams trees for weights of other shapes differ in their sources' shape, which
    # JAX's error printed as identical metadata (the repr left it out; hunt37_distill)
    f = lambda p, x: x @ p["w"]
    q4, q8 = (jqt.calibrate(f, jqt.recipes.w8(), {"w": jnp.ones((2, n))}, [(jnp.ones((1, 2)),)],
                            progress=False) for n in (4, 8))
    with pytest.raises(ValueError, match=r"shape=\(2, 4\)(.|\n)*shape=\(2, 8\)"):
        jax.tree_util.tree_map(lambda a, b: a, q4, q8)


def test_summarize_and_repr(setup):
    _, _, qp = setup
    text = jqt.summarize(qp)
    assert "l1/w" in text and "int8 sym per-channel" in text and "int8 asym per-tensor" in text
    assert "scale[1x16]" in repr(qp["l1/w"])


def test_qparams_compare_equal_by_their_values(setup, tmp_path):
    """qp == a copy raised "the truth value of an array ... is ambiguous" for per-channel
    scales (the dataclasses' generated __eq__; hunt70_pytreeops)."""
    _, _, qp = setup
    path = str(tmp_path / "qp.safetensors")
    jqt.save(path, qp)
    assert qp == copy.deepcopy(qp) and qp == jqt.load(path) and qp["l1/w"].rhs == qp["l1/w"].rhs
    w = qp["l1/w"]
    for other in (dataclasses.replace(w, rhs=dataclasses.replace(w.rhs, scale=w.rhs.scale * 2)),
                  dataclasses.replace(w, rhs=dataclasses.replace(w.rhs, scale=w.rhs.scale[:-1])),
                  dataclasses.replace(w, rhs=dataclasses.replace(w.rhs, scale=w.rhs.scale.astype(jnp.bfloat16))),
                  dataclasses.replace(w, rhs=None)):
        assert w != other and {**qp, "l1/w": other} != qp


def test_summarize_shows_no_weight_for_a_product_of_activations():
    # An act x act dot has no weight: its weight column said "float", as if half of it
    # stayed float (hunt62_summarize); "-" as in jqt.report's rows and the cache writes.
    f = lambda p, x: (x @ p["w"]) @ x.T
    p = {"w": jnp.eye(8) * 0.5}
    x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    qp = jqt.calibrate(f, jqt.recipes.w8a8_dynamic(act_x_act=True), p, [(x,)], progress=False)
    rows = {line.split()[0]: line.split()[2] for line in jqt.summarize(qp).splitlines()[1:]}
    assert rows["w"] != "-" and "float" not in rows["w"]
    assert [v for k, v in rows.items() if k != "w"] == ["-"]


def test_pack_drops_float_kernels_and_matches(setup):
    p, xs, qp = setup
    packed = jqt.pack(qp, p)
    assert set(packed.weights) == {"l1/w", "l2/w"}
    assert len(packed.leaves) == 2  # the biases
    w_bytes = sum(int(np.prod(p[k]["w"].shape)) * 4 for k in ("l1", "l2"))
    q_bytes = sum(w.values.nbytes for w in packed.weights.values())
    assert q_bytes <= 0.26 * w_bytes
    qf = jax.jit(jqt.quantize(mlp, qp))
    np.testing.assert_array_equal(qf(packed, xs[0][0]), qf(p, xs[0][0]))
    sim = jqt.quantize(mlp, qp, simulate=True)
    np.testing.assert_allclose(sim(packed, xs[0][0]), sim(p, xs[0][0]), atol=1e-6)


def test_pack_keeps_leaf_used_as_float_too():
    def f(p, x):
        return x @ p["w"] + p["w"].sum(0)  # the kernel is also read as a float
    p = {"w": jnp.ones((4, 4))}
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((2, 4)),)], progress=False)
    packed = jqt.pack(qp, p)
    assert len(packed.leaves) == 1 and "w" in packed.weights
    np.testing.assert_allclose(jqt.quantize(f, qp)(packed, jnp.ones((2, 4))), f(p, jnp.ones((2, 4))),
                               rtol=0.02)


def test_save_load_round_trip(tmp_path, setup):
    p, xs, qp = setup
    path = os.path.join(tmp_path, "qp.npz")
    jqt.save(path, qp)
    back = jqt.load(path)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(qp)
    for a, b in zip(jax.tree_util.tree_leaves(qp), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jqt.quantize(mlp, back)(jqt.pack(back, p), xs[0][0]),
                                  jqt.quantize(mlp, qp)(p, xs[0][0]))


def test_load_rejects_other_files(tmp_path):
    path = os.path.join(tmp_path, "x.npz")
    np.savez(path, a=np.ones(2))
    with pytest.raises(ValueError, match="not a jqt qparams file"):
        jqt.load(path)


# ---- errors ------------------------------------------------------------------------------------

def test_empty_calibration_set(setup):
    p, _, _ = setup
    with pytest.raises(jqt.CalibrationDataError, match="empty"):
        jqt.calibrate(mlp, jqt.recipes.w8a8(), p, [], progress=False)


def test_nan_in_calibration_data(setup):
    p, xs, _ = setup
    bad = xs[0][0].at[0, 0].set(jnp.nan)
    with pytest.raises(jqt.CalibrationDataError, match=r"batch 1, argument \[0\].*NaN"):
        jqt.calibrate(mlp, jqt.recipes.w8a8(), p, [xs[0], (bad,)], progress=False)


def test_inconsistent_batches(setup):
    p, xs, _ = setup
    with pytest.raises(jqt.CalibrationDataError, match="batch 1 has structure"):
        jqt.calibrate(mlp, jqt.recipes.w8a8(), p, [xs[0], (xs[0][0], xs[0][0])], progress=False)
    with pytest.raises(jqt.CalibrationDataError, match="must be a tuple"):
        jqt.calibrate(mlp, jqt.recipes.w8a8(), p, [xs[0][0]], progress=False)


def test_qparams_of_another_function(setup):
    p, xs, qp = setup
    other = lambda p, x: x @ p["l1"]["w"]
    with pytest.raises(jqt.QParamsMismatchError, match="keys the function does not have.*l2/w"):
        jqt.quantize(other, qp)(p, xs[0][0])
    extra = {"l1": p["l1"], "l3": {"w": jnp.ones((16, 2))}, "l2": p["l2"]}
    g = lambda p, x: mlp(p, x) @ jnp.ones((3, 16)) @ p["l3"]["w"]
    # (the product with jnp.ones, a matrix f builds, is float and needs no entry)
    with pytest.raises(jqt.QParamsMismatchError, match=r"no quantization parameters for ops \['l3/w'\]"):
        jqt.quantize(g, qp)(extra, xs[0][0])


def test_weights_changed_shape(setup):
    p, xs, qp = setup
    p2 = {"l1": {"w": jnp.ones((6, 8)), "b": jnp.zeros(8)},
          "l2": {"w": jnp.ones((3, 8)), "b": jnp.zeros(3)}}
    with pytest.raises(jqt.QParamsMismatchError, match=r"'l1/w' of shape \(6, 16\), but this call "
                       r"passes it with shape \(6, 8\): the weights changed shape"):
        jqt.quantize(mlp, qp)(p2, xs[0][0])
    # qparams that do not record the shape (files written before it): the scale's shape tells
    old = {k: dataclasses.replace(v, source=dataclasses.replace(v.source, shape=None)) for k, v in qp.items()}
    with pytest.raises(jqt.QParamsMismatchError, match=r"'l1/w'.*\(1, 16\).*needs \(1, 8\)"):
        jqt.quantize(mlp, old)(p2, xs[0][0])


def test_keyword_arguments_naming_positional_parameters_are_bound(setup):
    # (keyword-only ones are refused: tests/test_misuse.py)
    p, xs, qp = setup
    qf = jqt.quantize(mlp, qp)
    np.testing.assert_array_equal(qf(p, x=xs[0][0]), qf(p, xs[0][0]))


def test_keywords_bind_to_a_wrappers_own_parameters(setup):
    """functools.wraps gives a wrapper the inner function's __wrapped__; its keywords bind to
    the wrapper's own parameters (reordered, one added), and to the inner function's only
    through a pass-through wrapper (*args, **kwargs). A reordering wrapper's keywords were
    bound by the inner signature (refused as given twice; swapped where they did not clash)."""
    p, xs, _ = setup
    x = xs[0][0]

    @functools.wraps(mlp)
    def swapped(x, p, scale=1.0):
        return mlp(p, x) * scale

    @functools.wraps(mlp)
    def passthru(*a, **k):
        return mlp(*a, **k)

    qs = jqt.quantize(swapped, jqt.calibrate(swapped, jqt.recipes.w8a8(), p, [(x,)],
                                             weight_argnums=1, progress=False), weight_argnums=1)
    np.testing.assert_array_equal(qs(x, p=p), qs(x, p))
    np.testing.assert_array_equal(qs(x, p, scale=2.0), qs(x, p, 2.0))
    np.testing.assert_array_equal(qs(p=p, x=x), qs(x, p))
    @functools.wraps(mlp)
    def logged(*a):  # a pass-through too, keyword-only parameters aside
        return mlp(*a)

    @functools.wraps(mlp)
    def flagged(*a, debug=False, **k):
        return mlp(*a, **k)

    for w in (passthru, logged, flagged):
        qq = jqt.quantize(w, jqt.calibrate(w, jqt.recipes.w8a8(), p, [(x,)], progress=False))
        np.testing.assert_array_equal(qq(p, x=x), qq(p, x))
    # a pass-through's own keyword-only parameter: told how such arguments reach f (it was
    # "unexpected keyword argument 'debug'")
    with pytest.raises(TypeError, match=r"keyword-only arguments \(\['debug'\]\) reach f only through "
                       r"functools.partial"):
        qq(p, x, debug=True)


def test_recipe_validation():
    with pytest.raises(ValueError, match="bits must be an int from 2 to 16"):
        jqt.QuantType(bits=17)
    with pytest.raises(ValueError, match="symmetric=True"):
        jqt.QuantType(bits=16, symmetric=False)
    with pytest.raises(ValueError, match="weights are stored in int8"):
        jqt.Rule(weight=jqt.QuantType(bits=12))
    with pytest.raises(TypeError, match="jqt.calibrators.Calibrator"):
        jqt.Rule(weight=jqt.QuantType(), calibrator="percentile")
    with pytest.raises(ValueError, match="valid regular expression"):
        jqt.Rule(key="(", weight=jqt.QuantType())
    with pytest.raises(ValueError, match="weight=None"):
        jqt.Rule(activation=jqt.QuantType())
    with pytest.raises(ValueError, match="per-tensor"):
        jqt.Rule(weight=jqt.QuantType(), activation=jqt.QuantType(per_channel=True))
    with pytest.raises(ValueError, match="dynamic=True"):
        jqt.Rule(act_x_act=jqt.QuantType())
    with pytest.raises(TypeError, match="tuple of primitive names"):
        jqt.Rule(ops="dot_general")
    with pytest.raises(TypeError, match=r"primitive object dot_general_p; .*ops=\('dot_general',\)"):
        jqt.Rule(ops=(jax.lax.dot_general_p,))  # it was "names [dot_general]; jqt quantizes ['dot_general', ...]"
    for ops, hint in ((jax.lax.gather_p, "gather"), (None, "dot_general")):  # "... is not iterable"
        with pytest.raises(TypeError, match=rf"must be a tuple of primitive names, e.g. ops=\('{hint}',\)"):
            jqt.Rule(ops=ops)
    with pytest.raises(TypeError, match="jqt.Recipe"):
        jqt.calibrate(mlp, "w8a8", {}, [], progress=False)
    with pytest.raises(dataclasses_error()):
        jqt.recipes.w8a8().rules[0].weight.bits = 4


def dataclasses_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_rules_first_match_and_float_ops(setup):
    p, xs, _ = setup
    recipe = jqt.Recipe(rules=(jqt.Rule(key="^l2/", weight=None),) + jqt.recipes.w8a8().rules)
    qp = jqt.calibrate(mlp, recipe, p, xs, progress=False)
    assert qp["l2/w"].is_float and not qp["l1/w"].is_float
    assert "keeps it float" in jqt.summarize(qp)
    packed = jqt.pack(qp, p)
    assert list(packed.weights) == ["l1/w"] and len(packed.leaves) == 3  # l2/w stays float
    y = jqt.quantize(mlp, qp)(packed, xs[0][0])
    assert jnp.isfinite(y).all()


def test_weight_argnums(setup):
    p, xs, _ = setup
    f = lambda x, p: mlp(p, x)
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, xs, weight_argnums=1, progress=False)
    assert list(qp) == ["l1/w", "l2/w"]
    y = jqt.quantize(f, qp, weight_argnums=1)(xs[0][0], jqt.pack(qp, p, argnum=1))
    np.testing.assert_allclose(y, mlp(p, xs[0][0]), atol=0.1)


def test_unsupported_higher_order_primitive_warns():
    """A matmul inside a primitive jqt does not traverse stays float, and the user is told."""
    @jax.custom_batching.custom_vmap
    def f(w, x):
        return x @ w

    f.def_vmap(lambda axis_size, in_batched, w, x: (jax.vmap(lambda x: f(w, x))(x), True))
    w, x = jnp.eye(4), jnp.ones((2, 4))
    with pytest.warns(UserWarning, match="primitive 'custom_vmap_call'.*stay float"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    assert qp == {}
    with pytest.warns(UserWarning, match="custom_vmap_call"):
        np.testing.assert_array_equal(jqt.quantize(f, qp)(w, x), f(w, x))


def test_packed_weights_with_qparams_that_keep_the_op_float():
    """Packed params whose int8 weight replaced a leaf cannot run with qparams that keep
    that op float: the leaf is gone, so jqt says so instead of reading zeros."""
    f = lambda p, x: x @ p["w"]
    p, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
    packed = jqt.pack(jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False), p)
    keep_float = jqt.Recipe(rules=(jqt.Rule(key="w", weight=None),) + jqt.recipes.w8a8().rules)
    qp_float = jqt.calibrate(f, keep_float, p, [(x,)], progress=False)
    with pytest.raises(jqt.QParamsMismatchError, match="'w' reads weight 'w', which jqt.pack dropped"):
        jqt.quantize(f, qp_float)(packed, x)
    np.testing.assert_allclose(jqt.quantize(f, qp_float)(p, x), f(p, x))


def test_packed_weights_a_function_also_reads_as_floats():
    """A leaf jqt.pack dropped (the function it was calibrated on read it only through a
    quantized op) is refused by a function with the same op keys that also reads it as
    a float, instead of giving that read the zeros in its place; under jit and vmap too."""
    f = lambda p, x: x @ p["w"]
    g = lambda p, x: x @ p["w"] + jnp.max(jnp.abs(p["w"]))  # the same op keys as f
    p = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
    x = jax.random.normal(jax.random.key(1), (2, 8))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    assert packed.kept == ()
    for run in (jqt.quantize(g, qp), jax.jit(jqt.quantize(g, qp)),
                jax.vmap(jqt.quantize(g, qp), in_axes=(None, 0))):
        with pytest.raises(jqt.QParamsMismatchError, match="reads weight 'w' as a float value"):
            run(packed, x)
    np.testing.assert_allclose(jqt.quantize(f, qp)(packed, x), jqt.quantize(f, qp)(p, x))
    qp_g = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    # g's float read keeps 'w' beside its codes: pack says so (it said nothing, and the
    # packed params outgrew the float ones)
    with pytest.warns(UserWarning, match=r"weight 'w' \(op 'w'\) packed and also kept as float "
                                         r"\(128 bytes\): f reads it as a float outside"):
        packed_g = jqt.pack(qp_g, p)
    assert packed_g.kept == (0,)
    # ... but not where an op the recipe leaves float reads it (a tied table's lookup under
    # embeddings=False): kept by choice
    t = {"emb": jax.random.normal(jax.random.key(2), (16, 8))}
    tied = lambda p, ids: jnp.tanh(p["emb"][ids]) @ p["emb"].T
    qp_t = jqt.calibrate(tied, jqt.recipes.w8a8(embeddings=False), t, [(jnp.arange(4),)], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert jqt.pack(qp_t, t).kept == (0,)
    np.testing.assert_allclose(jqt.quantize(g, qp_g)(packed_g, x), jqt.quantize(g, qp_g)(p, x))


def test_importing_jqt_starts_no_jax_backend():
    """A module-level ``jnp.asarray`` started JAX's backends at ``import jqt``, so settings
    JAX takes only before its first computation failed when made after the imports:
    ``jax.distributed.initialize()``, ``jax_num_cpu_devices``, ``jax_platforms``."""
    import subprocess
    import sys
    code = ("import jax, jqt\njax.config.update('jax_num_cpu_devices', 3)\n"
            "print(len(jax.devices('cpu')))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "3", run.stderr[-800:]


def test_an_eager_call_compiles_a_program_named_after_f(caplog):
    """The program an eager call compiles carries f's name, as jax.jit(qf)'s does: it was
    '<lambda>' in compile logs and compilation-cache keys (hunt32_aot)."""
    def served(w, x):
        return x @ w

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    qp = jqt.calibrate(served, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    with jax.log_compiles(), caplog.at_level("DEBUG"):
        jqt.quantize(served, qp)(w, x)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert compiled and all(m.startswith("Compiling jit(served)") for m in compiled), compiled


def test_a_quantized_function_follows_x64_and_names_a_donated_argument_when_warm():
    """The trace was kept across ``jax_enable_x64`` changes (the output dtype followed the
    first call's mode); after a warm call, an argument another jit had donated gave XLA's
    "Invalid buffer passed to Execute() as argument 8", not jqt's message naming it."""
    f = lambda p, x: (x @ p["w"]) * jnp.asarray(1.0, dtype=float)  # float64 under x64
    p = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
    x = jax.random.normal(jax.random.key(1), (2, 8))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    qf = jqt.quantize(f, qp)
    with jax.enable_x64(True):
        assert qf(p, x).dtype == jnp.float64
    assert qf(p, x).dtype == f(p, x).dtype == jnp.float32
    gone = x + 0
    jax.jit(lambda a: a * 2, donate_argnums=0)(gone)
    with pytest.raises(ValueError, match=r"\(quantized\): argument leaf \[1\] has been deleted"):
        qf(p, gone)


def test_review_of_the_key_and_shape_checks():
    """The weight-shape check held eagerly but not for qparams passed to jax.jit as an
    argument (WeightSource.shape was left out of equality, so the jit cache hit); the
    renamed-argument note fired for any two one-argument models; a lookup of whole matrices
    from a stack computed in f crashed calibrate's warning (source None)."""
    f = lambda p, x: x @ p["w"]
    x = jnp.ones((2, 3))
    qa = jqt.calibrate(f, jqt.recipes.w8a8(), {"w": jnp.ones((3, 4))}, [(x,)], progress=False)
    qb = jqt.calibrate(f, jqt.recipes.w8a8(), {"w": jnp.ones((3, 6))}, [(x,)], progress=False)
    step = jax.jit(lambda qp, p, x: jqt.quantize(f, qp)(p, x))
    step(qa, {"w": jnp.ones((3, 4))}, x)
    with pytest.raises(jqt.QParamsMismatchError, match=r"of shape \(3, 6\), but this call passes it with shape \(3, 4\)"):
        step(qb, {"w": jnp.ones((3, 4))}, x)
    g = lambda p, x: x @ p["b"]
    with pytest.raises(jqt.QParamsMismatchError) as e:
        jqt.quantize(g, jqt.calibrate(f, jqt.recipes.w8a8(), {"w": jnp.ones((3, 4))}, [(x,)],
                                      progress=False))({"b": jnp.ones((3, 4))}, x)
    assert "first part only" not in str(e.value)
    p = {"a": jnp.ones((4, 3)), "b": jnp.ones((4, 3)) * 2}
    experts = lambda p, e, x: jnp.einsum("td,tdf->tf", x, jnp.stack([p["a"], p["b"]])[e])
    with pytest.warns(UserWarning, match=r"looks up whole \(4, 3\) matrices of weight '\(computed\)'"):
        jqt.calibrate(experts, jqt.recipes.w8(), p, [(jnp.array([0, 1]), jnp.ones((2, 4)))], progress=False)


def test_sources_compile_without_warnings():
    """Every module of the package, examples and benchmarks compiles with warnings as
    errors: an invalid escape in a docstring (``\\ s`` after a literal) is a SyntaxWarning
    on a user's first import (an error in later Pythons); two slipped in once."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    files = [p for d in ("jqt", "examples", "benchmarks") for p in sorted((root / d).rglob("*.py"))]
    assert len(files) > 40
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


def test_a_packed_weight_decodes_as_the_qarray_docstring_says():
    """``real ~= (values - zero_point) * scale`` on the codes unpacked into the weight's own
    layout: transposed back from ``"nk"``, nibbles unpacked, group scales repeated (the
    sentence in coming-from.md and fine-tuning.md applied the formula to the stored codes)."""
    from jqt._src.formats import unpack_nibbles
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 24)) * 0.1, jnp.float32)
    batch = [(jnp.asarray(rng.standard_normal((4, 64)), jnp.float32),)]
    f = lambda p, x: x @ p["w"]
    layouts = set()
    for r in (jqt.recipes.w8a8(), jqt.recipes.w8(group_size=16),
              jqt.recipes.w4(group_size=16, symmetric=False,
                             weight_calibrator=jqt.calibrators.WeightMinMax())):
        q = jqt.pack(jqt.calibrate(f, r, {"w": w}, batch, progress=False), {"w": w}).weights["w"]
        v = unpack_nibbles(q.values, 1 if q.layout == "nk" else 0) if q.nibbles else q.values
        v = v.T if q.layout == "nk" else v
        g = q.qtype.group_size or v.shape[0]
        scale = jnp.repeat(q.scale, g, axis=0) if q.scale.shape[0] > 1 else q.scale
        zp = 0 if q.zero_point is None else jnp.repeat(q.zero_point, g, axis=0)
        real = (v.astype(jnp.float32) - zp) * scale
        assert float(jnp.max(jnp.abs(real - w) / scale)) <= 0.5 + 1e-3, (r, q.layout)
        layouts.add((q.layout, q.nibbles))
    assert ("nk", False) in layouts and ("kn", True) in layouts, layouts


def test_a_static_negative_zero_is_not_a_positive_zero():
    """A Python float argument is static, keyed by type and value: -0.0 == 0.0, so a call
    with one reused the trace of the other (f branching on the sign, copysign or 1 / s, got
    the other's result; hunt63_callforms)."""
    p = {"w": jnp.eye(4) * 0.5}
    f = lambda p, x, s: x @ p["w"] + jnp.copysign(1.0, s)  # noqa: E731
    x = jnp.ones((2, 4))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x, 0.0)], progress=False)
    q = jqt.quantize(f, qp)
    for s in (0.0, -0.0, 0.0):
        np.testing.assert_allclose(q(p, x, s), f(p, x, s), atol=0.02)


def test_pack_of_several_weight_arguments_gives_no_argnum_advice():
    """``jqt.pack(qp, (gains, weights), weight_argnums=(0, 2))``: argument 0 has no quantized
    op (norm gains); pack warned to 'pass argnum=2', which the same call does
    (hunt63_callforms)."""
    f = lambda e, x, h: jnp.tanh(x @ h["w"]) * e["g"]  # noqa: E731
    args = ({"g": jnp.float32(2.0)}, {"w": jnp.eye(8) * 0.3})
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), args, [(jnp.ones((2, 8)),)], weight_argnums=(0, 2),
                       progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pe, ph = jqt.pack(qp, args, weight_argnums=(0, 2))
    assert "h/w" in ph.weights
    # argnums other than calibrate's: refused, naming the one left out (it warned, and
    # where the argument left out was not the last, advised one it had packed: hunt73_mixedargs)
    with pytest.raises(jqt.QParamsMismatchError, match=r"weight_argnums=\(0, 1\), .*\[2\] not among them"):
        jqt.pack(qp, args, weight_argnums=(0, 1))
    # held back in the calling thread only: warnings.catch_warnings swaps the process's
    # filters, and two threads packing at once left that warning ignored for good
    # (hunt70_threads)
    def process_wide(*a, **k):
        raise AssertionError("jqt.pack swapped the process-wide warning filters")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warnings, "catch_warnings", process_wide)
        assert "h/w" in jqt.pack(qp, args, weight_argnums=(0, 2))[1].weights
    # ... and what it holds back is shown where a later argument raises (hunt70_review)
    def g(a, ids, b):  # a tied table: lookup and matmul of other fp8 types, stored twice
        return (a["emb"][ids] @ b["w"]) @ a["emb"].T
    args = ({"emb": jax.random.normal(jax.random.key(0), (16, 8))}, {"w": jnp.eye(8)})
    qp = jqt.calibrate(g, jqt.recipes.fp8(), args, [(jnp.arange(4)[None],)],
                       weight_argnums=(0, 2), progress=False)
    with pytest.warns(UserWarning, match="the lookup 'a/emb' and the matmul 'a/emb#1'"), \
            pytest.raises(jqt.QParamsMismatchError):
        jqt.pack(qp, (args[0], {"w": jnp.ones((8, 9))}), weight_argnums=(0, 2))


def test_jax_clear_caches_clears_the_quantized_functions_traces_too():
    """A quantized function kept its own traces of f through jax.clear_caches(), so a change
    that plain jax.jit picks up after it (a helper redefined in a notebook, a setting f
    reads) did not reach it (hunt77_retrace)."""
    mode = {"sign": 1.0}
    f = lambda p, x: mode["sign"] * jax.nn.relu(x @ p["w"])
    p = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
    x = jax.random.normal(jax.random.key(1), (4, 8))
    qf = jqt.quantize(f, jqt.calibrate(f, jqt.recipes.w8(), p, [(x,)], progress=False))
    before = float(qf(p, x).sum())
    mode["sign"] = -1.0
    assert float(qf(p, x).sum()) == before  # traced once, as jax.jit is
    jax.clear_caches()
    assert float(qf(p, x).sum()) == -before != 0
    assert float(jax.jit(qf)(p, x).sum()) == -before


def test_a_quantized_functions_analysis_warning_is_given_once_not_at_every_trace():
    """A layer loop reading w[i] at a fori_loop's counter (kept float, with a warning): the
    quantized function warned again at every new trace, a new batch shape or jax.jit of it
    with packed params (hunt78_warnnoise)."""
    p = {"w": jax.random.normal(jax.random.key(0), (3, 16, 16)) * 0.25}
    f = lambda p, x: jax.lax.fori_loop(0, 3, lambda i, h: jax.nn.relu(h @ p["w"][i]), x)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (8, 16))
    with pytest.warns(UserWarning, match="indexed by a value computed from the data"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    qf, packed = jqt.quantize(f, qp), jqt.pack(qp, p)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for call in (lambda: qf(packed, x), lambda: qf(packed, x[:4]), lambda: jax.jit(qf)(packed, x[:2]),
                     lambda: qf(p, x[:4])):
            call()
    said = [str(w.message) for w in got if "indexed by a value computed" in str(w.message)]
    assert len(said) == 1, said
