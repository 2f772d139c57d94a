"""The compression pieces on their own: padding, the flat layout, error-compensated signs with
per-leaf scales, packing, scales on the wire."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.reference import padded_size as ref_padded_size

import optax_zero_one as ozo
from optax_zero_one.core import _graph, compression, flat

SHAPES = [(5, 7), (), (64,), (3, 1, 9), (0, 4), (130,)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 24, 64])
def test_padded_size_matches_reference(n):
    for size in [0, 1, 7, 8, 63, 64, 65, 1000, 12345]:
        p = flat.padded_size(size, n)
        assert p == ref_padded_size(size, n)
        assert p >= size and p % (8 * n) == 0 and p - size < 8 * n


def test_padded_size_rejects_bad_input():
    with pytest.raises(ValueError, match="num_workers"):
        flat.padded_size(10, 0)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_flat_layout_round_trip_and_worker_major_rows(n):
    """Row j of the buffer holds chunk j of every leaf; to_flat / to_tree / padded_leaves are
    inverse views, and padding is zero."""
    rng = np.random.default_rng(n)
    tree = {f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(SHAPES)}
    layout = flat.Layout.of(tree, n)
    values = flat.to_flat(tree, layout)
    assert values.buffer.shape == (n, layout.width)
    back = values.to_tree()
    for key in tree:
        np.testing.assert_array_equal(back[key], tree[key])
    leaves = jax.tree.leaves(tree)
    for leaf, padded, chunk in zip(leaves, layout.padded_leaves(values.buffer), layout.chunks):
        expected = np.concatenate([leaf.reshape(-1), np.zeros(padded.size - leaf.size)])
        np.testing.assert_array_equal(padded, expected)
        assert padded.size == chunk * n
    # everything outside the elements is zero
    element = np.broadcast_to(np.asarray(layout.is_element()), values.buffer.shape)
    assert np.all(np.asarray(values.buffer)[~element] == 0)
    assert int(element.sum()) == sum(leaf.size for leaf in leaves)


def test_block_size_grows_with_the_model_and_keeps_chunks_aligned():
    small = flat.Layout.of({"w": jax.ShapeDtypeStruct((1000, 100), jnp.float32)}, 8)
    assert small.block == 8 and not small.has_memory_padding
    big = flat.Layout.of([jax.ShapeDtypeStruct((30_000, 1_024), jnp.float32)] * 12, 2)
    assert big.num_blocks <= 1 << 20 and big.block > 8
    assert np.all(big.columns % big.block == 0) and np.all(big.columns >= big.chunks)


def test_compress_is_sign_rms_and_error_per_leaf():
    rng = np.random.default_rng(0)
    tree = [rng.standard_normal(s).astype(np.float32) * 3 for s in [(40,), (7, 3), ()]]
    layout = flat.Layout.of(tree, 2)
    z = flat.to_flat(tree, layout).buffer
    e = jnp.asarray(rng.standard_normal(z.shape).astype(np.float32) * 0.1)
    e = jnp.where(layout.in_chunk(), e, 0)
    z = z.at[0, 3].set(-e[0, 3])  # a == 0 exactly: must map to +1
    signs, scales, new_e = compression.compress(z + e, layout, layout.padded, layout.in_chunk())
    a = np.asarray(z, np.float64) + np.asarray(e)
    assert bool(signs[0, 3])
    np.testing.assert_array_equal(np.asarray(signs), a >= 0)
    for leaf, padded in enumerate(layout.padded_leaves(jnp.asarray(a))):
        rms = np.sqrt(np.mean(np.asarray(padded) ** 2))
        np.testing.assert_allclose(float(scales[leaf]), rms, rtol=1e-6)
    column = np.asarray(layout.per_column(scales))
    np.testing.assert_allclose(new_e, a - column * np.where(a >= 0, 1, -1), atol=1e-6)


@pytest.mark.parametrize("magnitude", [1e30, 1e-30, 3e38, 1e-36])
def test_scales_are_exact_far_outside_the_squares_range(magnitude):
    """Values whose squares overflow or flush to zero in float32 still get their RMS (down to
    RMS values in the normal range: XLA:CPU flushes subnormal results to zero)."""
    x = np.linspace(-1, 1, 64).astype(np.float32) * np.float32(magnitude)
    layout = flat.Layout.of([x], 1)
    scale = compression.leaf_rms(flat.to_flat([x], layout).buffer, layout, layout.padded)
    want = np.sqrt(np.mean(np.asarray(x, np.float64) ** 2))
    np.testing.assert_allclose(float(scale[0]), want, rtol=1e-6)


@pytest.mark.parametrize(
    "sizes, want_run",
    [
        ([4096, 2048, 4096], 512),  # every leaf's chunk a multiple of 512 columns
        ([4096, 256, 2048], 64),  # a chunk of 64 columns
        ([4096, 96, 2048], 8),  # a chunk of 24 columns: the blocks of 8 themselves
    ],
)
def test_scales_over_runs_of_columns_match_float64(sizes, want_run):
    """The per-leaf sums go over rows of 8 columns, then runs of ``Layout.sum_block`` columns,
    then by leaf: the scales equal the float64 RMS of every leaf, on several worker rows,
    with leaves far outside float32's squares range beside ordinary ones."""
    rng = np.random.default_rng(3)
    magnitudes = [1.0, 1e30, 1e-30]
    tree = [(rng.standard_normal(n) * m).astype(np.float32) for n, m in zip(sizes, magnitudes)]
    layout = flat.Layout.of(tree, 4)
    assert layout.sum_block == want_run
    assert np.all(layout.columns % layout.sum_block == 0) and layout.sum_block >= layout.block
    assert len(layout.sum_block_leaf) == layout.width // layout.sum_block
    buffer = flat.to_flat(tree, layout).buffer
    scales = compression.leaf_rms(buffer, layout, layout.padded)
    for leaf, padded in enumerate(layout.padded_leaves(jnp.asarray(buffer))):
        want = np.sqrt(np.mean(np.asarray(padded, np.float64) ** 2))
        np.testing.assert_allclose(float(scales[leaf]), want, rtol=1e-6)


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


