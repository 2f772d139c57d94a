r"""The compressed mean on one integer ``psum``: packed sign counts under a shared scale.

The second backend of the compressed mean (``collective="psum"`` of
:func:`~optax_zero_one.onebit_mean` and the optimizers). The two-phase backend needs two rounds
because every worker's signs carry their own scale and a server must weigh them. Here every
worker uses *one shared scale per leaf*, so a sign needs no weight and the mean of the compressed
values follows from the number of workers whose sign is positive, which an integer ``psum`` of
packed bits computes exactly. One all-reduce per call, whatever the number of leaves; no server
stage and no server error.

For ``N`` workers (``2 <= N <= 255``; ``N = 1`` is the identity) and one leaf of ``n``
elements, worker ``i`` with input ``z_i`` and error ``e_i`` (``n`` elements, no padding)::

    a_i = z_i + e_i
    s_i = ||a_i||_2 / sqrt(n)                    its RMS, sent as a float32 (bit-exact, below)
    b_i = a_i >= 0                               (zero counts as positive)
    --- one psum of [packed b_i of every leaf | encoded s_i of every leaf] ---
    c   = sum_i b_i                              in 0..N, per element, exact
    S   = (1/N) sum_i s_i                        the shared scale, identical on every worker
    out = S (2c - N) / N                         = mean_i S (2 b_i - 1), the compressed mean
    e_i <- a_i - S (2 b_i - 1)                   the worker error, with the *shared* scale

**Why the scale can ride in the same round.** The signs do not depend on the scale; only the
output and the error update do, and both come after the psum. So every worker sends its own
``s_i`` in the same payload and all of them use the mean. The mean of the RMS scales is the
choice that makes ``out`` equal to the two-phase backend's first-stage average
``(1/N) sum_i s_i (2 b_i - 1)`` wherever the workers agree on the sign (the signal part of a
gradient), and it needs nothing from earlier calls (no lag, no state). The scales are summed
*exactly*, as integers: a non-negative finite float32 is ``M 2^p 2^-149`` with ``M < 2^24`` and
``0 <= p <= 253``, i.e. a 277-bit integer ``X = M << p``, written in twelve 24-bit limbs, one
limb per uint32 word. ``M << p`` touches at most two limbs; each worker adds less than ``2^24``
per word, so ``N <= 255`` workers sum without overflow and the carries are propagated after the
psum (:func:`decode_scales`). A thirteenth word counts non-finite scales (then ``S`` is NaN, as
the two-phase backend's output would be). The exact sum is then read into a float32 from its top
three limbs and divided by ``N`` (relative error below ``2^-22``). Integer addition is
associative, so the sum behind ``S`` is the same whichever algorithm, order or process layout
performs the all-reduce (a float ``pmean``'s is not, across processes); the division by ``N``
may be compiled as a multiplication by a rounded ``1/N`` (XLA:CPU at ``N = 3``), so two
programs can differ in the last bit of ``S``.

**Error feedback.** Summing ``out = mean_i (a_i - e_i')`` over calls ``t = 1..T`` telescopes::

    sum_t out_t = sum_t mean_i z_{i,t} - mean_i e_{i,T}            (exactly, in exact arithmetic)

the analogue of the two-phase identity with no server term. Boundedness (a mechanism, not a
proof; the two-phase scheme has none either): per element the update is a sigma-delta step of
size ``S``, ``|e'| = ||a| - S| <= max(S, |e| + |z| - S)``, so an error grows only while
``|z| > S``, and ``S >= s_i / N >= |a_i[k]| / (N sqrt(n))`` grows with it, so each error
settles within about ``N sqrt(n)`` times the largest input (tested over thousands of calls,
workers up to ``10^8`` apart in magnitude). The price of sharing the scale: a worker whose
inputs dwarf the others' is sent at about ``1/N`` of its own RMS per call, so its error settles
near ``(N - 1)`` times its input (dense inputs) where its own scale would keep it near its
input; small workers' errors stay below ``S``. Measured, ``N = 8``, 257 elements, 3,000 calls:
zero-mean noise, max ``|e|`` 1-3x the largest input for both backends; persistent per-worker
biases, ~50-60x (two-phase: ~12x).

**Fields and packing.** A count ``0..N`` needs ``w = ceil(log2(N + 1))`` bits (:func:`field_width`:
2 bits for ``N = 2, 3``, 4 for ``N = 8..15``, 8 for ``N = 128..255``); a uint32 word holds ``f =
floor(32 / w)`` fields (:func:`fields_per_word`). Each worker puts a 0/1 bit in each field, so every
field of the psum holds at most ``N < 2^w`` and no carry crosses a field. The signs of the whole
``(N, C)`` buffer (``T = N C`` entries: each leaf padded as the flat layout pads it, padding entries
sending 0) are padded with zeros to ``f W`` with ``W = ceil(T / f)``, and laid out in planes:
element ``k W + j`` is field ``k`` (bits ``k w .. k w + w - 1``) of word ``j`` (:func:`pack_signs`,
:func:`unpack_counts`). Padding bits are zero on every worker, hence count zero, and are dropped.
Larger ``N`` is rejected: ``w`` would exceed 8 bits and the scale limbs would overflow, and the psum
backend already sends more bytes than the two-phase one (use ``collective="two_phase"``).

**Traffic per worker**: one uint32 all-reduce of ``W + 13 L`` words for ``L`` leaves (zero-size ones
included), i.e. about ``32 / f`` bits per element (4 for ``N = 8..15``, 8 for ``N = 64..255``) in
the payload and twice that through a ring; the two-phase backend sends about 2 bits per element in
two rounds, a float32 all-reduce 64.

Everything except the psum is elementwise, integer, or a fixed-order sum
(:func:`optax_zero_one.core.compression.ordered_sum`), so every worker of a program gets the
same bits, under ``jax.shard_map``, ``jax.pmap`` and ``jax.vmap(axis_name=...)``; across
those mappings the divisions by ``N`` may round differently (see ``S`` above).

Example:
  >>> tx = optax_zero_one.onebit_mean("w", collective="psum")  # inside shard_map/pmap/vmap

References:
  Counting signs in an all-reduce is signSGD's majority vote (Bernstein et al.,
  arXiv:1810.05291), here with error feedback (Karimireddy et al., arXiv:1901.09847) and the
  workers' mean scale instead of a vote; 1-bit Adam, arXiv:2102.02888; 0/1 Adam,
  arXiv:2202.06009.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from optax_zero_one.core import compression
from optax_zero_one.core.flat import Layout

MAX_WORKERS = 255
LIMB_BITS = 24
NUM_LIMBS = 12  # 12 * 24 = 288 bits >= 277 bits of a float32 as a fixed-point integer + 8 of sum
SCALE_WORDS = NUM_LIMBS + 1  # the limbs and a count of non-finite scales
_LIMB_MASK = (1 << LIMB_BITS) - 1
_EXP_OFFSET = 149  # a float32 is an integer multiple of 2^-149


def check_num_workers(num_workers: int) -> None:
    """Raises ``ValueError`` unless ``1 <= num_workers <= 255`` (the psum backend's range)."""
    if not 1 <= num_workers <= MAX_WORKERS:
        raise ValueError(
            f"collective='psum' counts positive signs in fields of at most 8 bits inside uint32 "
            f"words, which holds at most {MAX_WORKERS} workers; this axis has {num_workers}. "
            "Use collective='two_phase' (no limit on the number of workers, and fewer bytes at "
            "that scale)."
        )


def field_width(num_workers: int) -> int:
    """Bits per count field, ``w = ceil(log2(N + 1))``: enough for every count ``0..N``.

    Example:
      >>> [field_width(n) for n in (2, 3, 4, 8, 15, 16, 255)]
      [2, 2, 3, 4, 4, 5, 8]
    """
    check_num_workers(num_workers)
    return num_workers.bit_length()


def fields_per_word(num_workers: int) -> int:
    """Count fields per uint32 word, ``f = floor(32 / w)`` (16 for ``N = 2``, 4 for ``N >= 64``)."""
    return 32 // field_width(num_workers)


def payload_words(layout: Layout) -> int:
    """uint32 words one worker contributes to the psum for a buffer of ``layout``.

    ``ceil(N C / f) + 13 L``: the sign fields of every entry of the ``(N, C)`` buffer (padding
    entries count zero) and the encoded scales of the ``L`` leaves; ``0`` when ``N == 1``.
    """
    n = layout.num_workers
    if n == 1 or layout.width == 0:
        return 0
    return -(-(n * layout.width) // fields_per_word(n)) + SCALE_WORDS * layout.num_leaves


def pack_signs(signs: jax.Array, num_workers: int) -> jax.Array:
    """Packs a flat boolean vector into uint32 words of ``w``-bit fields, in planes.

    Element ``k W + j`` (``W = ceil(T / f)``) becomes bit ``k w`` of word ``j``; the other bits of
    each field stay zero, so that the psum of ``N`` workers' words counts into them.

    Args:
      signs: boolean ``(T,)``, ``True`` for a positive sign.
      num_workers: ``N``, which fixes ``w`` and ``f``.

    Returns:
      uint32 ``(W,)``.
    """
    width, per_word = field_width(num_workers), fields_per_word(num_workers)
    total = signs.shape[-1]
    words = -(-total // per_word)
    bits = jnp.pad(signs, (0, per_word * words - total)).reshape(per_word, words)
    bits = bits.astype(jnp.uint32)
    packed = bits[0]
    for k in range(1, per_word):
        packed = packed | (bits[k] << jnp.uint32(width * k))
    return packed


def unpack_counts(words: jax.Array, total: int, num_workers: int) -> jax.Array:
    """Inverse layout of :func:`pack_signs` on summed words: the ``total`` counts, as int32."""
    width, per_word = field_width(num_workers), fields_per_word(num_workers)
    mask = jnp.uint32((1 << width) - 1)
    fields = [(words >> jnp.uint32(width * k)) & mask for k in range(per_word)]
    return jnp.stack(fields).reshape(-1)[:total].astype(jnp.int32)


def encode_scales(scales: jax.Array) -> jax.Array:
    """Writes non-negative float32 scales as exact fixed-point integers in 24-bit limbs.

    A finite ``s >= 0`` with biased exponent ``E`` and fraction ``m`` equals ``X 2^-149`` with
    ``X = M << p``, ``M = m + 2^23`` and ``p = E - 1`` (normal) or ``M = m``, ``p = 0`` (subnormal).
    Limb ``q`` (word ``q``) holds bits ``24 q .. 24 q + 23`` of ``X``; word 12 is 1 for a
    non-finite scale (whose limbs are 0). No float arithmetic is involved.

    Args:
      scales: ``(..., L)`` non-negative floats (cast to float32; the sign bit is ignored).

    Returns:
      uint32 ``(..., L, 13)``; summing these over workers (an integer psum) sums the scales exactly.
    """
    bits = lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint32)
    biased = (bits >> jnp.uint32(23)) & jnp.uint32(0xFF)
    fraction = bits & jnp.uint32(0x7FFFFF)
    finite = biased < 255
    mantissa = jnp.where(biased > 0, fraction | jnp.uint32(1 << 23), fraction)
    position = jnp.maximum(biased, jnp.uint32(1)) - jnp.uint32(1)
    limb, shift = position // LIMB_BITS, position % LIMB_BITS
    low = (mantissa << shift) & jnp.uint32(_LIMB_MASK)  # bits above 31 are not needed here
    high = mantissa >> (jnp.uint32(LIMB_BITS) - shift)
    index = jnp.arange(NUM_LIMBS, dtype=jnp.uint32)
    limbs = jnp.where(index == limb[..., None], low[..., None], jnp.uint32(0)) | jnp.where(
        index == limb[..., None] + 1, high[..., None], jnp.uint32(0)
    )
    limbs = jnp.where(finite[..., None], limbs, jnp.uint32(0))
    return jnp.concatenate([limbs, (~finite).astype(jnp.uint32)[..., None]], axis=-1)


def decode_scales(summed: jax.Array, num_workers: int) -> jax.Array:
    """The mean scale from the psum of :func:`encode_scales` over ``N <= 255`` workers.

    Propagates the carries (each summed limb is below ``255 * 2^24``, so nothing overflowed), takes
    the top three non-zero limbs (72 bits, the rest is below ``2^-48`` of the value) as a float32
    and divides by ``N``; the result is then scaled by an exact power of two. Every step is an
    integer operation or a float32 operation whose operands are exact, in a fixed order, so all
    workers get the same bits. NaN if any worker's scale was not finite.

    Args:
      summed: uint32 ``(..., L, 13)``, the sum over workers of :func:`encode_scales`.
      num_workers: ``N``, the number of summed workers.

    Returns:
      float32 ``(..., L)``: ``(1/N) sum_i s_i``, within ``2^-22`` relative.
    """
    carry = jnp.zeros(summed.shape[:-1], jnp.uint32)
    digits = []
    for q in range(NUM_LIMBS):
        value = summed[..., q] + carry
        digits.append(value & jnp.uint32(_LIMB_MASK))
        carry = value >> jnp.uint32(LIMB_BITS)
    digits = jnp.stack(digits, axis=-1)
    index = jnp.arange(NUM_LIMBS, dtype=jnp.int32)
    top = jnp.maximum(jnp.max(jnp.where(digits > 0, index, 0), axis=-1), 2)

    def digit(q: jax.Array) -> jax.Array:  # integer one-hot pick: exact
        return jnp.sum(jnp.where(index == q[..., None], digits, 0), axis=-1).astype(jnp.float32)

    value = (digit(top) * 2.0**48 + digit(top - 1) * 2.0**24) + digit(top - 2)
    value = value / num_workers
    exponent = LIMB_BITS * (top - 2) - _EXP_OFFSET  # in [-149, 67]
    half = jnp.floor_divide(exponent, 2)
    mean = value * _power_of_two(half) * _power_of_two(exponent - half)
    return jnp.where(summed[..., NUM_LIMBS] > 0, jnp.nan, mean).astype(jnp.float32)


def _power_of_two(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` as an exact float32 made from its bits (``-126 <= exponent <= 127``)."""
    return lax.bitcast_convert_type(((exponent + 127) << 23).astype(jnp.int32), jnp.float32)


def compressed_mean(
    x: jax.Array, worker_error: jax.Array, layout: Layout, axis_name: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One call of the psum backend on a flat buffer (see the module docstring for the maths).

    Must be called where ``axis_name`` is bound, with ``2 <= N <= 255`` workers; identical on
    every worker. Only the entries that hold elements of the tree take part (each leaf's RMS is
    over its own ``n`` elements); padding entries send a zero count and stay zero.

    Args:
      x: float ``(N, C)``, this worker's values in ``layout``.
      worker_error: float ``(N, C)``, this worker's error (zero outside the elements).
      layout: the buffers' layout.
      axis_name: the worker axis.

    Returns:
      ``(mean, new_worker_error, finite)``: the compressed mean (zero in the padding), the new
      error, and whether every shared scale is finite (identical on every worker).
    """
    num_workers = layout.num_workers
    check_num_workers(num_workers)
    element = layout.is_element()
    a = jnp.where(element, x + worker_error, 0)
    scales = compression.leaf_rms(a, layout, layout.sizes)  # the error uses the shared one
    signs = (a >= 0) & element
    words = pack_signs(signs.reshape(-1), num_workers)
    payload = jnp.concatenate([words, encode_scales(scales).reshape(-1)])
    summed = lax.psum(payload, axis_name)  # the only collective

    total = signs.size
    counts = unpack_counts(summed[: words.size], total, num_workers).reshape(signs.shape)
    shared = decode_scales(
        summed[words.size :].reshape(layout.num_leaves, SCALE_WORDS), num_workers
    )
    scale = layout.per_column(shared.astype(x.dtype))
    level = (2 * counts - num_workers).astype(x.dtype) / num_workers  # exact integer, divided
    mean = jnp.where(element, scale * level, 0)
    new_error = jnp.where(element, a - jnp.where(signs, scale, -scale), 0)
    return mean, new_error, jnp.all(jnp.isfinite(shared))
