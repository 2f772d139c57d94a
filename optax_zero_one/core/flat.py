"""The flat worker-major layout: a whole pytree as one float buffer per worker.

The optimizers keep their state, and do all their arithmetic, on one buffer per quantity
instead of one array per parameter leaf, so that the compiled program does not grow with the
number of leaves (``docs/design.md``, "The flat layout"). The layout is the one the 1-bit
collective sends, so that its payload is a reshape:

- each leaf ``l`` (``n_l`` elements) is flattened and zero-padded to ``P_l``, a multiple of
  ``8 N`` (``N`` workers): the padding the compressed mean is defined with;
- it is cut into ``N`` chunks of ``c_l = P_l / N`` elements, and row ``j`` of the buffer holds
  chunk ``j`` of every leaf, one after the other: a buffer has shape ``(N, C)``;
- in memory each chunk is followed by zeros up to a multiple of a block size ``B`` (a power of
  two, 8 for models up to ~8M parameters per worker row), so that every block of ``B`` columns
  belongs to one leaf and per-leaf reductions are reductions over blocks. These zeros are never
  part of any computation (the compressor keeps them zero) and are dropped on the way back.

:class:`Layout` describes this for a tree of shapes and a worker count; :class:`FlatTree` is a
pytree holding one such buffer (so ``jax.tree.map`` and optax transforms act on the buffer, and
the compressor reads the leaf boundaries from it); :func:`~optax_zero_one.flatten` (in
:mod:`optax_zero_one.core.wrappers`) is the transform wrapper that converts once on the way in
and once on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_zero_one.core import _checks, _flax_state, _graph

_MAX_BLOCKS = 1 << 20  # block tables of at most 4 MiB (int32) per layout
_MAX_SUM_BLOCK = 512  # the widest run of columns the per-leaf sums add up before the leaf table


def padded_size(size: int, num_workers: int) -> int:
    """Length a leaf of ``size`` elements is padded to for ``num_workers`` workers.

    The smallest multiple of ``8 N`` that holds ``size`` elements, so that each of the ``N``
    chunks is a whole number of bytes once packed 8 signs per byte. (DeepSpeed pads to a
    multiple of ``N lcm(N, 8)``: the same for ``N`` = 1, 2, 4, 8, up to ``lcm(N, 8) / 8`` times
    more padding per leaf for other ``N``; ``docs/algorithm.md``, "Where we differ".)

    Example:
      >>> padded_size(100, 4)
      128
    """
    if size < 0 or num_workers < 1:
        raise ValueError(
            f"padded_size needs size >= 0 and num_workers >= 1, got {size}, {num_workers}"
        )
    unit = 8 * num_workers
    return -(-size // unit) * unit


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every element of a tree of shapes lives in the ``(N, C)`` buffers (static).

    Two layouts are equal when their leaves' paths, shapes and worker counts are: the tree
    structure itself is kept for reading a buffer back as a tree, but not compared, and a leaf
    wrapped in a Flax NNX variable (path ``['w'].value``) counts as the plain leaf (``['w']``),
    so that a state made by ``nnx.Optimizer`` for ``Param`` leaves serves plain gradients.

    Attributes:
      treedef: the tree structure of the parameters the layout was made from.
      shapes: the shape of each leaf, in ``jax.tree.leaves`` order.
      num_workers: ``N``, the number of rows.
      paths: each leaf's key path, as a string (without a trailing ``.value``).
    """

    treedef: Any = dataclasses.field(compare=False)
    shapes: tuple[tuple[int, ...], ...]
    num_workers: int
    paths: tuple[str, ...] = ()

    @classmethod
    def of(cls, tree: Any, num_workers: int) -> Layout:
        """The layout of ``tree`` (arrays or anything with a ``shape``) for ``N`` workers."""
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        shapes = tuple(tuple(np.shape(x)) for _, x in with_paths)
        paths = tuple(_leaf_name(path) for path, _ in with_paths)
        return cls(treedef, shapes, int(num_workers), paths)

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """``n_l``: elements of each leaf."""
        return np.asarray([math.prod(s) for s in self.shapes], np.int64)

    @functools.cached_property
    def padded(self) -> np.ndarray:
        """``P_l``: the padded length of each leaf (a multiple of ``8 N``)."""
        return np.asarray([padded_size(int(n), self.num_workers) for n in self.sizes], np.int64)

    @functools.cached_property
    def chunks(self) -> np.ndarray:
        """``c_l = P_l / N``: the columns of each leaf that carry values, per row."""
        return self.padded // self.num_workers

    @functools.cached_property
    def block(self) -> int:
        """``B``: the smallest power of two >= 8 for which the buffer has at most 2**20 blocks."""
        block = 8
        while (self._columns(block)).sum() // block > _MAX_BLOCKS:
            block *= 2
        return block

    def _columns(self, block: int) -> np.ndarray:
        return -(-self.chunks // block) * block

    @functools.cached_property
    def columns(self) -> np.ndarray:
        """``c'_l``: the columns each leaf occupies in memory (``c_l`` rounded up to ``B``)."""
        return self._columns(self.block)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """The first column of each leaf."""
        return np.concatenate([[0], np.cumsum(self.columns)])[:-1].astype(np.int64)

    @property
    def width(self) -> int:
        """``C``: the columns of a buffer."""
        return int(self.columns.sum())

    @property
    def num_leaves(self) -> int:
        return len(self.shapes)

    @property
    def num_blocks(self) -> int:
        return self.width // self.block

    @functools.cached_property
    def block_leaf(self) -> np.ndarray:
        """For every block, the index of the leaf it belongs to (int32, ``(C / B,)``)."""
        return np.repeat(np.arange(self.num_leaves), self.columns // self.block).astype(np.int32)

    @functools.cached_property
    def sum_block(self) -> int:
        """The columns per-leaf reductions add up together before they go by leaf: the largest
        power of two up to 512 (at least ``B``) that divides every leaf's columns, so that
        every such run belongs to one leaf. It adds no padding; the fewer runs, the shorter the
        segment sum over them (a serial scatter on XLA:CPU, a scan elsewhere)."""
        size = self.block
        while size < _MAX_SUM_BLOCK and not np.any(self.columns % (2 * size)):
            size *= 2
        return size

    @functools.cached_property
    def sum_block_leaf(self) -> np.ndarray:
        """For every run of :attr:`sum_block` columns, the leaf it belongs to (int32)."""
        runs = self.columns // self.sum_block
        return np.repeat(np.arange(self.num_leaves), runs).astype(np.int32)

    @functools.cached_property
    def block_first(self) -> np.ndarray:
        """For every block, the position of its first column inside its leaf's chunk."""
        first = np.arange(self.num_blocks, dtype=np.int64) * self.block
        return (first - self.starts[self.block_leaf]).astype(np.int32)

    def shape(self) -> tuple[int, int]:
        """The buffer shape ``(N, C)``."""
        return (self.num_workers, self.width)

    def shape_tree(self) -> Any:
        """The tree of shapes this layout holds, as ``jax.ShapeDtypeStruct`` (float32) leaves."""
        leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in self.shapes]
        return jax.tree.unflatten(self.treedef, leaves)

    def check_tree(self, tree: Any, what: str, where: str) -> None:
        """Raises a ``ValueError`` naming the leaf if ``tree`` (``what``) does not have this
        layout's leaves (made for ``where``); wrapper nodes around the leaves may differ."""
        names = tuple(_leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))
        if names != self.paths:
            raise ValueError(
                f"{what} does not have the tree structure of {where}.\n"
                f"  {what}: leaves {list(names)}\n  {where}: leaves {list(self.paths)}"
            )
        shapes = jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(self.shape_tree()))
        _checks.check_tree_matches(tree, shapes, what, where)

    def check(self, other: Layout, what: str) -> None:
        """Raises a ``ValueError`` explaining how ``other`` (found in ``what``) differs."""
        if other == self:
            return
        if other.num_workers != self.num_workers:
            raise ValueError(
                f"{what} was made for {other.num_workers} workers, but this axis has "
                f"{self.num_workers}. Initialise the optimizer for this worker count (or restore "
                "a checkpoint made with it; see optax_zero_one.check_worker_count)."
            )
        raise ValueError(
            f"{what} was made for another parameter tree (the leaves differ).\n"
            f"  state: {list(zip(other.paths, other.shapes))}\n"
            f"  here:  {list(zip(self.paths, self.shapes))}"
        )

    # -- per-element facts, from per-block tables broadcast along each block ---------------

    @functools.cached_property
    def _block_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block: in-chunk columns, the chunk length ``c_l`` and ``n_l`` minus the chunk
        position of the block's first column (what the element test below needs)."""
        leaf = self.block_leaf
        first = self.block_first.astype(np.int64)
        valid = np.clip(self.chunks[leaf] - first, 0, self.block)
        limit = self.sizes[leaf] - first
        return valid.astype(np.int32), self.chunks[leaf].astype(np.int32), limit.astype(np.int64)

    @property
    def has_memory_padding(self) -> bool:
        """Whether some chunk is shorter than the columns it occupies (``c_l % B != 0``)."""
        return bool(np.any(self.chunks % self.block))

    @property
    def has_padding(self) -> bool:
        """Whether any entry of a buffer is padding of either kind."""
        return self.has_memory_padding or bool(np.any(self.sizes != self.padded))

    def blocks(self, x: jax.Array) -> jax.Array:
        """A ``(..., C)`` buffer viewed as ``(..., C / B, B)`` (a bitcast)."""
        return x.reshape(*x.shape[:-1], self.num_blocks, self.block)

    def in_chunk(self) -> jax.Array | bool:
        """bool ``(1, C)``: the column is one of its leaf's ``c_l`` columns (not the memory
        padding up to the block size); ``True`` when there is no such padding."""
        if not self.has_memory_padding:
            return True
        valid = jnp.asarray(self._block_tables[0])[:, None]
        column = lax.broadcasted_iota(jnp.int32, (self.num_blocks, self.block), 1)
        return (column < valid).reshape(1, self.width)

    def is_element(self) -> jax.Array | bool:
        """bool ``(N, C)``: the entry holds an element of the tree (not padding of either
        kind); ``True`` when there is no padding."""
        if not self.has_padding:
            return True
        valid, chunk, limit = self._block_tables
        row = lax.broadcasted_iota(jnp.int32, (self.num_workers, 1), 0)
        # Elements of row j in a block: columns below limit - j c_l (and below the chunk's end).
        rows = jnp.asarray(np.minimum(limit, np.iinfo(np.int32).max).astype(np.int32))[None]
        count = jnp.clip(rows - row * jnp.asarray(chunk)[None], 0, jnp.asarray(valid)[None])
        column = lax.broadcasted_iota(jnp.int32, (1, self.num_blocks, self.block), 2)
        return (column < count[..., None]).reshape(self.num_workers, self.width)

    def padded_leaves(self, buffer: jax.Array) -> list[jax.Array]:
        """Each leaf's padded vector (``P_l`` elements: chunk ``j`` from row ``j``) from a
        ``(..., N, C)`` buffer, leading axes kept (for inspection and tests)."""
        batch = buffer.shape[:-2]
        return [
            buffer[..., int(start) : int(start) + int(chunk)].reshape((*batch, int(padded)))
            for start, chunk, padded in zip(self.starts, self.chunks, self.padded)
        ]

    def chunk_leaves(self, row: jax.Array) -> list[jax.Array]:
        """Each leaf's chunk (``c_l`` elements) of a ``(..., C)`` row such as a server error."""
        return [
            row[..., int(start) : int(start) + int(chunk)]
            for start, chunk in zip(self.starts, self.chunks)
        ]

    def per_block(self, per_leaf: jax.Array) -> jax.Array:
        """Per-leaf values ``(..., L)`` as one value per block, ``(..., C / B, 1)``: broadcast
        against a buffer's blocks (:meth:`blocks`)."""
        return jnp.take(per_leaf, jnp.asarray(self.block_leaf), axis=-1)[..., None]

    def per_column(self, per_leaf: jax.Array) -> jax.Array:
        """Per-leaf values ``(..., L)`` spread over each leaf's columns: ``(..., C)``."""
        per_block = self.per_block(per_leaf)
        spread = jnp.broadcast_to(per_block, (*per_block.shape[:-1], self.block))
        return spread.reshape(*per_leaf.shape[:-1], self.width)