def test_per_column_spreads_each_leafs_value_over_its_columns():
    rng = np.random.default_rng(2)
    tree = [rng.standard_normal(s).astype(np.float32) for s in [(17,), (3, 5), (200,)]]
    layout = flat.Layout.of(tree, 4)
    spread = np.asarray(layout.per_column(jnp.asarray([1.0, 2.0, 3.0])))
    for leaf, start, columns in zip(range(3), layout.starts, layout.columns):
        assert np.all(spread[start : start + columns] == leaf + 1)


@pytest.mark.parametrize("how", ["scatter", "scan", None])
def test_segment_sums_both_ways_and_under_vmap(how):
    """Per-leaf sums: the scatter (CPU) and the segmented scan (GPU, deterministic) both give
    the float64 sums, empty segments 0, and the scan the same bits on every call."""
    rng = np.random.default_rng(3)
    segment_of = np.sort(rng.integers(0, 9, 3000))
    segment_of = segment_of[(segment_of != 0) & (segment_of != 4)]  # segments 0, 4, 9: empty
    x = rng.standard_normal((2, 3, segment_of.size)).astype(np.float32)
    want = np.zeros((2, 3, 10))
    np.add.at(want, (slice(None), slice(None), segment_of), x.astype(np.float64))
    fn = jax.jit(jax.vmap(lambda v: _graph.segment_sums(v, segment_of, 10, how)))
    got = np.asarray(fn(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.all(got[..., [0, 4, 9]] == 0)
    if how != "scatter" or jax.default_backend() == "cpu":  # GPU scatters with atomics (seen)
        np.testing.assert_array_equal(np.asarray(fn(x)), got)


def test_segment_sums_trace_one_form_and_lower_each_platforms():
    """The choice between the scatter and the scan is made at lowering: the trace holds one
    operation (no conditional, neither form traced), CPU lowers to the scatter, GPU and TPU
    to the scan, a lowering for several platforms holds both; vmap, gradients and shard_map
    typing go through it as through either form."""
    rng = np.random.default_rng(4)
    segment_of = np.sort(rng.integers(0, 6, 200))
    segment_of = segment_of[segment_of != 2]
    x = jnp.asarray(rng.standard_normal((3, segment_of.size)), jnp.float32)

    def sums(v, how=None):
        return _graph.segment_sums(v, segment_of, 7, how)

    eqns = jax.make_jaxpr(sums)(x).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["ozo_segment_sums"]
    traced = jax.jit(sums).trace(x)
    for platforms, scatter, scan in (
        (("cpu",), True, False),
        (("cuda",), False, True),
        (("tpu",), False, True),
        (("cpu", "cuda"), True, True),
    ):
        text = traced.lower(lowering_platforms=platforms).as_text()
        assert ("scatter" in text) == scatter, platforms
        # the scan's adds: one per level of its tree at least
        assert (text.count("stablehlo.add") > 4) == scan, platforms
    want = np.asarray(sums(x, "scan"))
    np.testing.assert_allclose(np.asarray(jax.jit(sums)(x)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums(x)), want, rtol=1e-6, atol=1e-6)  # eager
    stacked = jnp.stack([x, 2 * x], axis=1)
    batched = jax.vmap(sums, in_axes=1, out_axes=1)(stacked)
    np.testing.assert_allclose(np.asarray(batched[:, 1]), 2 * want, rtol=1e-6, atol=1e-5)
    loss = lambda v: jnp.sum(jnp.sin(sums(v)))  # noqa: E731
    # d/dx of sum(sin(sums)): each position gets its segment's cos(sum)
    np.testing.assert_allclose(
        np.asarray(jax.grad(loss)(x)), np.cos(want)[:, segment_of], rtol=1e-5, atol=1e-5
    )
    tangent = jax.jvp(sums, (x,), (2 * x,))[1]
    np.testing.assert_allclose(np.asarray(tangent), 2 * want, rtol=1e-6, atol=1e-5)
    mesh = jax.make_mesh((2,), ("w",))
    on_workers = jax.shard_map(
        lambda v: (sums(v), jax.lax.psum(sums(v), "w")),
        mesh=mesh,
        in_specs=jax.P("w"),
        out_specs=(jax.P("w"), jax.P()),
    )
    placed = jax.device_put(jnp.concatenate([x, x[:1]]), jax.NamedSharding(mesh, jax.P("w")))
    own, total = jax.jit(on_workers)(placed)
    assert own.shape == (4, 7) and total.shape == (2, 7)
    for platforms in (("cuda",), ("tpu",)):  # the scan form, typed as shard_map types it
        jax.jit(on_workers).trace(placed).lower(lowering_platforms=platforms)
    weak = jax.ShapeDtypeStruct(x.shape, jnp.float32, weak_type=True)
    assert not jax.eval_shape(sums, weak).weak_type  # as the forms' results
    with pytest.raises(TypeError, match="one entry per position of segment_of"):
        _graph.segment_sums(x[:, :5], segment_of, 7)


def test_the_per_platform_forms_run_outside_a_trace():
    """Outside a trace (``jax.disable_jit``, ``ensure_compile_time_eval`` inside a jit) the
    per-platform primitives run their platform's form op by op; their eager form was a jit of
    the primitive, which under ``disable_jit`` called itself until Python's recursion limit (a
    trial)."""
    segment_of = np.repeat(np.arange(3), 4)
    x = jnp.arange(24.0).reshape(2, 12)
    want = np.asarray(x).reshape(2, 3, 4).sum(-1)
    with jax.disable_jit():
        np.testing.assert_array_equal(np.asarray(_graph.segment_sums(x, segment_of, 3)), want)
        assert [int(v) for v in _graph.cut_offsets(np.array([0, 8]))] == [0, 8]
        assert bool(_graph.computed_once(jnp.asarray(True)))

    @jax.jit
    def offsets():
        with jax.ensure_compile_time_eval():
            return jnp.stack(_graph.cut_offsets(np.array([0, 8, 28])))

    np.testing.assert_array_equal(np.asarray(offsets()), [0, 8, 28])


@pytest.mark.slow
def test_a_whole_update_steps_through_under_disable_jit():
    """What usage.md's "JAX settings" offers for debugging: 0/1 Adam stepped op by op under
    ``jax.disable_jit`` through every kind (in the graph) gives the jitted values."""
    schedule = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=1)
    tx = ozo.zero_one_adam(1e-2, axis_name="i", **schedule)
    kinds = {ozo.zero_one_schedule(**schedule).kind(k).name for k in range(1, 8)}
    assert kinds == {"variance", "compressed", "local", "sync"}
    params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "b": jnp.ones(5)}

    def run():
        update = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="i"))
        p = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), params)
        s = jax.vmap(tx.init, axis_name="i")(p)
        for k in range(7):
            g = jax.tree.map(lambda a, k=k: jnp.cos(a * (k + 1)), p)
            u, s = update(g, s, p)
            p = optax.apply_updates(p, u)
        return p

    jitted = run()
    with jax.disable_jit():
        stepped = run()
    for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [8, 32])
