"""onebit_mean against the float64 reference, its invariants, the three mappings, and traffic."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from support import mapping
from support.mapping import AXIS, MODES, mapped
from support.reference import CompressedMean

import optax_zero_one as ozo
from optax_zero_one.core.collective import init_errors
from optax_zero_one.core.flat import Layout

SHAPES = [(5, 7), (), (64,), (3, 1, 9), (0, 4), (130,)]


def make_inputs(n, calls, seed=0, dtypes=None):
    """Varied magnitudes per worker (0.1 to 10)."""
    return mapping.make_inputs(SHAPES, n, calls, seed, dtypes, spread=(-1, 1))


def error_leaves(state, n):
    """Per leaf and worker: the padded worker error (P) and the served chunk's error (P/N)."""
    layout = Layout.of([jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES], n)
    worker = layout.padded_leaves(np.asarray(state.worker_error.buffer))
    server = layout.chunk_leaves(np.asarray(state.server_error))
    return worker, server


def run_calls(n, inputs, mode="vmap"):
    return mapping.run_calls(ozo.onebit_mean(AXIS), n, inputs, mode)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_matches_reference_float64(n):
    """In float64 the only departure from the reference is the float32 scales on the wire."""
    with jax.enable_x64(True):
        inputs = make_inputs(n, calls=4, seed=n, dtypes=[np.float64] * len(SHAPES))
        outs, state = run_calls(n, [[jnp.asarray(x) for x in t] for t in inputs])
        ref = CompressedMean(SHAPES, n)
        for tree, out in zip(inputs, outs):
            expected = ref([[leaf[i] for leaf in tree] for i in range(n)])
            for got, want in zip(out, expected):
                for i in range(n):  # identical on every worker
                    np.testing.assert_allclose(np.asarray(got)[i], want, rtol=1e-6, atol=1e-6)
        if n > 1:
            worker, server = error_leaves(state, n)
            for leaf in range(len(SHAPES)):
                for i in range(n):
                    np.testing.assert_allclose(
                        worker[leaf][i], ref.worker_error[i][leaf], rtol=1e-6, atol=1e-6
                    )
                    np.testing.assert_allclose(
                        server[leaf][i], ref.server_error[i][leaf], rtol=1e-6, atol=1e-6
                    )


@pytest.mark.parametrize("n", [2, 8])
def test_matches_reference_mixed_dtypes_float32(n):
    dtypes = [np.float32, np.float32, jnp.bfloat16, np.float32, jnp.float16, np.float32]
    inputs = make_inputs(n, calls=3, seed=10 + n, dtypes=dtypes)
    outs, state = run_calls(n, inputs)
    ref = CompressedMean(SHAPES, n)
    for tree, out in zip(inputs, outs):
        expected = ref([[np.asarray(leaf[i], np.float64) for leaf in tree] for i in range(n)])
        for got, want, dtype in zip(out, expected, dtypes):
            assert got.dtype == dtype
            tol = 1e-4 if dtype == np.float32 else 1e-2
            np.testing.assert_allclose(np.asarray(got, np.float64)[0], want, rtol=tol, atol=tol)
    for leaf in jax.tree.leaves(state):
        assert leaf.dtype == jnp.float32


@pytest.mark.parametrize("n", [2, 4, 8])
def test_error_feedback_identity(n):
    """sum(outputs) = sum(true means) - mean_i(e_w,i) - e_s, per chunk (unpadded part)."""
    calls = 30
    with jax.enable_x64(True):
        inputs = make_inputs(n, calls, seed=3, dtypes=[np.float64] * len(SHAPES))
        outs, state = run_calls(n, [[jnp.asarray(x) for x in t] for t in inputs])
    for leaf, shape in enumerate(SHAPES):
        size = int(np.prod(shape))
        if size == 0:
            continue
        total_out = sum(np.asarray(o[leaf])[0].reshape(-1) for o in outs)
        total_mean = sum(t[leaf].reshape(n, -1).mean(0) for t in inputs)
        worker, server = error_leaves(state, n)
        ew = np.asarray(worker[leaf]).mean(0)
        es = np.asarray(server[leaf]).reshape(-1)  # worker j holds chunk j
        # the identity holds on the padded vectors; the output is seen unpadded
        expected = total_mean - (ew + es)[:size]
        np.testing.assert_allclose(total_out, expected, atol=1e-4 * calls)
        # and the buffers stay bounded by a few single inputs, far below the
        # accumulated sum of `calls` of them (magnitudes differ call to call)
        largest = max(np.abs(t[leaf]).max() for t in inputs)
        assert np.abs(ew).max() < 4 * largest