def _leaf_name(path: tuple) -> str:
    """A leaf's key path as a string, without the ``.value`` of a Flax NNX variable."""
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value":
        path = path[:-1]
    return _checks.leaf_name(path)


@jax.tree_util.register_pytree_with_keys_class
class FlatTree:
    """A pytree stored as one buffer in the worker-major :class:`Layout`.

    A pytree node with one child (``buffer``, ``(N, C)`` plus any leading batch axes) and the
    layout as static data: ``jax.tree.map`` and optax transforms act on the buffer, so a chain
    of elementwise transforms over a ``FlatTree`` is a few operations whatever the number of
    leaves, and the compressed mean reads the leaf boundaries from it.
    """

    def __init__(self, buffer: Any, layout: Layout):
        self.buffer = buffer
        self.layout = layout

    def tree_flatten_with_keys(self) -> tuple:
        return ((jax.tree_util.GetAttrKey("buffer"), self.buffer),), self.layout

    def tree_flatten(self) -> tuple:  # without keys: what a plain flatten calls (~3x faster)
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: Any) -> FlatTree:
        return cls(children[0], layout)

    def moved(self, every: Any, fresh: FlatTree, move: Any) -> FlatTree:
        """Worker 0's values laid out again for ``fresh``'s worker count (checkpoints moved to
        another worker count, :func:`~optax_zero_one.reset_compression`)."""
        del every, move
        if not isinstance(fresh, FlatTree):
            raise ValueError("fresh_state is not a state of the same optimizer as opt_state.")
        tree = FlatTree(jnp.asarray(self.buffer), self.layout).to_tree()
        return to_flat(tree, fresh.layout, np.asarray(fresh.buffer).dtype)

    def shapes(self) -> Any:
        """The tree this buffer holds, as ``jax.ShapeDtypeStruct`` leaves (float32)."""
        return self.layout.shape_tree()

    def __repr__(self) -> str:
        shape = getattr(self.buffer, "shape", None)
        return f"FlatTree({self.layout.num_leaves} leaves, buffer {shape})"

    def to_tree(self, dtypes: Any = None) -> Any:
        """The tree this buffer holds, leaves in their own shapes (any leading batch axes kept).

        Static slices: for inspection, tests and evaluation. The optimizers' own way back is
        :func:`flatten`'s, which keeps the compiled program from growing with the leaves.
        """
        layout = self.layout
        batch = self.buffer.shape[:-2]
        # a zero-size leaf is made, not sliced: a size-0 slice at the end of the buffer
        # aborted XLA:CPU's compiler inside a one-device shard_map (jax 0.10)
        leaves = [
            padded[..., : int(size)].reshape((*batch, *shape))
            if size
            else jnp.zeros((*batch, *shape), self.buffer.dtype)
            for padded, size, shape in zip(
                layout.padded_leaves(self.buffer), layout.sizes, layout.shapes
            )
        ]
        if dtypes is not None:
            leaves = [x.astype(d) for x, d in zip(leaves, jax.tree.leaves(dtypes))]
        return jax.tree.unflatten(layout.treedef, leaves)