def test_the_blocks_view_packs_and_decodes_as_the_buffer_does(block, monkeypatch):
    """pack_blocks / unpack_blocks (the collective's view) give the bytes of pack_signs and the
    values of per_column(scales) * unpack_signs, also for blocks wider than one byte."""
    monkeypatch.setattr(flat, "_MAX_BLOCKS", 1 << 20 if block == 8 else 4)
    rng = np.random.default_rng(3)
    tree = [rng.standard_normal(s).astype(np.float32) for s in [(40,), (7, 3), (), (33,)]]
    layout = flat.Layout.of(tree, 2)
    assert layout.block == block
    a = flat.to_flat(tree, layout).buffer
    signs, scales, _ = compression.compress_blocks(
        layout.blocks(a), layout, 2 * layout.chunks, True
    )
    packed = compression.pack_blocks(signs)
    np.testing.assert_array_equal(packed, np.packbits(np.asarray(a) >= 0, axis=-1))
    per_row = jnp.stack([scales, 2 * scales])  # a different scale per row, as the servers'
    decoded = compression.unpack_blocks(packed, per_row, layout).reshape(a.shape)
    want = layout.per_column(per_row) * compression.unpack_signs(packed)
    np.testing.assert_array_equal(decoded, want)
    np.testing.assert_array_equal(np.abs(decoded), np.asarray(layout.per_column(per_row)))


