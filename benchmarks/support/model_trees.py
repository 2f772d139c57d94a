"""Parameter trees of the models the 0/1 Adam paper trained, as ``jax.ShapeDtypeStruct``s.

Nothing is allocated: the trees only carry shapes, for compile-only communication accounting and
for sizing the overhead benchmark. Leaf names and shapes follow the public reference models
(one leaf per weight matrix, bias, LayerNorm scale and offset):

- BERT-Base and BERT-Large pre-training models (Devlin et al., arXiv:1810.04805, Table/Section
  3: L=12, H=768, A=12, 110M and L=24, H=1024, A=16, 340M; WordPiece vocabulary 30,522,
  512 positions, 2 token types), with the masked-LM transform and bias and the next-sentence
  head (the MLM decoder weight is tied to the word embeddings). BERT-Large here has 336.2M
  parameters in 398 leaves.
- GPT-2 (Radford et al., 2019: 12 layers, d_model 768, vocabulary 50,257, 1,024 positions; the
  model the paper calls 117M has 124.4M parameters; the output layer is tied to the token
  embeddings). The 0/1 Adam paper (Lu et al., arXiv:2202.06009) pre-trains BERT-Base,
  BERT-Large and GPT-2; pass ``--models gpt2-medium`` (24 layers, d_model 1024, 355M) for the
  next GPT-2 size.

Also :func:`transformer_like_tree` (square matrices and biases, ~20 leaves per million elements).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _spec(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _dense(d_in: int, d_out: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"kernel": _spec(d_in, d_out), "bias": _spec(d_out)}


def _norm(d: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"scale": _spec(d), "bias": _spec(d)}


def bert(
    layers: int, hidden: int, vocab: int = 30_522, positions: int = 512, token_types: int = 2
) -> dict:
    """A BERT pre-training model: embeddings, encoder layers, pooler, MLM and NSP heads."""
    ffn = 4 * hidden
    layer = {
        "query": _dense(hidden, hidden),
        "key": _dense(hidden, hidden),
        "value": _dense(hidden, hidden),
        "attention_out": _dense(hidden, hidden),
        "attention_norm": _norm(hidden),
        "intermediate": _dense(hidden, ffn),
        "output": _dense(ffn, hidden),
        "output_norm": _norm(hidden),
    }
    return {
        "embeddings": {
            "word": _spec(vocab, hidden),
            "position": _spec(positions, hidden),
            "token_type": _spec(token_types, hidden),
            "norm": _norm(hidden),
        },
        "encoder": [dict(layer) for _ in range(layers)],
        "pooler": _dense(hidden, hidden),
        "mlm": {"transform": _dense(hidden, hidden), "norm": _norm(hidden), "bias": _spec(vocab)},
        "nsp": _dense(hidden, 2),
    }


def gpt2(layers: int, hidden: int, vocab: int = 50_257, positions: int = 1_024) -> dict:
    """A GPT-2 language model (pre-LayerNorm blocks, final norm, output tied to ``wte``)."""
    block = {
        "ln_1": _norm(hidden),
        "attn_qkv": _dense(hidden, 3 * hidden),
        "attn_proj": _dense(hidden, hidden),
        "ln_2": _norm(hidden),
        "mlp_fc": _dense(hidden, 4 * hidden),
        "mlp_proj": _dense(4 * hidden, hidden),
    }
    return {
        "wte": _spec(vocab, hidden),
        "wpe": _spec(positions, hidden),
        "blocks": [dict(block) for _ in range(layers)],
        "ln_f": _norm(hidden),
    }


MODELS = {
    "bert-base": lambda: bert(12, 768),
    "bert-large": lambda: bert(24, 1024),
    "gpt2": lambda: gpt2(12, 768),
    "gpt2-medium": lambda: gpt2(24, 1024),
}


def transformer_like_tree(numel: int) -> list[jax.ShapeDtypeStruct]:
    """Square float32 matrices, a bias each, ~20 leaves per million elements in all.

    ``[(w, w), (w,), (w, w), (w,), ...]`` with ``max(2, round(20 numel / 1e6)) // 2`` pairs and
    ``w`` the width that makes about ``numel`` elements (at least 8).
    """
    pairs = max(2, round(20 * numel / 1e6)) // 2
    width = max(8, int(math.sqrt(numel / pairs)))
    return [_spec(*shape) for _ in range(pairs) for shape in ((width, width), (width,))]


def numel(tree: dict) -> int:
    """Total number of parameters of a tree."""
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def num_leaves(tree: dict) -> int:
    """Number of parameter tensors of a tree."""
    return len(jax.tree.leaves(tree))