def _flax_state_dict(flat: FlatTree) -> dict:
    return {"buffer": flat.buffer}


def _from_flax_state_dict(target: FlatTree, state: dict) -> FlatTree:
    buffer = state["buffer"]
    want = tuple(getattr(target.buffer, "shape", np.shape(target.buffer)))
    got = tuple(np.shape(buffer))
    if got != want:
        raise ValueError(
            f"A saved flat optimizer buffer has shape {got}, the state restored into has {want}: "
            "the checkpoint was saved for another number of data workers or another params "
            "tree. Restore into a state built as the saved run's was (init(..., num_workers=) "
            "with its worker count), then move it with ozo.reset_compression."
        )
    return FlatTree(buffer, target.layout)


_flax_state.install(FlatTree, _flax_state_dict, _from_flax_state_dict)


def compute_dtype(tree: Any) -> jnp.dtype:
    """The dtype of the flat buffers: float32, or wider if a leaf is wider."""
    return jnp.result_type(jnp.float32, *[jnp.result_type(x) for x in jax.tree.leaves(tree)])


def to_flat(tree: Any, layout: Layout, dtype: Any = None) -> FlatTree:
    """``tree`` in ``layout`` (zeros in all padding); dtype :func:`compute_dtype` by default."""
    dtype = dtype or compute_dtype(tree)
    n = layout.num_workers
    pieces = []
    zero = np.zeros((), dtype)
    for leaf, size, padded, columns in zip(
        jax.tree.leaves(tree), layout.sizes, layout.padded, layout.columns
    ):
        # lax.pad, not jnp.pad: one primitive each, and none where there is nothing to pad
        # (the common case): fewer operations to trace, lower and compile for a large tree
        flat = jnp.ravel(leaf).astype(dtype)
        if padded > size:
            flat = lax.pad(flat, zero, [(0, int(padded - size), 0)])
        rows = flat.reshape(n, int(padded) // n)
        if columns > rows.shape[1]:
            rows = lax.pad(rows, zero, [(0, 0, 0), (0, int(columns) - rows.shape[1], 0)])
        pieces.append(rows)
    buffer = jnp.concatenate(pieces, axis=1) if pieces else jnp.zeros((n, 0), dtype)
    return FlatTree(buffer, layout)


def layout_of(tree: Any, num_workers: int) -> Layout:
    """The layout of ``tree``: its own if it is a :class:`FlatTree`, else made for it."""
    return tree.layout if isinstance(tree, FlatTree) else Layout.of(tree, num_workers)


def as_flat(tree: Any, num_workers: int) -> tuple[FlatTree, Any]:
    """``tree`` as a :class:`FlatTree` (itself if it is one), and the function that puts a
    :class:`FlatTree` of the same layout back in ``tree``'s form (leaves in its dtypes).

    How a transform that works on flat buffers also takes a plain tree, as when it is used on
    its own outside :func:`~optax_zero_one.flatten`.
    """
    if isinstance(tree, FlatTree):
        return tree, lambda values: values
    dtypes = jax.tree.map(jnp.result_type, tree)
    return to_flat(tree, Layout.of(tree, num_workers)), lambda values: values.to_tree(dtypes)


def zeros(layout: Layout, dtype: Any = jnp.float32) -> FlatTree:
    """A zero buffer of ``layout``."""
    return FlatTree(jnp.zeros(layout.shape(), dtype), layout)


def leaf_offsets(layout: Layout) -> jax.Array:
    """The first column of each leaf, int32 ``(leaves,)`` (:func:`flatten` keeps them in its
    state)."""
    return jnp.asarray(_graph.int32_starts(layout.starts))


def leaf_keys(layout: Layout) -> np.ndarray:
    """A fingerprint of each leaf's path and shape (CRC-32), int32 ``(leaves,)``.

    :func:`flatten` keeps them in its state: a checkpoint restores flat buffers by position, not
    by name, so these are what tells a restored state's leaves from those of the tree it is
    restored for (:func:`~optax_zero_one.check_restored`)."""
    keys = [
        zlib.crc32(f"{path}|{shape}".encode()) for path, shape in zip(layout.paths, layout.shapes)
    ]
    return np.asarray(keys, np.uint32).view(np.int32)


def cut_leaves(
    take: Callable[[Any, int], jax.Array], layout: Layout, offsets: Any, dtypes: Any
) -> Any:
    """The tree held by the flat buffer whose columns ``[start, start + width)``
    ``take(start, width)`` returns (:func:`~optax_zero_one.core._cut.call_and_cut`), cut out at
    ``offsets`` (int32 scalars, one per leaf), with the structure and dtypes of ``dtypes`` (a
    tree of dtypes)."""
    leaves = []
    for i, (shape, dtype) in enumerate(zip(layout.shapes, jax.tree.leaves(dtypes))):
        chunk, size = int(layout.chunks[i]), int(layout.sizes[i])
        if not size:  # made, not sliced (see FlatTree.to_tree)
            leaves.append(jnp.zeros(shape, dtype))
            continue
        piece = take(offsets[i], chunk).reshape(-1)
        if piece.shape[0] > size:
            piece = lax.slice_in_dim(piece, 0, size)
        leaves.append(piece.reshape(shape).astype(dtype))
    return jax.tree.unflatten(jax.tree.structure(dtypes), leaves)


def find_layout(tree: Any) -> Layout | None:
    """The layout of the first :class:`FlatTree` in ``tree`` (``None`` if it holds none)."""
    found = _graph.nodes_of(tree, FlatTree)
    return found[0].layout if found else None