@pytest.mark.parametrize("collective", ["two_phase", "psum"])
def test_error_feedback_keeps_what_was_not_sent_in_float64(collective):
    """Error feedback's identity, sum of outputs = sum of true means - mean worker error -
    server error, to float64 rounding under jax_enable_x64. The scales travel as float32, and
    the two-phase errors were computed with the float64 scale: the identity drifted ~1e-7 in
    200 steps (a review), where psum, which uses the decoded scale, held it to ~1e-15."""
    import optax_zero_one as ozo

    with jax.enable_x64(True):
        rng = np.random.default_rng(9)
        n, size, steps = 2, 16, 60
        tx = ozo.onebit_mean("w", num_workers=n, collective=collective)
        z = jnp.asarray(0.1 * rng.standard_normal((steps, n, size)), jnp.float64)
        state = jax.vmap(tx.init, axis_name="w")(z[0])
        update = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, None), axis_name="w"))
        total = np.zeros(size)
        for t in range(steps):
            out, state = update(z[t], state)
            total += np.asarray(out[0], np.float64)
        means = np.asarray(z).mean(1).sum(0)
        worker = np.asarray(state.worker_error.buffer).reshape(n, -1)[:, :size].mean(0)
        server = 0.0
        if collective == "two_phase":
            server = np.asarray(state.server_error).reshape(-1)[:size]
        np.testing.assert_allclose(total, means - worker - server, rtol=0, atol=1e-12)
