"""Tensor-parallel decoding, quantized: the decoder's heads and MLP split over two
devices by ``jax.shard_map``, int8 or int4 weights per device, each device's own int8
key/value cache.

    python examples/tensor_parallel.py [--tiny] [--prompts N] [--tokens N]

The decoder of ``examples/decoder.py`` (trained, or loaded from its cache) runs its decode
loop inside one ``jax.shard_map`` over a mesh axis ``"model"`` of two host CPU devices
(this script asks XLA for them before it imports JAX), Megatron style: ``wq``, ``wk``,
``wv``, ``w_gate`` and ``w_up`` split by output columns (each device holds half the
query heads, one of the two key/value heads, half of d_ff), ``wo`` and ``w_down`` by
input rows, their partial results summed with a ``psum``; embeddings and norms
replicated. Nothing in the model code is jqt's: ``jqt.calibrate`` and ``jqt.quantize``
take the function as it is, and quantize each device's block of each split weight.

It prints, for float and each quantized variant: the bytes of weights and of cache one
device holds (the packed blocks placed with ``jqt.packed_shardings``; the cache read from
the decode loop the device runs), and the next-token agreement with the one-device
float model along its own generation (teacher forcing, as ``examples/generate.py``
measures it).
"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decoder as D  # noqa: E402
import generate as G  # noqa: E402
from jaxpr_utils import all_eqns  # noqa: E402

import jqt  # noqa: E402

AXIS = "model"
VARIANTS = {
    "w8a8_dynamic + int8 KV": lambda: jqt.recipes.w8a8_dynamic(kv_cache=True),
    "w4 g64 + int8 KV": lambda: jqt.recipes.w4(group_size=64, kv_cache=True),
}


@dataclasses.dataclass(frozen=True)
class TPConfig(D.Config):
    """The decoder's config inside the shard_map (its sizes read from a device's blocks),
    with the mesh axis its two residual projections are summed over."""
    tp_axis: str = AXIS


def specs():
    """How the shard_map splits the decoder's parameters (stacked layers: (L, in, out))."""
    columns, rows = P(None, None, AXIS), P(None, AXIS, None)
    layers = {"attn_norm": P(), "mlp_norm": P(), "wq": columns, "wk": columns, "wv": columns,
              "w_gate": columns, "w_up": columns, "wo": rows, "w_down": rows}
    return {"embed": P(), "final_norm": P(), "layers": layers}


def tp_teacher(mesh, params, prompt, tokens):
    """``generate.teacher`` run by each device on its blocks: the greedy next tokens."""
    def per_device(params, prompt, tokens):
        config = TPConfig(**dataclasses.asdict(D.Config.from_params(params)))  # a device's sizes
        return G.teacher(params, prompt, tokens, config)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(specs(), P(), P()), out_specs=P())(
        params, prompt, tokens)


def device_bytes(tree, shardings):
    """Bytes of ``tree``'s arrays that one device holds when they are placed as
    ``shardings`` says: an array ``tree`` holds twice (the codes of a weight that the
    prefill and the decode step both read, which ``jqt.pack`` stores once) counted once."""
    seen, total = set(), 0
    for a, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        if id(a) not in seen:
            seen.add(id(a))
            total += math.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize
    return total


def cache_per_device(fn, *args):
    """Bytes and dtypes of the key/value cache each device carries: the carries of the
    decode loop inside the shard_map whose shape is the cache's (n_layers, batch,
    positions, 1 head, head_dim; a quantized cache's scales too). The loop is the first
    scan that carries such arrays (the prefill's scan over layers carries none), of any
    length: a one-token run carries the cache through zero steps."""
    for e in all_eqns(jax.make_jaxpr(fn)(*args)):
        if e.primitive.name == "scan":
            nc, nk = G._consts_and_carries(e.params)
            avals = [v.aval for v in e.invars[nc:nc + nk] if v.aval.ndim == 5 and v.aval.shape[3] == 1]
            if avals:
                break
    else:
        raise ValueError("cache_per_device: no scan of this function carries a (n_layers, batch, "
                         "positions, 1, head_dim) cache")
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals), sorted({str(a.dtype) for a in avals})


def main(argv=None):
    args = G.decoder_parser(__doc__).parse_args(argv)
    config, params = G.load_decoder(args)
    print(f"split over 2 devices: {config.n_heads} query heads, {config.n_kv_heads} key/value heads, "
          f"d_ff {config.d_ff}")

    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices("cpu")[:2])
    placed = jax.tree.map(lambda s: NamedSharding(mesh, s), specs())
    split = jax.device_put(params, placed)
    teacher = functools.partial(tp_teacher, mesh)
    one_device = jax.jit(functools.partial(D.generate, steps=args.tokens))
    heldout = G.prompts("heldout", args.prompts, 7)
    float_tokens = one_device(params, heldout)
    # the teacher's loop runs a step per token after the first: calibrated on two tokens at
    # least, whatever --tokens measures (with one, its ops never ran and stayed float)
    cal_tokens = jax.jit(functools.partial(D.generate, steps=max(args.tokens, 2)))
    cal = [(p, cal_tokens(params, p)) for p in (G.prompts("train", 4, 100 + i) for i in range(2))]

    rows = []
    pred = jax.jit(teacher)(split, heldout, float_tokens)
    nbytes, dtypes = cache_per_device(teacher, split, heldout, float_tokens)
    rows.append(("float, split", device_bytes(params, placed), nbytes, dtypes,
                 float(np.mean(np.asarray(pred) == np.asarray(float_tokens)))))
    for name, make in VARIANTS.items():
        qp = jqt.calibrate(teacher, make(), split, cal, progress=False)
        packed = jqt.pack(qp, split)
        shardings = jqt.packed_shardings(qp, packed, mesh)  # each block on its device
        qp_s, packed_s = jax.device_put((qp, packed), shardings)
        run = jax.jit(lambda qp, pk, prompt, tokens: jqt.quantize(teacher, qp)(pk, prompt, tokens))
        pred = run(qp_s, packed_s, heldout, float_tokens)
        nbytes, dtypes = cache_per_device(jqt.quantize(teacher, qp), packed, heldout,
                                          float_tokens)
        rows.append((name, device_bytes((qp, packed), shardings), nbytes, dtypes,
                     float(np.mean(np.asarray(pred) == np.asarray(float_tokens)))))

    print(f"\nnext-token agreement with the one-device float model over {args.prompts} held-out "
          f"prompts x {args.tokens} tokens; bytes one of the 2 devices holds")
    print(f"{'variant':24s} {'weights':>11s} {'vs float':>8s} {'cache':>11s} {'vs float':>8s} "
          f"{'cache dtypes':>15s} {'agree':>7s}")
    w0, c0 = rows[0][1], rows[0][2]
    for name, wbytes, cbytes, dtypes, agree in rows:
        print(f"{name:24s} {wbytes:11,d} {wbytes / w0:7.3f}x {cbytes:11,d} {cbytes / c0:7.3f}x "
              f"{','.join(dtypes):>15s} {agree:7.2%}")
    return rows


if __name__ == "__main__":
    main()
