"""The compression pieces on their own: padding, error-compensated sign, packing, scales."""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import padded_size as ref_padded_size

from optax_zero_one import compression


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 24, 64])
def test_padded_size_matches_reference(n):
    for size in [0, 1, 7, 8, 63, 64, 65, 1000, 12345]:
        p = compression.padded_size(size, n)
        assert p == ref_padded_size(size, n)
        assert p >= size and p % (n * np.lcm(n, 8)) == 0 and p - size < n * np.lcm(n, 8)


def test_padded_size_rejects_bad_input():
    with pytest.raises(ValueError, match="num_workers"):
        compression.padded_size(10, 0)


def test_compress_is_sign_rms_and_error():
    rng = np.random.default_rng(0)
    z = rng.standard_normal(64).astype(np.float32)
    e = rng.standard_normal(64).astype(np.float32) * 0.1
    z[3] = -e[3]  # a == 0 exactly: must map to +1
    signs, scale, new_e = compression.compress(jnp.asarray(z), jnp.asarray(e))
    a = z.astype(np.float64) + e
    assert bool(signs[3])
    np.testing.assert_array_equal(np.asarray(signs), a >= 0)
    np.testing.assert_allclose(float(scale[0]), np.sqrt(np.mean(a**2)), rtol=1e-6)
    np.testing.assert_allclose(
        new_e, a - np.sqrt(np.mean(a**2)) * np.where(a >= 0, 1, -1), atol=1e-6
    )


def test_pack_unpack_roundtrip():
    bits = np.random.default_rng(1).random((3, 40)) > 0.5
    packed = compression.pack_signs(jnp.asarray(bits))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5)
    np.testing.assert_array_equal(compression.unpack_signs(packed), np.where(bits, 1.0, -1.0))


def test_scales_bytes_roundtrip_is_exact():
    s = jnp.asarray([1.5, 3e-30, 7e20, 0.0], jnp.float32)
    raw = compression.scales_to_bytes(s)
    assert raw.dtype == jnp.uint8 and raw.shape == (16,)
    np.testing.assert_array_equal(compression.bytes_to_scales(raw), s)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 1000, 1023])
def test_pairwise_sum_matches_numpy(n):
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    got = compression.pairwise_sum(jnp.asarray(x))
    assert got.shape == (3, 1)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
