"""1-bit compression with error feedback on flat buffers: pure functions, no communication.

The pieces of the compressed mean (``docs/algorithm.md``, "The compressed mean") that involve
no communication, for buffers in the worker-major :class:`~optax_zero_one.core.flat.Layout`:

- :func:`leaf_rms`: one RMS scale per leaf, over that leaf's entries of the buffer;
- :func:`compress`: error-compensated signs, per-leaf scales and the new error;
- :func:`pack_signs` / :func:`unpack_signs`: 8 signs per byte and back;
- :func:`compress_blocks`, :func:`pack_blocks`, :func:`unpack_blocks`: the same on the blocks
  view of a buffer (``(R, C / B, B)``), in which the server stage works (faster on XLA:CPU);
- :func:`scales_to_bytes` / :func:`bytes_to_scales`: float32 scales bit-cast into a byte payload.

Every operation is elementwise, a reduction over fixed blocks of columns, or a segment sum over
the blocks: a few operations for the whole tree, whatever the number of leaves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_zero_one.core import _graph
from optax_zero_one.core.flat import Layout

# Squares of magnitudes in [2**-50, 2**48) neither flush to subnormals nor overflow when up to
# 2**31 of them are summed in float32. Leaves whose largest magnitude lies outside that range are
# summed after an exact power-of-two prescale: the three sums (unscaled, scaled down, scaled up)
# come from one pass, and each leaf takes the one that fits its peak. No branch: a program
# compiled for one step kind holds no conditional (``docs/design.md``).
_SAFE_LOW, _SAFE_HIGH = 2.0**-50, 2.0**48
_DOWN, _UP = 2.0**-96, 2.0**96  # bring peaks in [2**48, 2**128) and [2**-149, 2**-50) in range


_FIRST = 8  # columns summed first: XLA:CPU vectorises a reduction over many short rows


def _combine(x: tuple, y: tuple) -> tuple:
    return x[0] + y[0], x[1] + y[1], x[2] + y[2], jnp.maximum(x[3], y[3])


def _sums_and_peaks(blocks: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """Per leaf: the sums of squares of ``a``, ``a * 2**-96`` and ``a * 2**96`` (``(3, L)``)
    and the largest magnitude (``(L,)``) of ``a``, given as blocks (``(R, C / B, B)``), in one
    pass over ``a``.

    In three steps, each in a fixed order: every 8 columns (one reduction over rows of 8, which
    XLA:CPU runs ~3x faster than one over a ``(0, 2)`` pair of axes of the blocks view), then
    every :attr:`~optax_zero_one.core.flat.Layout.sum_block` columns (a reduction over 1/8 of
    the data), then the rows added in turn and the runs summed by leaf (over ``C / sum_block``
    entries instead of ``C / B``)."""
    rows = blocks.reshape(-1, layout.width)
    zero = jnp.zeros([], blocks.dtype)
    down, up = jnp.asarray(_DOWN, blocks.dtype), jnp.asarray(_UP, blocks.dtype)
    x = rows.reshape(-1, _FIRST)
    terms = (jnp.square(x), jnp.square(x * down), jnp.square(x * up), jnp.abs(x))
    parts = lax.reduce(terms, (zero,) * 4, _combine, (1,))
    group = layout.sum_block // _FIRST
    if group > 1:
        parts = lax.reduce(tuple(p.reshape(-1, group) for p in parts), (zero,) * 4, _combine, (1,))
    per_row = [p.reshape(rows.shape[0], -1) for p in parts]
    sums = jnp.stack([ordered_sum(p) for p in per_row[:3]])
    peaks = per_row[3][0]
    for row in range(1, rows.shape[0]):
        peaks = jnp.maximum(peaks, per_row[3][row])
    leaf, n = layout.sum_block_leaf, layout.num_leaves
    return (
        _graph.segment_sums(sums, leaf, n),  # the order of a sum matters
        jax.ops.segment_max(peaks, jnp.asarray(leaf), n, indices_are_sorted=True),  # not a max's
    )


def _rms(blocks: jax.Array, layout: Layout, lengths: np.ndarray) -> jax.Array:
    """:func:`leaf_rms`'s scales from blocks ``(R, C / B, B)``."""
    sums, peaks = _sums_and_peaks(blocks, layout)
    lengths = jnp.asarray(np.maximum(lengths, 1), blocks.dtype)
    plain = jnp.sqrt(sums[0] / lengths)
    scaled_down = jnp.sqrt(sums[1] / lengths) / jnp.asarray(_DOWN, blocks.dtype)
    scaled_up = jnp.sqrt(sums[2] / lengths) / jnp.asarray(_UP, blocks.dtype)
    in_range = (peaks == 0) | ((peaks >= _SAFE_LOW) & (peaks < _SAFE_HIGH))
    return jnp.where(in_range, plain, jnp.where(peaks >= _SAFE_HIGH, scaled_down, scaled_up))


def leaf_rms(a: jax.Array, layout: Layout, lengths: np.ndarray) -> jax.Array:
    """``||a_l||_2 / sqrt(length_l)`` for every leaf ``l``: the scales, ``(L,)``.

    Args:
      a: ``(R, C)``, zero in the columns that are not the leaf's (the memory padding).
      layout: the buffer's layout.
      lengths: the divisor of each leaf (``P_l`` for a worker's whole leaf, ``c_l`` for a
        server's chunk).
    """
    return _rms(layout.blocks(a), layout, lengths)


