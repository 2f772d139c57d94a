"""1-bit compression with error feedback: pure functions on flat float32 vectors.

These are the pieces of the compressed mean (``ALGORITHM.md``, "The 1-bit compressed mean with
error feedback") that involve no communication:

- :func:`padded_size`: the length ``P`` a leaf is padded to for ``N`` workers;
- :func:`compress`: error-compensate, take the RMS scale and the signs, and return the new error;
- :func:`pack_signs` / :func:`unpack_signs`: 8 signs per byte and back;
- :func:`scales_to_bytes` / :func:`bytes_to_scales`: float32 scales bit-cast into a byte payload.

Everything here is elementwise or a reduction along the last axis, so it works unchanged under
``vmap`` and inside ``shard_map``/``pmap`` bodies.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def padded_size(size: int, num_workers: int) -> int:
    """Length a leaf of ``size`` elements is padded to for ``num_workers`` workers.

    The smallest multiple of ``N * lcm(N, 8)`` that holds ``size`` elements, so that each of the
    ``N`` chunks is a whole number of bytes once packed 8 signs per byte (DeepSpeed's choice).

    Args:
      size: number of elements of the leaf (``>= 0``).
      num_workers: number of workers ``N`` (``>= 1``).

    Returns:
      ``P``, a multiple of ``N * lcm(N, 8)``; ``0`` for an empty leaf.

    Example:
      >>> padded_size(100, 4)
      128
    """
    if size < 0 or num_workers < 1:
        raise ValueError(
            f"padded_size needs size >= 0 and num_workers >= 1, got {size}, {num_workers}"
        )
    unit = num_workers * math.lcm(num_workers, 8)
    return -(-size // unit) * unit


def compress(
    z: jax.Array, error: jax.Array, *, axis: int = -1
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Error-compensated 1-bit compression of ``z`` along ``axis``.

    With ``a = z + error``::

        scale = ||a||_2 / sqrt(n)            (the RMS over the ``n`` entries along ``axis``)
        signs = a >= 0                       (zero maps to +1)
        new_error = a - scale * (2 * signs - 1)

    The RMS (not the mean absolute value) keeps the error buffer bounded over long runs.

    Args:
      z: float32 array; the values to compress (already padded).
      error: float32 array like ``z``; the error carried from the previous call.
      axis: the axis over which one scale is shared.

    Returns:
      ``(signs, scale, new_error)``: boolean signs like ``z``, the float32 scale (``axis``
      reduced, kept with size 1) and the new error like ``z``.
    """
    a = jnp.moveaxis(z + error, axis, -1)
    n = a.shape[-1]
    # Scaling by an exact power of two (from the largest magnitude) keeps the sum of squares
    # from overflowing (|a| > ~1.8e19 in float32) or flushing to zero (|a| < ~1e-19); it is
    # exact, so the scale is bitwise unchanged in the normal range.
    peak = jnp.max(jnp.max(jnp.abs(as_rows(a)), axis=-1), axis=-1, keepdims=True)
    info = jnp.finfo(a.dtype)
    exponent = jnp.clip(jnp.frexp(peak)[1], info.minexp + 1, info.maxexp - 1)
    unit = jnp.ldexp(jnp.ones_like(peak), -exponent)
    scale = jnp.sqrt(sum_of_squares(a, unit) / n) / unit
    signs = a >= 0
    new_error = a - jnp.where(signs, scale, -scale)
    back = lambda x: jnp.moveaxis(x, -1, axis)  # noqa: E731
    return back(signs), back(scale), back(new_error)


_ROW = 1024


def as_rows(x: jax.Array) -> jax.Array:
    """``(..., n)`` as rows ``(..., ceil(n / 1024), 1024)``, zero-padded (``n <= 1024``: one row).

    XLA:CPU reduces the last axis of a 2-D array about five times faster than a whole 1-D array
    (measured: 20M float32 elements, 14 ms vs 70 ms), so long reductions go row by row.
    """
    n = x.shape[-1]
    if n <= _ROW:
        return x[..., None, :]
    pad = -n % _ROW
    if pad:
        x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], pad), x.dtype)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, _ROW)


def sum_of_squares(a: jax.Array, unit: jax.Array) -> jax.Array:
    """``sum((a * unit)**2)`` along the last axis (kept with size 1), bitwise identical however
    the workers are mapped.

    An explicit tree of additions (:func:`pairwise_sum`), not an XLA reduction: XLA:CPU orders a
    reduction differently depending on the batch shape (seen for 12 of 94 lengths under
    ``vmap`` vs alone) and even on the operations fused into it. ``max(., 0)`` is exact on
    squares but keeps LLVM from contracting square-then-add into FMAs in one program and not
    in another (``lax.optimization_barrier`` does not help: XLA:CPU drops it before fusion).
    """
    return pairwise_sum(jnp.maximum(jnp.square(a * unit), 0.0), axis=-1)


def pairwise_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum along ``axis`` in a fixed tree of additions, keeping the axis with size 1.

    XLA may order a reduction differently for a batched array (under ``vmap``) than for a single
    one (under ``shard_map``/``pmap``; seen for 12 of 94 lengths tried), and the scales must be
    bitwise identical whichever way the workers are mapped. Explicit elementwise additions fix
    the order of every addition (and are more accurate than a sequential sum). Each level adds
    eight contiguous blocks in a fixed tree, one elementwise pass that reads the input once;
    lengths that do not split are padded with zeros, which is exact.
    """
    x = jnp.moveaxis(x, axis, -1)
    while x.shape[-1] > 1:
        ways = 8 if x.shape[-1] >= 64 else 2
        if x.shape[-1] % ways:
            pad = ways - x.shape[-1] % ways
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], pad), x.dtype)], axis=-1)
        block = x.shape[-1] // ways
        b = [x[..., i * block : (i + 1) * block] for i in range(ways)]
        if ways == 8:
            x = ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]))
        else:
            x = b[0] + b[1]
    if x.shape[-1] == 0:
        x = jnp.zeros((*x.shape[:-1], 1), x.dtype)
    return jnp.moveaxis(x, -1, axis)


def pack_signs(signs: jax.Array) -> jax.Array:
    """Packs booleans 8 per byte along the last axis (whose length must be a multiple of 8)."""
    return jnp.packbits(signs, axis=-1)


def unpack_signs(packed: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Inverse of :func:`pack_signs`, as ``+1``/``-1`` values of ``dtype``."""
    bits = jnp.unpackbits(packed, axis=-1)
    return (2 * bits.astype(dtype) - 1).astype(dtype)


def scales_to_bytes(scales: jax.Array) -> jax.Array:
    """Bit-casts float32 scales of shape ``(..., L)`` into bytes of shape ``(..., 4 * L)``."""
    raw = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
    return raw.reshape(*scales.shape[:-1], 4 * scales.shape[-1])


def bytes_to_scales(raw: jax.Array) -> jax.Array:
    """Inverse of :func:`scales_to_bytes`: bytes ``(..., 4 * L)`` to float32 ``(..., L)``."""
    grouped = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 4, 4)
    return jax.lax.bitcast_convert_type(grouped, jnp.float32)
