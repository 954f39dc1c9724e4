"""Two ways to carry a stacked key/value cache through a scan over layers, in a generate loop.

    python benchmarks/decode_layouts.py [--rounds 9] [--steps 8] [--markdown]   # about 8 minutes
    python benchmarks/decode_layouts.py --streaming [--rounds 15] [--markdown]  # about 3 minutes

``examples/decoder.py``'s ``decode_step`` carries the whole stacked cache (L, B, T, KV, D)
through its ``lax.scan`` over the layers and writes layer ``i``'s new key and value at
``(i, :, pos)`` in place (``in place`` below). Until 2026-12-07 it handed each layer its
slice of the cache as the scan's input and restacked the written slices as the scan's
output (``restacked``, kept here as ``restacked_step``). Inside a generate loop (a
``lax.scan`` over decode steps whose carry holds the cache) XLA:CPU copied the whole cache
for the restacked form two to three times a step: a zero-filled output buffer, the
restacked output back into the carry, and each layer's slice. Both forms are jqt's kind of
cache (docs/generate.md, "What a cache is"); ``kv_cache=True`` quantizes either.

The model is ``benchmarks/decode.py``'s 100M-parameter decoder (random weights) at batch 1,
its cache filled by a prefill of 1024 tokens (context 2048). Each call runs ``--steps``
decode steps in one ``lax.scan``; reported: the per-step median of interleaved rounds, and
the ratio to float32 of the same form. ``--steps 1`` times one step called with a cache
it does not donate (``decode.py``'s ``decode`` part). ``--streaming`` times one step as a
server streams (``docs/generate.md``): jitted with ``donate_argnums=1``, the cache it
returns passed back to the next call (the position held at 2000), float32 and ``w4`` g128.
"""
from __future__ import annotations

import argparse
import functools
import sys

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax
import jax.numpy as jnp

import cli
import decode as B
import decoder
import jqt
from formats import table

VARIANTS = {"w4 g128": lambda: jqt.recipes.w4(group_size=128),
            "w4 g128 kv8": lambda: jqt.recipes.w4(group_size=128, kv_cache=True),
            "w8a8_dynamic": jqt.recipes.w8a8_dynamic}


def restacked_step(params, cache, token, config):
    """The decode step as it was before 2026-12-07: each layer's cache slice a scan input,
    the written slices restacked as the scan's output."""
    pos = cache["pos"]
    mask = (jnp.arange(cache["k"].shape[2]) <= pos)[None, :]

    def block(h, xs):
        layer, k_cache, v_cache = xs
        q, k, v = decoder._qkv(config, layer, h, pos[None])
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
        return decoder._finish(config, layer, h, decoder._attend(q, k_cache, v_cache, mask)), (k_cache, v_cache)

    h, (k, v) = jax.lax.scan(block, params["embed"][token[:, None]], (params["layers"], cache["k"], cache["v"]))
    return decoder._logits(params, h[:, 0]), {"k": k, "v": v, "pos": pos + 1}


FORMS = {"restacked": restacked_step, "in place": decoder.decode_step}


def generate_loop(step, steps):
    """``steps`` greedy decode steps of ``step`` in one ``lax.scan``: the last token."""
    def run(params, cache, token):
        def body(carry, _):
            tok, c = carry
            logits, c = step(params, c, tok, B.CONFIG)
            return (jnp.argmax(logits, -1).astype(jnp.int32), c), None
        return jax.lax.scan(body, (token, cache), None, length=steps)[0][0]
    return run


def streaming(params, calib, cache, token, rounds, markdown):
    """One donated step a call, its cache passed back: per-call medians."""
    calls = {}
    for form, step in FORMS.items():
        s = functools.partial(step, config=B.CONFIG)
        for name, make in (("float32", None), ("w4 g128", VARIANTS["w4 g128"])):
            if make is None:
                f, p = jax.jit(s, donate_argnums=1), params
            else:
                B.progress(f"{form}: calibrating and packing {name}")
                qp = jqt.calibrate(s, make(), params, calib, progress=False)
                p, f = jqt.pack(qp, params), jax.jit(jqt.quantize(s, qp), donate_argnums=1)
            held = {"cache": jax.tree.map(jnp.copy, cache)}

            def call(f=f, p=p, held=held):
                logits, c = f(p, held["cache"], token)
                held["cache"] = dict(c, pos=jnp.minimum(c["pos"], 2000))
                return logits
            calls[(form, name)] = call
    med = B.timed(calls, rounds)
    rows = [(form, name, f"{s['median'] * 1e3:.1f}", f"{s['p25'] * 1e3:.1f}-{s['p75'] * 1e3:.1f}",
             f"{s['median'] / med[(form, 'float32')]['median']:.3f}") for (form, name), s in med.items()]
    print(f"One decode step a call, its cache donated and passed back, batch 1, context about "
          f"{B.PROMPT + 1} of {B.MAX_LEN}; {rounds} interleaved rounds")
    table(("cache form", "variant", "ms / step", "p25-p75", "time / float32 of the form"), rows, markdown)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=cli.positive_int, default=9,
                    help="interleaved timing rounds (median reported); default 9")
    ap.add_argument("--steps", type=cli.positive_int, default=8,
                    help="decode steps per call, in one lax.scan (1: one step, its cache kept); default 8")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--streaming", action="store_true", help="one donated step a call (see above)")
    args = ap.parse_args()
    params = decoder.init_params(B.CONFIG, jax.random.key(0))
    calib = B.decode_inputs(params, (1, 2))
    cache, token = B.decode_inputs(params, (3,))[0]
    if args.streaming:
        return streaming(params, calib, cache, token, args.rounds, args.markdown)
    calls, want = {}, {}
    for form, step in FORMS.items():
        run = generate_loop(step, args.steps)
        f32 = jax.jit(run)
        want[form] = f32(params, cache, token)
        calls[(form, "float32")] = lambda f=f32: f(params, cache, token)
        for name, make in VARIANTS.items():
            B.progress(f"{form}: calibrating and packing {name}")
            _, packed, f = B.build(run, make(), params, calib)
            calls[(form, name)] = lambda f=f, p=packed: f(p, cache, token)
    if int(want["restacked"][0]) != int(want["in place"][0]):
        sys.exit(f"the two forms' float32 loops disagree: {want}")
    B.progress(f"timing {len(calls)} loops x {args.rounds} rounds")
    med = B.timed(calls, args.rounds)
    rows = []
    for (form, name), s in med.items():
        base = med[(form, "float32")]["median"]
        rows.append((form, name, f"{s['median'] / args.steps * 1e3:.1f}",
                     f"{s['p25'] / args.steps * 1e3:.1f}-{s['p75'] / args.steps * 1e3:.1f}",
                     f"{s['median'] / base:.3f}"))
    print(f"Generate loop of {args.steps} steps, batch 1, context {B.PROMPT + 1}-{B.PROMPT + args.steps} "
          f"of {B.MAX_LEN}; {args.rounds} interleaved rounds (per-step times)")
    table(("cache form", "variant", "ms / step", "p25-p75", "time / float32 of the form"), rows, args.markdown)


if __name__ == "__main__":
    main()
