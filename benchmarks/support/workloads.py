"""Training workloads for the benchmarks: data that ships with Python or scikit-learn, a model in
Flax NNX, a per-worker loss and deterministic per-worker batches.

- :func:`char_lm`: a GPT-style character-level language model, on the Python language reference
  (``corpus="pydoc"``: ``pydoc_data.topics``, ~465k characters; first 90% for training, split
  into one contiguous shard per worker, last 10% for validation) or on the standard library's
  own sources (``corpus="stdlib"``: tens of MB, split by file; :func:`stdlib_corpus`).
- :func:`digits`: a small MLP on scikit-learn's 8x8 ``load_digits`` images (a fixed stratified
  test split; the training images shuffled once and dealt out to the workers).

Batches depend only on ``(seed, step)``, never on what came before, so every run with the same
seed sees the same data in the same order.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and its data, split over workers.

    Attributes:
      name: short label.
      num_params: number of trainable parameters.
      init_params: ``seed -> params``, one copy (a dict of float32 arrays).
      loss: ``(params, batch) -> scalar``, one worker's training loss on its batch.
      train_batch: ``step -> batch`` (0-based step), a tree of arrays with a leading worker axis.
      eval_batch: a fixed tree with a leading worker axis: the held-out set dealt to the workers.
      eval_sums: ``(params, eval_batch) -> {name: sum}`` on one worker; the benchmark adds the
        workers' sums and divides every entry by ``"count"``.
      description: one line for reports.
      mask: ``None``, or a tree of 0/1 like the params that is 0 where the gradient is exactly
        zero on every training example. 1-bit compression cannot represent zero (signs are
        +-1), and where the frozen variance is 0 a compressed +-scale is divided by ``eps``:
        the compressing optimizers get this mask (DeepSpeed's momentum mask, for the same
        reason). AdamW needs none.
    """

    name: str
    num_params: int
    init_params: Callable[[int], Any]
    loss: Callable[[Any, Any], jax.Array]
    train_batch: Callable[[int], Any]
    eval_batch: Any
    eval_sums: Callable[[Any, Any], dict[str, jax.Array]]
    description: str
    mask: Any = None
    data: dict = dataclasses.field(default_factory=dict)  # what the text was: size, hash, split
    # A language model's: how often each token occurs in the workers' training text (row ``i``
    # of the token embedding, ``params["tokens"]["embedding"]``, is token ``i``), and the tokens.
    token_counts: np.ndarray | None = None
    vocab: tuple[str, ...] = ()


def _functional(make_model: Callable[[nnx.Rngs], nnx.Module]) -> tuple[Any, Callable, int]:
    """``(graphdef, init_params, num_params)`` of an NNX model used as a pure function."""
    graphdef, state = nnx.split(make_model(nnx.Rngs(0)))
    size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.to_pure_dict(state)))

    def init_params(seed: int) -> Any:
        return nnx.to_pure_dict(nnx.split(make_model(nnx.Rngs(seed)))[1])

    return graphdef, init_params, size


# --------------------------------------------------------------------------- char-level GPT


