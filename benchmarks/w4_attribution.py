"""Where w4 g128's error on all-MiniLM-L6-v2 comes from, and which round-to-nearest
4-bit configuration gets mean cosine >= 0.99 with a file <= 0.15x (issue 11).

    python benchmarks/w4_attribution.py                 # every config, a few minutes on 2 cores
    python benchmarks/w4_attribution.py --only 'mse'    # configs whose name matches a regex
    python benchmarks/w4_attribution.py --list          # config names
    python benchmarks/w4_attribution.py --breakdown 'w4 g128$'   # bytes per tensor kind too

Same setup as ``benchmarks/formats.py``'s ``minilm`` part (``minilm_setup()``): calibrate
on the calibration half, score cosine to the float sentence embeddings on the evaluation
half, and the size of the file ``jqt.save_packed`` writes against the float32
``model.safetensors``. No timing. Every config is plain rounding (no GPTQ, no AWQ).

Configs are recipes built from rules (first match wins): optional ``Rule(key=..,
weight=None)`` ahead to keep some dense ops float, one rule for the word-embedding
gather, one for the dense ops.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jqt  # noqa: E402
from formats import minilm_setup  # noqa: E402

R = jqt.recipes
MSE = jqt.calibrators.WeightMSE
ABS = jqt.calibrators.WeightMinMax()  # absmax ranges: the plain rounding the configs measure
DENSE_OPS = ("dot_general", "conv_general_dilated")

GROUPS = {  # op-key regexes of the dense op kinds of a BERT layer
    "q": r"attention/self/query/",
    "k": r"attention/self/key/",
    "v": r"attention/self/value/",
    "attn_out": r"attention/output/dense/",
    "ffn_in": r"intermediate/dense/",
    "ffn_out": r"layer_\d+/output/dense/",
}


def q4(group_size, symmetric=True, nf4=False):
    if nf4:
        return jqt.QuantType(dtype="nf4", group_size=group_size)
    return jqt.QuantType(bits=4, symmetric=symmetric, narrow_range=symmetric, per_channel=True,
                         group_size=group_size)


def q8():
    return jqt.QuantType(bits=8, symmetric=True, narrow_range=True, per_channel=True)


def recipe(g=128, sym=True, mse=False, emb_g=None, emb_sym=None, emb_mse=None, emb=True,
           dense=True, float_keys=(), int8_keys=(), emb_bits=4, nf4=False, emb_nf4=None):
    """Weight-only: dense ops int4 g``g``; the word-embedding gather int``emb_bits`` per
    group of ``emb_g`` (default ``g``); ``float_keys`` kept float, ``int8_keys`` int8
    per channel."""
    wcal = MSE() if mse else jqt.calibrators.WeightMinMax()
    emb_mse = mse if emb_mse is None else emb_mse
    ecal = MSE() if emb_mse else jqt.calibrators.WeightMinMax()
    emb_g = g if emb_g is None else emb_g
    emb_sym = sym if emb_sym is None else emb_sym
    rules = [jqt.Rule(key=k, weight=None) for k in float_keys]
    rules += [jqt.Rule(key=k, ops=DENSE_OPS, weight=q8(), weight_calibrator=wcal) for k in int8_keys]
    et = None
    if emb:
        emb_nf4 = nf4 if emb_nf4 is None else emb_nf4
        et = (q4(emb_g, emb_sym, emb_nf4) if emb_bits == 4 else
              jqt.QuantType(bits=emb_bits, symmetric=emb_sym, narrow_range=emb_sym,
                            per_channel=True, group_size=emb_g))
    rules.append(jqt.Rule(ops=("gather",), embedding=et, weight_calibrator=ecal))
    rules.append(jqt.Rule(ops=DENSE_OPS, weight=q4(g, sym, nf4) if dense else None, weight_calibrator=wcal))
    return jqt.Recipe(rules=tuple(rules))


def configs():
    c = {
        # the presets, as benchmarks/formats.py runs them (their ranges clipped by
        # jqt.recipes.WEIGHT_MSE_4BIT; every other config names its weight calibrator)
        "preset w4 g128": lambda: R.w4(group_size=128),
        "preset w4 g64": lambda: R.w4(group_size=64),
        "preset w4 g128 asym": lambda: R.w4(group_size=128, symmetric=False),
        "preset nf4 g64": lambda: R.nf4(group_size=64),
        # 1. attribution, w4 g128
        "w4 g128": lambda: recipe(),  # the preset with absmax ranges, built from rules
        "attr: embeddings float": lambda: R.w4(group_size=128, embeddings=False,
                                               weight_calibrator=ABS),
        "attr: only embedding int4 (dense float)": lambda: recipe(dense=False),
    }
    for name, rx in GROUPS.items():
        c[f"attr: {name} float"] = lambda rx=rx: recipe(float_keys=(rx,))
    for name, rx in GROUPS.items():
        c[f"attr: only {name} int4 (rest float)"] = lambda name=name: recipe(
            emb=False, float_keys=tuple(v for k, v in GROUPS.items() if k != name))
    for i in range(6):
        c[f"attr: layer_{i} float"] = lambda i=i: recipe(float_keys=(rf"layer_{i}/",))
    # 2. MSE clipping, asymmetric, group sizes
    for g in (128, 64, 32):
        for sym in (True, False):
            for mse in (False, True):
                n = f"g{g}" + ("" if sym else " asym") + (" mse" if mse else "")
                c[n] = lambda g=g, sym=sym, mse=mse: recipe(g, sym, mse)
    # embedding group size apart from the dense ops'
    for eg in (64, 32):
        for sym in (True, False):
            for mse in (False, True):
                n = f"g128 emb g{eg}" + ("" if sym else " asym") + (" mse" if mse else "")
                c[n] = lambda eg=eg, sym=sym, mse=mse: recipe(128, sym, mse, emb_g=eg)
    for g, eg in ((64, 128), (32, 128), (64, 64), (32, 64)):
        for sym in (True, False):
            n = f"dense g{g} emb g{eg}" + ("" if sym else " asym") + " mse"
            c[n] = lambda g=g, eg=eg, sym=sym: recipe(g, sym, True, emb_g=eg)
    # mixed precision within the byte budget: one op kind int8 per channel
    for name in ("v", "attn_out", "q", "k"):
        for sym in (True, False):
            n = f"g128 {name} int8" + ("" if sym else " asym") + " mse"
            c[n] = lambda name=name, sym=sym: recipe(128, sym, True, int8_keys=(GROUPS[name],))
    # nf4 (a lookup table, symmetric absmax per group), with and without MSE clipping
    for g, eg in ((128, 128), (64, 128), (64, 64), (32, 128)):
        for mse in (False, True):
            n = f"nf4 dense g{g} emb g{eg}" + (" mse" if mse else "")
            c[n] = lambda g=g, eg=eg, mse=mse: recipe(g, True, mse, emb_g=eg, nf4=True)
    c["nf4 dense g64 + int4 emb g128 mse"] = lambda: recipe(64, True, True, emb_g=128, nf4=True,
                                                            emb_nf4=False)
    c["nf4 dense g128 v int8 mse"] = lambda: recipe(128, True, True, nf4=True, int8_keys=(GROUPS["v"],))
    c["nf4 dense g64 emb g128 v int8 mse"] = lambda: recipe(64, True, True, emb_g=128, nf4=True,
                                                            int8_keys=(GROUPS["v"],))
    # int4 asymmetric dense, symmetric embedding (the preset's asym split), MSE, v int8
    c["dense g128 asym, emb g128 sym, mse"] = lambda: recipe(128, False, True, emb_sym=True)
    c["dense g64 asym, emb g128 sym, mse"] = lambda: recipe(64, False, True, emb_g=128, emb_sym=True)
    c["dense g64 asym, emb g128 sym, v int8, mse"] = lambda: recipe(
        64, False, True, emb_g=128, emb_sym=True, int8_keys=(GROUPS["v"],))
    # bounds: embedding int4 g128 with every dense op int8 per channel
    c["bound: emb int4 g128, dense int8"] = lambda: recipe(int8_keys=(".*",))
    c["bound: emb int4 g128, ffn_in+v int8, rest int4 g128 mse"] = lambda: recipe(
        128, True, True, int8_keys=(GROUPS["ffn_in"], GROUPS["v"]))
    # beyond plain rounding, for reference: AWQ scales / Hadamard rotation, then rounding
    c["extra: w4 g128 awq"] = lambda: R.w4(group_size=128, awq=True, weight_calibrator=ABS)
    c["extra: w4 g128 asym awq"] = lambda: R.w4(group_size=128, symmetric=False, awq=True,
                                                weight_calibrator=ABS)
    c["extra: w4 g128 asym awq mse"] = lambda: R.w4(group_size=128, symmetric=False, awq=True,
                                                    weight_calibrator=MSE())
    c["extra: w4 g128 rotate"] = lambda: R.w4(group_size=128, rotate=True, weight_calibrator=ABS)
    c["extra: w4 g128 asym rotate mse"] = lambda: R.w4(group_size=128, symmetric=False, rotate=True,
                                                       weight_calibrator=MSE())
    c["extra: nf4 g64 awq mse"] = lambda: R.nf4(group_size=64, awq=True, weight_calibrator=MSE())
    return c


def run(names, breakdown_rx=None):
    from bert import model_dir
    from minilm import compare

    m, batches, evals, ids, mask, ref, length = minilm_setup()
    f = m.embed
    float_file = os.path.getsize(model_dir() / "model.safetensors")
    allc = configs()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            print(f"[w4] {name}", file=sys.stderr, flush=True)
            try:
                qp = jqt.calibrate(f, allc[name](), m.params, batches, progress=False)
                packed = jqt.pack(qp, m.params)
                path = os.path.join(d, "m.safetensors")
                jqt.save_packed(path, packed, qp)
            except Exception as e:  # an unsupported combination: say so, go on
                print(f"[w4] {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                out[name] = dict(error=f"{type(e).__name__}: {e}")
                continue
            ratio = os.path.getsize(path) / float_file
            s = compare(np.asarray(jax.jit(jqt.quantize(f, qp))(packed, ids, mask)), ref)
            out[name] = dict(file_ratio=ratio, mean_cos=s["mean"], min_cos=s["min"])
            print(f"    {ratio:.4f}  {s['mean']:.4f}  {s['min']:.4f}", file=sys.stderr, flush=True)
            if breakdown_rx and re.search(breakdown_rx, name):
                out[name]["bytes"] = file_breakdown(path)
    return out, float_file, len(evals), length


def file_breakdown(path):
    """Bytes of the file's tensors, summed by the last part of their name."""
    from safetensors.numpy import load_file
    by = {}
    for k, v in load_file(path).items():
        kind = "float params" if k.startswith("params/") else k.split("/", 1)[0] + ":" + k.rsplit("/", 1)[-1]
        by[kind] = by.get(kind, 0) + v.nbytes
    return by