@pytest.mark.parametrize("n", [4, 8])
def test_same_mean_under_every_mapping_and_on_every_worker(n):
    """Every worker of one program decodes the same bytes (bitwise equal means); vmap, pmap and
    shard_map agree to float rounding (their reductions may associate differently); one
    program run twice gives the same bits."""
    dtypes = [np.float32, np.float32, jnp.bfloat16, np.float32, np.float32, np.float32]
    inputs = make_inputs(n, calls=3, seed=7, dtypes=dtypes)
    results = {mode: run_calls(n, inputs, mode) for mode in MODES}
    for mode, (outs, _) in results.items():
        for out in outs:
            for leaf in out:
                leaf = np.asarray(leaf, np.float32)
                assert np.array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape)), mode
    base = jax.tree.leaves(results["vmap"][0])
    for mode in ("pmap", "shard_map"):
        for a, b in zip(base, jax.tree.leaves(results[mode][0])):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-3
            )
    again = run_calls(n, inputs, "shard_map")[0]
    for a, b in zip(jax.tree.leaves(results["shard_map"][0]), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_worker_and_no_axis_are_identity():
    tree = {"a": jnp.arange(5.0), "b": jnp.ones((2, 3), jnp.bfloat16)}
    tx = ozo.onebit_mean(None)
    state = tx.init(tree)
    out, state2 = tx.update(tree, state)
    assert out is tree or all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(tree))
    )
    assert all(leaf.size == 0 for leaf in jax.tree.leaves(state2))
    # N = 1 under an axis: also the identity
    inputs = make_inputs(1, 2)
    outs, _ = run_calls(1, inputs)
    for got, want in zip(outs[1], inputs[1]):
        np.testing.assert_array_equal(got, want)


def test_init_outside_mapped_context_needs_num_workers():
    params = {"w": jnp.zeros((10,))}
    with pytest.raises(ValueError, match="num_workers"):
        ozo.onebit_mean(AXIS).init(params)
    state = ozo.onebit_mean(AXIS, num_workers=4).init(params)
    assert state.worker_error.buffer.shape == (4, 8)  # 4 rows of one chunk of 8 * 4 / 4
    assert state.server_error.shape == (8,)
    replicated = ozo.replicate(state, 4)
    step = mapped(lambda t, s: ozo.onebit_mean(AXIS, num_workers=4).update(t, s), "vmap", 4)
    out, _ = step(ozo.replicate(params, 4), replicated)
    assert out["w"].shape == (4, 10)
    wrong = mapped(lambda t, s: ozo.onebit_mean(AXIS, num_workers=2).update(t, s), "vmap", 4)
    with pytest.raises(ValueError, match="num_workers=2"):
        wrong(ozo.replicate(params, 4), replicated)


def test_state_for_other_worker_count_is_rejected():
    params = {"w": jnp.zeros((10,))}
    state = ozo.replicate(ozo.onebit_mean(AXIS, num_workers=2).init(params), 4)
    step = mapped(lambda t, s: ozo.onebit_mean(AXIS).update(t, s), "vmap", 4)
    with pytest.raises(ValueError, match="made for 2 workers, but this axis has 4"):
        step(ozo.replicate(params, 4), state)


def test_bad_inputs_rejected_early():
    with pytest.raises(ValueError, match="dtype int32"):
        ozo.onebit_mean(AXIS, num_workers=2).init({"i": jnp.zeros(3, jnp.int32)})
    with pytest.raises(ValueError, match="axis_name"):
        ozo.onebit_mean(3)
    tx = ozo.onebit_mean("missing")
    with pytest.raises(ValueError, match="not bound"):
        jax.vmap(lambda t: tx.update(t, init_errors(Layout.of(t, 2))), axis_name=AXIS)(
            jnp.zeros((2, 3))
        )


def test_sgd_chain_is_one_bit_sgd():
    """chain(onebit_mean, sgd) reduces a shared quadratic although each worker sees noise."""
    n = 4
    tx = optax.chain(ozo.onebit_mean(AXIS), optax.sgd(0.05))
    target = jnp.linspace(-1, 1, 50)
    noise = jax.random.normal(jax.random.key(0), (200, n, 50))

    def step(x, s, eps):
        g = x - target + eps
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    run = mapped(step, "vmap", n)
    x = jnp.zeros((n, 50))
    s = mapped(tx.init, "vmap", n)(x)
    for t in range(200):
        x, s = run(x, s, noise[t])
    assert float(jnp.abs(x - target).max()) < 0.3
    assert float(jnp.abs(x[0] - x[3]).max()) == 0.0


def test_comm_stats_one_all_to_all_one_all_gather():
    """>= 1M float32 over >= 20 leaves, 8 devices: 2 byte collectives, <= 1/28 of a pmean."""
    n = 8
    mesh = jax.make_mesh((n,), (AXIS,))
    shapes = [(256, 200)] * 20 + [(1000,), (), (3, 5)]
    tree = [jax.ShapeDtypeStruct((n, *s), jnp.float32) for s in shapes]
    assert sum(int(np.prod(s)) for s in shapes) >= 1_000_000
    tx = ozo.onebit_mean(AXIS)
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), tree)

    def body(t, s):
        out = tx.update(*jax.tree.map(lambda x: x[0], (t, s)))
        return jax.tree.map(lambda x: x[None], out)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    stats = ozo.comm_stats(
        fn, mapping.sharded_specs(mesh, tree), mapping.sharded_specs(mesh, state)
    )
    assert stats.count() == 2
    assert stats.count("all-to-all") == 1 and stats.count("all-gather") == 1
    assert all(c.dtypes == ("u8",) and c.group_size == n for c in stats.collectives)

    pmean = jax.shard_map(
        lambda t: jax.lax.pmean(t, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
    )
    base = ozo.comm_stats(pmean, mapping.sharded_specs(mesh, tree))
    assert base.count("all-reduce") >= 1 and base.count() == base.count("all-reduce")
    numel = sum(int(np.prod(s)) for s in shapes)
    # the float baseline: a ring all-reduce of every float32 element
    assert base.sent_bytes_per_device == pytest.approx(2 * 4 * numel * (n - 1) / n, rel=1e-3)
    assert stats.sent_bytes_per_device <= base.sent_bytes_per_device / 28