class Block(nnx.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP; no biases
    (as in many current GPTs; it also halves the number of leaves the optimizers handle)."""

    def __init__(
        self, dim: int, heads: int, layers: int, separate_qkv: bool, rngs: nnx.Rngs
    ) -> None:
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * layers))  # GPT-2's residual scaling
        self.heads = heads
        self.norm1 = nnx.LayerNorm(dim, use_bias=False, rngs=rngs)
        if separate_qkv:
            self.q, self.k, self.v = (
                nnx.Linear(dim, dim, use_bias=False, kernel_init=init, rngs=rngs) for _ in range(3)
            )
        else:
            self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.separate_qkv = separate_qkv
        self.proj = nnx.Linear(dim, dim, use_bias=False, kernel_init=out_init, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.norm1(x)
        if self.separate_qkv:
            q, k, v = (f(h).reshape(b, t, self.heads, -1) for f in (self.q, self.k, self.v))
        else:
            q, k, v = jnp.split(self.qkv(h).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    """A small GPT: token and learned position embeddings, pre-norm blocks, a tied output head."""

    def __init__(
        self,
        vocab: int,
        context: int,
        dim: int,
        heads: int,
        layers: int,
        separate_qkv: bool,
        rngs: nnx.Rngs,
    ) -> None:
        init = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(vocab, dim, embedding_init=init, rngs=rngs)
        self.positions = nnx.Embed(context, dim, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List(
            [Block(dim, heads, layers, separate_qkv, rngs) for _ in range(layers)]
        )
        self.norm = nnx.LayerNorm(dim, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            x = block(x)
        # Tied output embedding (as GPT-2): every row of the embedding gets a gradient at every
        # step through the softmax, even the rows of characters absent from the batch. An
        # untied input row of a rare character has exactly zero gradient (so zero variance),
        # and 1-bit compression, which cannot send a zero, blows such rows up.
        return self.tokens.attend(self.norm(x))


def corpus() -> str:
    """The Python language reference help topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A text split into training and validation parts, and what identifies it."""

    name: str
    train: str
    val: str
    info: dict


def stdlib_corpus(val_every: int = 10) -> Corpus:
    """The running Python's standard-library sources as one text, split by file.

    Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages``, read
    in sorted path order; files that are not ASCII are left out (so that the vocabulary is the
    printable ASCII range and a few controls); every ``val_every``-th file (by that order) goes
    to validation, so that the validation text is whole files the model never trains on, spread
    over the library. ``info`` records the Python version, file and character counts and a
    SHA-256 of the text (train, then validation), so that a run elsewhere can say whether it saw
    the same text.
    """
    import hashlib
    import platform
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
    )
    train, val, skipped = [], [], 0
    for i, path in enumerate(files):
        try:
            text = path.read_bytes().decode("ascii")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        (val if i % val_every == val_every - 1 else train).append(text)
    train_text, val_text = "\n".join(train), "\n".join(val)
    digest = hashlib.sha256((train_text + "\0" + val_text).encode()).hexdigest()
    info = dict(
        corpus="stdlib",
        python=platform.python_version(),
        files_train=len(train),
        files_val=len(val),
        files_skipped_not_ascii=skipped,
        chars_train=len(train_text),
        chars_val=len(val_text),
        sha256=digest,
    )
    return Corpus("stdlib", train_text, val_text, info)


def pydoc_corpus() -> Corpus:
    """``pydoc_data.topics`` (:func:`corpus`): the first 90% for training, the rest validation."""
    import hashlib

    text = corpus()
    cut = int(0.9 * len(text))
    info = dict(
        corpus="pydoc",
        chars_train=cut,
        chars_val=len(text) - cut,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
    )
    return Corpus("pydoc", text[:cut], text[cut:], info)


def char_lm(
    num_workers: int,
    *,
    context: int = 64,
    dim: int = 128,
    heads: int = 4,
    layers: int = 4,
    batch_per_worker: int = 8,
    eval_windows: int = 512,
    separate_qkv: bool = True,
    seed: int = 0,
    corpus: str = "pydoc",
) -> Workload:
    """Character-level GPT on ``pydoc_data.topics`` (``corpus="pydoc"``) or the standard
    library's sources (``corpus="stdlib"``, :func:`stdlib_corpus`).

    Train/validation split: pydoc, the first 90% / the last 10% of the text; stdlib, by file.
    Worker ``i`` trains on the
    ``i``-th of ``num_workers`` contiguous equal shards of the training text, on
    ``batch_per_worker`` windows of ``context + 1`` characters drawn uniformly from its shard
    (a NumPy generator seeded with ``(seed, step, i)``). Validation: up to ``eval_windows``
    windows evenly spread over the validation text (a multiple of ``num_workers``).
    """
    data = {"pydoc": pydoc_corpus, "stdlib": stdlib_corpus}[corpus]()
    vocab = sorted(set(data.train) | set(data.val))
    codes = np.asarray([ord(c) for c in vocab], np.uint32)  # sorted, as vocab is

    def encode(text: str) -> np.ndarray:  # each character's index in vocab, vectorised
        points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        return np.searchsorted(codes, points).astype(np.int32)

    train, val = encode(data.train), encode(data.val)
    shard = len(train) // num_workers
    shards = [train[i * shard : (i + 1) * shard] for i in range(num_workers)]

    starts = np.linspace(0, len(val) - context - 1, min(eval_windows, len(val) // context))
    count = len(starts) // num_workers * num_workers
    windows = np.stack([val[s : s + context + 1] for s in starts.astype(int)[:count]])
    eval_batch = windows.reshape(num_workers, count // num_workers, context + 1)

    graphdef, init_params, size = _functional(
        lambda rngs: GPT(len(vocab), context, dim, heads, layers, separate_qkv, rngs)
    )

    def logits_and_targets(params: Any, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        return nnx.merge(graphdef, params)(batch[:, :-1]), batch[:, 1:]

    def loss(params: Any, batch: jax.Array) -> jax.Array:
        logits, targets = logits_and_targets(params, batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def eval_sums(params: Any, batch: jax.Array) -> dict[str, jax.Array]:
        logits, targets = logits_and_targets(params, batch)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return {"loss": nll.sum(), "count": jnp.asarray(nll.size, jnp.float32)}

    def train_batch(step: int) -> np.ndarray:
        out = np.empty((num_workers, batch_per_worker, context + 1), np.int32)
        for i, data in enumerate(shards):
            rng = np.random.default_rng([seed, step, i])
            for j, s in enumerate(rng.integers(0, len(data) - context - 1, batch_per_worker)):
                out[i, j] = data[s : s + context + 1]
        return out

    return Workload(
        name="char_lm",
        num_params=size,
        init_params=init_params,
        loss=loss,
        train_batch=train_batch,
        eval_batch=eval_batch,
        eval_sums=eval_sums,
        description=(
            f"char-level GPT, {layers} blocks, width {dim}, {heads} heads, context {context}, "
            f"{size:,} parameters; {num_workers} workers x {batch_per_worker} sequences; "
            f"{_CORPUS_NAMES[corpus]} ({len(train) + len(val):,} chars, vocab {len(vocab)}), "
            f"{len(train):,} train / {len(val):,} val chars, {count} val windows"
        ),
        data={**data.info, "vocab": len(vocab), "val_windows": count},
        token_counts=np.bincount(np.concatenate(shards), minlength=len(vocab)),
        vocab=tuple(vocab),
    )


def rare_token_mask(workload: Workload, threshold: int) -> Any:
    """``workload``'s mask (ones where it has none) with the token-embedding rows of the tokens
    seen fewer than ``threshold`` times in the training text set to 0: the momentum mask a
    DeepSpeed user gives 1-bit Adam for rows that (almost) no gradient reaches
    (docs/benchmarks/onebit_divergence.md)."""
    if workload.token_counts is None:
        raise ValueError(f"{workload.name} has no tokens: a rare-token mask needs a language model")
    params = workload.init_params(0)
    base = workload.mask or jax.tree.map(lambda x: np.ones(np.shape(x), np.float32), params)

    def one(path: Any, mask: Any) -> np.ndarray:
        mask = np.array(mask, np.float32)
        if jax.tree_util.keystr(path) == "['tokens']['embedding']":
            mask[workload.token_counts < threshold] = 0.0
        return mask

    return jax.tree_util.tree_map_with_path(one, base)


_CORPUS_NAMES = {"pydoc": "pydoc_data.topics", "stdlib": "the standard library's sources"}


# --------------------------------------------------------------------------- digits MLP


class MLP(nnx.Module):
    """Two hidden GELU layers (GELU rather than ReLU: a dead ReLU unit has exactly zero
    gradients, which 1-bit compression cannot represent)."""

    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def digits(num_workers: int, *, hidden: int = 128, batch_per_worker: int = 16, seed: int = 0):
    """scikit-learn's ``load_digits`` (1,797 8x8 images, 10 classes) and an MLP.

    Test split: 25%, stratified, fixed (``random_state=0``). The training images are shuffled
    once (``random_state=0``) and dealt into ``num_workers`` equal shards; each step worker ``i``
    draws ``batch_per_worker`` images from its shard. The test set is dealt to the workers with
    zero-weight padding.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=0
    )
    # Standardised with the training statistics: a pixel that is almost always 0 becomes a
    # feature that is almost never 0, so its weights get a gradient (and a variance) every step.
    mean, std = x_train.mean(0), x_train.std(0)
    x_train, x_test = ((v - mean) / np.where(std > 0, std, 1.0) for v in (x_train, x_test))
    x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x_train))
    shard = len(order) // num_workers
    shards = [order[i * shard : (i + 1) * shard] for i in range(num_workers)]

    per = -(-len(x_test) // num_workers)
    pad = per * num_workers - len(x_test)
    weights = np.concatenate([np.ones(len(x_test)), np.zeros(pad)]).astype(np.float32)
    eval_batch = {
        "x": np.concatenate([x_test, np.zeros((pad, 64), np.float32)]).reshape(
            num_workers, per, 64
        ),
        "y": np.concatenate([y_test, np.zeros(pad, int)])
        .astype(np.int32)
        .reshape(num_workers, per),
        "w": weights.reshape(num_workers, per),
    }
    graphdef, init_params, size = _functional(lambda rngs: MLP((64, hidden, hidden, 10), rngs))
    # Pixels that are constant over the training images (the corners): their first-layer weights
    # never get a gradient, so they are masked out of the compressed means.
    dead = std == 0
    mask = jax.tree.map(lambda x: np.ones(x.shape, np.float32), init_params(0))
    mask["layers"][0]["kernel"] = np.where(dead[:, None], 0.0, 1.0).astype(np.float32) * np.ones(
        (64, hidden), np.float32
    )

    def loss(params: Any, batch: Any) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def eval_sums(params: Any, batch: Any) -> dict[str, jax.Array]:
        logits = nnx.merge(graphdef, params)(batch["x"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        w = batch["w"]
        return {"loss": (nll * w).sum(), "accuracy": (correct * w).sum(), "count": w.sum()}

    def train_batch(step: int) -> Any:
        picks = []
        for i, idx in enumerate(shards):
            rng = np.random.default_rng([seed, step, i])
            picks.append(idx[rng.integers(0, len(idx), batch_per_worker)])
        picks = np.stack(picks)
        return {"x": x_train[picks], "y": y_train[picks].astype(np.int32)}

    return Workload(
        name="digits",
        num_params=size,
        init_params=init_params,
        loss=loss,
        train_batch=train_batch,
        eval_batch=eval_batch,
        eval_sums=eval_sums,
        description=(
            f"MLP 64-{hidden}-{hidden}-10, {size:,} parameters, on sklearn digits "
            f"({len(x_train)} train / {len(x_test)} test images); "
            f"{num_workers} workers x {batch_per_worker} images; {int(dead.sum())} constant "
            "pixels masked out of the compressed means"
        ),
        mask=mask,
    )