def regex(text):
    """An ``argparse`` type: ``text`` compiled, or refused with the regex's error."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}") from None


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--only", default="", type=regex, help="regex on config names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the names of the configs --only selects and exit")
    ap.add_argument("--breakdown", default=None, type=regex, help="regex: configs to break the file down for")
    args = ap.parse_args()
    names = [n for n in configs() if args.only.search(n)]
    if not names:
        ap.error(f"--only {args.only.pattern!r} matches no config name (--list shows them)")
    if args.list:
        print("\n".join(names))
        return
    out, float_file, n, length = run(names, args.breakdown.pattern if args.breakdown else None)
    print(f"all-MiniLM-L6-v2: float32 file {float_file:,} B; {n} evaluation sentences of "
          f"{length} tokens; weight-only, round to nearest")
    print("| config | file / float | mean cos | min cos |")
    print("| --- | --- | --- | --- |")
    for k, r in out.items():
        if "error" in r:
            print(f"| {k} | - | {r['error'][:60]} | - |")
        else:
            ok = " *" if r["mean_cos"] >= 0.99 and r["file_ratio"] <= 0.15 else ""
            print(f"| {k}{ok} | {r['file_ratio']:.4f} | {r['mean_cos']:.4f} | {r['min_cos']:.4f} |")
        if "bytes" in r:
            print(f"|   bytes: {r['bytes']} | | | |")
    print("RESULTS " + json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