def _signs_and_error(
    a: jax.Array, scale: jax.Array, valid: jax.Array | bool
) -> tuple[jax.Array, jax.Array]:
    """``a >= 0`` and ``a - scale * (+-1)`` (zero outside ``valid``), ``scale`` broadcast
    against ``a``."""
    signs = a >= 0
    new_error = a - jnp.where(signs, scale, -scale)
    if valid is not True:
        new_error = jnp.where(valid, new_error, 0)
    return signs, new_error


def compress_blocks(
    blocks: jax.Array, layout: Layout, lengths: np.ndarray, valid: jax.Array | bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`compress` on blocks: ``blocks`` ``(R, C / B, B)`` and ``valid`` broadcastable to
    it; signs and new error returned as blocks too.

    The server stage of the collective works in this view: there a per-leaf scale spread over
    blocks, an unpack of 8 signs per byte and a sum over rows meet, and XLA:CPU fuses them into
    fast loops when they share one shape, into slow ones (an index division per element) when a
    reshape to ``(R, C)`` sits between them. Measured, not assumed: phase 1 and the decoding
    stay ``(R, C)``-shaped, because there the producers and consumers around them are, and the
    blocks view made the whole step slower (``docs/benchmarks/overhead.md``, "The compressed
    mean on CPU")."""
    scales = _sent(_rms(blocks, layout, lengths))
    signs, new_error = _signs_and_error(blocks, layout.per_block(scales), valid)
    return signs, scales, new_error


def compress(
    a: jax.Array, layout: Layout, lengths: np.ndarray, valid: jax.Array | bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """1-bit compression of ``a = z + error`` with one RMS scale per leaf.

    ::

        scale_l = ||a_l|| / sqrt(length_l)     signs = a >= 0 (zero maps to +1)
        new_error = a - scale * (2 signs - 1)  (zero outside ``valid``)

    The RMS (not the mean absolute value) keeps the error buffer bounded over long runs.

    Args:
      a: float ``(R, C)``, zero outside ``valid``.
      layout: the buffer's layout.
      lengths: the RMS divisor of each leaf (see :func:`leaf_rms`).
      valid: bool, broadcastable to ``a``, or ``True``: the entries that belong to the
        compressed vectors; the error stays zero elsewhere.

    Returns:
      ``(signs, scales, new_error)``: bool like ``a``, float ``(L,)``, float like ``a``.
    """
    scales = _sent(_rms(layout.blocks(a), layout, lengths))
    signs, new_error = _signs_and_error(a, layout.per_column(scales), valid)
    return signs, scales, new_error


def _sent(scales: jax.Array) -> jax.Array:
    """``scales`` as they travel (float32, :func:`scales_to_bytes`), in their own dtype: the
    error must be the one the receivers see. With float64 buffers (``jax_enable_x64``) the
    error was computed with the float64 scale and the difference was never fed back (the
    identity ``sum(out) = sum(means) - mean(e_w) - e_s`` drifted ~1e-7 in 200 steps); for
    float32 buffers this is the identity."""
    return scales.astype(jnp.float32).astype(scales.dtype)


_SHIFTS = 7 - np.arange(8, dtype=np.uint8)  # the first of 8 signs is a byte's top bit


def pack_blocks(signs: jax.Array) -> jax.Array:
    """Signs as blocks ``(..., C / B, B)`` packed 8 per byte: ``(..., C / 8)`` (as
    :func:`pack_signs` on the ``(..., C)`` buffer)."""
    *lead, blocks, block = signs.shape
    bits = signs.reshape(*lead, blocks, block // 8, 8).astype(jnp.uint8) << jnp.asarray(_SHIFTS)
    return jnp.sum(bits, axis=-1, dtype=jnp.uint8).reshape(*lead, blocks * block // 8)


def unpack_blocks(packed: jax.Array, scales: jax.Array, layout: Layout) -> jax.Array:
    """Decodes packed signs ``(..., C / 8)`` with per-leaf scales ``(..., L)`` into blocks
    ``(..., C / B, B)`` of ``+-scale`` (typed like ``scales``)."""
    *lead, _ = packed.shape
    grouped = packed.reshape(*lead, layout.num_blocks, layout.block // 8, 1)
    bits = (grouped >> jnp.asarray(_SHIFTS)) & jnp.uint8(1)
    signs = 2 * bits.astype(scales.dtype) - 1
    per_block = layout.per_block(scales)[..., None]
    return (signs * per_block).reshape(*lead, layout.num_blocks, layout.block)


def pack_signs(signs: jax.Array) -> jax.Array:
    """Packs booleans 8 per byte along the last axis (whose length must be a multiple of 8)."""
    return jnp.packbits(signs, axis=-1)


def unpack_signs(packed: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Inverse of :func:`pack_signs`, as ``+1``/``-1`` values of ``dtype``."""
    bits = jnp.unpackbits(packed, axis=-1)
    return (2 * bits.astype(dtype) - 1).astype(dtype)


def scales_to_bytes(scales: jax.Array) -> jax.Array:
    """Bit-casts float32 scales of shape ``(..., L)`` into bytes of shape ``(..., 4 * L)``."""
    raw = lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
    return raw.reshape(*scales.shape[:-1], 4 * scales.shape[-1])


def bytes_to_scales(raw: jax.Array) -> jax.Array:
    """Inverse of :func:`scales_to_bytes`: bytes ``(..., 4 * L)`` to float32 ``(..., L)``."""
    grouped = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 4, 4)
    return lax.bitcast_convert_type(grouped, jnp.float32)


def ordered_sum(x: jax.Array) -> jax.Array:
    """Sum over the leading (worker) axis as a chain of elementwise additions, worker 0 first.

    XLA:CPU reduces a short leading axis slowly (a strided reduction); a chain of additions is
    one fused elementwise pass, and its order is fixed.
    """
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total
