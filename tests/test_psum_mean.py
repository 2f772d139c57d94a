"""The psum backend of the compressed mean (``collective="psum"``): the count fields and the exact
scale sum on their own, a float64 NumPy reference of the scheme, the error-feedback identity,
bounded errors over thousands of calls, the three mappings, the compiled traffic, and both
optimizers end to end."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from support import mapping
from support.mapping import AXIS, MODES, mapped
from support.reference import PsumReference

import optax_zero_one as ozo
from optax_zero_one.core import psum_mean
from optax_zero_one.core.collective import OnebitMeanState, compressed_mean, init_errors
from optax_zero_one.core.flat import FlatTree, Layout, to_flat

SHAPES = [(5, 7), (), (64,), (3, 1, 9), (0, 4), (130,)]


def make_inputs(n, calls, seed=0, dtypes=None):
    """Worker magnitudes spread over 1e-2..1e2, a signal shared by the workers plus noise."""
    return mapping.make_inputs(SHAPES, n, calls, seed, dtypes, spread=(-2, 2), shared=True)


def run_calls(n, inputs, mode="vmap"):
    return mapping.run_calls(ozo.onebit_mean(AXIS, collective="psum"), n, inputs, mode)


# --------------------------------------------------------------------------------------------
# The pieces: field layout, packing, the exact scale sum.


def test_field_width_and_worker_limit():
    assert [psum_mean.field_width(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 64, 127, 128, 255)] == [
        1, 2, 2, 3, 3, 4, 4, 5, 7, 7, 8, 8,
    ]  # fmt: skip
    for n in range(1, 256):
        w = psum_mean.field_width(n)
        assert 2 ** (w - 1) <= n < 2**w  # w = ceil(log2(N + 1)): the counts 0..N fit, no waste
    assert psum_mean.fields_per_word(8) == 8 and psum_mean.fields_per_word(255) == 4
    with pytest.raises(ValueError, match="at most 255 workers.*two_phase"):
        psum_mean.field_width(256)
    # a num_workers given is checked at construction (it passed until init: a docs audit)
    for build in (
        lambda: ozo.onebit_mean(AXIS, num_workers=256, collective="psum"),
        lambda: ozo.zero_one_adam(1e-3, axis_name=AXIS, num_workers=300, collective="psum"),
    ):
        with pytest.raises(ValueError, match="at most 255 workers"):
            build()
    tx = ozo.onebit_mean(AXIS, collective="psum")  # bound axis of 256: rejected while tracing
    state = init_errors(Layout.of(jnp.zeros(3), 2), "psum")
    with pytest.raises(ValueError, match="at most 255 workers"):
        jax.eval_shape(
            jax.vmap(lambda t, s: tx.update(t, s), axis_name=AXIS, in_axes=(0, None)),
            jnp.zeros((256, 3)),
            state,
        )


@pytest.mark.parametrize("n", [3, 8, 255])
def test_psum_of_packed_signs_counts_exactly(n):
    rng = np.random.default_rng(n)
    total = 1001
    signs = rng.random((n, total)) < rng.random((1, total))  # correlated across workers
    words = np.asarray(jax.jit(jax.vmap(lambda s: psum_mean.pack_signs(s, n)))(signs))
    assert words.dtype == np.uint32
    assert words.shape == (n, -(-total // psum_mean.fields_per_word(n)))
    summed = words.astype(np.uint64).sum(0)
    assert summed.max() < 2**32  # the integer psum never wraps
    counts = jax.jit(psum_mean.unpack_counts, static_argnums=(1, 2))(
        summed.astype(np.uint32), total, n
    )
    np.testing.assert_array_equal(np.asarray(counts), signs.sum(0))


float32_scales = st.one_of(
    st.floats(0, float(np.finfo(np.float32).max), width=32, allow_subnormal=True),
    st.integers(-149, 127).map(lambda e: float(np.float32(np.ldexp(1.0, e)))),
    st.just(0.0),
)


_encode = jax.jit(psum_mean.encode_scales)
_decode = jax.jit(psum_mean.decode_scales)  # N traced: one compilation for every N


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 255), st.lists(float32_scales, min_size=1, max_size=255), st.randoms())
def test_scales_sum_exactly_as_integers(n, pool, random):
    """The psum of the encoded float32 scales of any N <= 255 workers decodes to their mean."""
    scales = np.zeros((255, 3), np.float32)  # workers past N send zeros: they add nothing
    scales[:n] = [[random.choice(pool) for _ in range(3)] for _ in range(n)]
    encoded = np.asarray(_encode(scales)).astype(np.uint64)
    assert encoded.shape == (255, 3, psum_mean.SCALE_WORDS)
    summed = encoded.sum(0)
    assert summed.max() < 2**32
    got = np.asarray(_decode(summed.astype(np.uint32), np.int32(n)))
    want = np.array([math.fsum(scales[:, leaf].astype(np.float64)) / n for leaf in range(3)])
    tiny = np.finfo(np.float32).tiny  # XLA:CPU may flush subnormal results to zero
    np.testing.assert_allclose(got, want, rtol=2**-22, atol=tiny)


def test_a_non_finite_scale_gives_nan():
    scales = np.zeros((255, 3), np.float32)
    scales[:2] = [[1.0, 2.0, 3.0], [np.inf, 2.0, np.nan]]
    summed = np.asarray(_encode(scales)).sum(0, dtype=np.uint32)
    got = np.asarray(_decode(summed, np.int32(2)))
    assert np.isnan(got[0]) and got[1] == 2.0 and np.isnan(got[2])


# --------------------------------------------------------------------------------------------
# The collective.


@pytest.mark.parametrize("n", [3, 8])
def test_matches_reference_and_error_feedback_identity_float64(n):
    """Outputs and errors follow the NumPy reference call by call, and over the whole run
    sum(outputs) = sum(true means) - mean_i(e_i): no server term, nothing padded."""
    calls = 30
    with jax.enable_x64(True):
        inputs = make_inputs(n, calls, seed=n, dtypes=[np.float64] * len(SHAPES))
        outs, state = run_calls(n, [[jnp.asarray(x) for x in t] for t in inputs])
    ref = PsumReference(SHAPES, n)
    for tree, out in zip(inputs, outs):
        expected = ref([[leaf[i] for leaf in tree] for i in range(n)])
        for got, want in zip(out, expected):
            got = np.asarray(got)
            assert np.array_equal(got, np.broadcast_to(got[0], got.shape))  # same on every worker
            np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-12)  # float32 scales
    assert state.server_error == optax.EmptyState()  # no server stage
    layout = Layout.of([jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES], n)
    padded = layout.padded_leaves(np.asarray(state.worker_error.buffer))
    for leaf, shape in enumerate(SHAPES):
        size = math.prod(shape)
        assert np.all(padded[leaf][:, size:] == 0)  # the padding takes no part
        if size == 0:
            continue
        errors = padded[leaf][:, :size]
        magnitude = max(np.abs(t[leaf]).max() for t in inputs)
        for i in range(n):
            np.testing.assert_allclose(errors[i], ref.errors[i][leaf], atol=1e-6 * magnitude)
        total_out = sum(np.asarray(o[leaf])[0].reshape(-1) for o in outs)
        total_mean = sum(t[leaf].reshape(n, -1).mean(0) for t in inputs)
        np.testing.assert_allclose(total_out, total_mean - errors.mean(0), atol=1e-12 * magnitude)
        assert np.abs(errors.mean(0)).max() > 1e-6 * magnitude  # the identity is not vacuous


@partial(jax.jit, static_argnames=("n", "calls"))
def _error_run(key, log_mags, mix, density, n, calls):
    """``calls`` calls of the psum mean in one scan over ``n`` vmapped workers, 2 leaves.

    Worker i's input: ``10**log_mags[i] * mask * (mix[0] shared + mix[1] own + mix[2] noise)``:
    a bias shared by all workers, a bias of its own, fresh uniform noise, and a sparsity mask
    of the given density. Returns per call the largest |error| and |input| of each worker.
    """
    shapes = [(), (99,)]

    def worker(key_i, log_mag):
        shared = [jax.random.uniform(jax.random.fold_in(key, k), s, minval=-1) for k, s in
                  enumerate(shapes)]  # fmt: skip
        own = [jax.random.uniform(jax.random.fold_in(key_i, k), s, minval=-1) for k, s in
               enumerate(shapes)]  # fmt: skip

        def body(errors, t):
            zs = []
            for leaf, shape in enumerate(shapes):
                k1, k2 = jax.random.split(jax.random.fold_in(jax.random.fold_in(key_i, t), leaf))
                noise = jax.random.uniform(k1, shape, minval=-1)
                keep = jax.random.uniform(k2, shape) < density
                mixed = mix[0] * shared[leaf] + mix[1] * own[leaf] + mix[2] * noise
                zs.append(jnp.where(keep, mixed, 0.0) * 10.0**log_mag)
            _, errors, _ = compressed_mean(to_flat(zs, layout), errors, AXIS, "psum")
            biggest = lambda tree: jnp.max(jnp.stack([jnp.abs(x).max() for x in tree]))
            return errors, (jnp.abs(errors.worker_error.buffer).max(), biggest(zs))

        layout = Layout.of([jnp.zeros(s) for s in shapes], n)
        errors = init_errors(layout, "psum")
        return jax.lax.scan(body, errors, jnp.arange(calls))[1]

    return jax.vmap(worker, axis_name=AXIS)(jax.random.split(key, n), log_mags)


def _worker_errors(n, spread, mix, density, seed, calls):
    """The largest worker error after each call (over workers) and the largest input."""
    rng = np.random.default_rng(seed)
    log_mags = rng.uniform(-spread / 2, spread / 2, n)
    log_mags[0], log_mags[-1] = -spread / 2, spread / 2  # the extremes are always present
    errors, inputs = _error_run(
        jax.random.key(seed), jnp.asarray(log_mags, jnp.float32), jnp.asarray(mix), density,
        n, calls,
    )  # fmt: skip
    return np.asarray(errors).max(0), np.asarray(inputs).max().item()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.just(8),
    spread=st.floats(0, 8),
    mix=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0.01, 1)),
    density=st.floats(0.05, 1),
    seed=st.integers(0, 2**16),
)
def test_errors_stay_bounded_over_thousands_of_calls(n, spread, mix, density, seed):
    """Workers up to 10^spread apart in magnitude, biased or noisy, dense or sparse: the errors
    stay within a fixed multiple of the largest input."""
    errors, biggest_input = _worker_errors(n, spread, mix, density, seed, calls=2000)
    assert np.all(np.isfinite(errors))
    # the mechanism of psum_mean's docstring: |e| settles within ~N sqrt(n) of the largest input
    # (the worst of 1,500 fresh draws reached 0.37 of it)
    assert errors.max() <= n * math.sqrt(99) * biggest_input


@pytest.mark.parametrize(
    "spread, mix, density, seed",
    [
        (8.0, (0.5, 0.5, 0.2), 1.0, 1),  # workers 10^8 apart, disagreeing biases
        (0.0, (1.0, 0.0, 0.05), 0.3, 2),  # agreeing, sparse
    ],
)
def test_errors_stop_growing(spread, mix, density, seed):
    """On fixed inputs, the errors stop growing: the last quarter of 2,000 calls stays within
    1.6x the second's (linear growth, e.g. with no scale at all, doubles). Not a property test:
    over 2,000 calls a bounded fluctuation can rise as much (13 of 1,500 fresh draws of the
    strategies above failed this bound, by up to 1.4x; e.g. spread=1, mix=(0, 1, 1),
    density=0.25, seed=65535 goes 16.5 -> 32.2, then stays in 22-40, 6.3x its largest input,
    over 40,000 calls), so the drawn inputs above check the bound only."""
    calls = 2000
    errors, biggest_input = _worker_errors(8, spread, mix, density, seed, calls)
    assert np.all(np.isfinite(errors))
    assert errors.max() <= 8 * math.sqrt(99) * biggest_input  # the bound, on these inputs too
    q = calls // 4
    assert errors[3 * q :].max() <= 1.6 * errors[q : 2 * q].max() + 1e-6 * biggest_input


@pytest.mark.parametrize("n", [8])
def test_every_worker_decodes_the_same_mean_under_every_mapping(n):
    """Integer sums of the signs and scales: every worker of one program holds the same bits,
    and one program run twice gives them again. Across mappings only the per-worker scales
    (float reductions, which XLA may associate differently for a batched operand) can differ,
    in their last bits."""
    dtypes = [np.float32, np.float32, jnp.bfloat16, np.float32, np.float32, np.float32]
    inputs = make_inputs(n, calls=2, seed=7, dtypes=dtypes)
    results = {mode: run_calls(n, inputs, mode) for mode in MODES}
    for mode, (outs, _) in results.items():
        for leaf in jax.tree.leaves(outs):
            leaf = np.asarray(leaf, np.float32)
            assert np.array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape)), mode
    base = jax.tree.leaves(results["vmap"])
    for mode in ("pmap", "shard_map"):
        for a, b in zip(base, jax.tree.leaves(results[mode]), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max(initial=1.0), err_msg=mode
            )
    again = run_calls(n, inputs, "shard_map")
    for a, b in zip(jax.tree.leaves(results["shard_map"]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_worker_and_no_axis_are_identity():
    tree = {"a": jnp.arange(5.0), "b": jnp.ones((2, 3), jnp.bfloat16)}
    tx = ozo.onebit_mean(None, collective="psum")
    out, state = tx.update(tree, tx.init(tree))
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), out, tree))
    assert all(leaf.size == 0 for leaf in jax.tree.leaves(state))
    inputs = make_inputs(1, 2)
    outs, _ = run_calls(1, inputs)
    for got, want in zip(outs[1], inputs[1]):
        np.testing.assert_array_equal(got, want)


def test_backend_names_and_states_are_checked():
    for make in (
        lambda: ozo.onebit_mean(AXIS, collective="ring"),
        lambda: ozo.zero_one_adam(0.1, axis_name=AXIS, collective="ring"),
        lambda: ozo.onebit_adam(0.1, axis_name=AXIS, collective="ring"),
    ):
        with pytest.raises(ValueError, match="collective must be one of"):
            make()
    params = jnp.zeros((4, 10))
    two_phase = jax.vmap(ozo.onebit_mean(AXIS).init, axis_name=AXIS)(params)
    step = jax.vmap(ozo.onebit_mean(AXIS, collective="psum").update, axis_name=AXIS)
    with pytest.raises(ValueError, match="another collective"):
        step(params, two_phase)


def test_compiled_program_is_one_integer_all_reduce():
    """8 devices, 1M float32 in 8 leaves: one u32 all-reduce and no other collective, of
    exactly ceil(T / 8) + 13 L words; 8x below a float pmean, 4x above the two-phase one."""
    n = 8
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    shapes = [(512, 400)] * 5 + [(1000,), (), (3, 5)]
    tree = [jax.ShapeDtypeStruct((n, *s), jnp.float32) for s in shapes]
    sizes = [math.prod(s) for s in shapes]

    def stats_of(collective):
        tx = ozo.onebit_mean(AXIS, collective=collective)
        state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), tree)

        def body(t, s):
            out = tx.update(*jax.tree.map(lambda x: x[0], (t, s)))
            return jax.tree.map(lambda x: x[None], out)

        fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        return ozo.comm_stats(
            fn, mapping.sharded_specs(mesh, tree), mapping.sharded_specs(mesh, state)
        )

    stats = stats_of("psum")
    assert stats.count() == 1 and stats.count("all-reduce") == 1, stats.table()
    (reduce,) = stats.collectives
    assert reduce.dtypes == ("u32",) and reduce.group_size == n and reduce.executions == 1
    layout = Layout.of([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], n)
    words = psum_mean.payload_words(layout)
    assert words == -(-(n * layout.width) // 8) + 13 * len(sizes)
    assert reduce.payload_bytes == 4 * words
    assert stats.sent_bytes_per_device == 2 * 4 * words * (n - 1) / n  # a ring all-reduce
    float_bytes = 2 * 4 * sum(sizes) * (n - 1) / n  # the same of float32 values
    # padding to N lcm(N, 8) per leaf counts too: within 1% here
    assert stats.sent_bytes_per_device == pytest.approx(float_bytes / 8, rel=1e-2)
    two_phase = stats_of("two_phase")
    assert 3.9 < stats.sent_bytes_per_device / two_phase.sent_bytes_per_device < 4.1


# --------------------------------------------------------------------------------------------
# Both optimizers, end to end.

N_OPT = 4
OPT_SHAPES = [(6, 5), (5,), (5, 3)]


def _optimizer_run(kind, collective, steps=80):
    """4 workers, each with its own noisy, differently scaled quadratic around shared targets."""
    rng = np.random.default_rng(0)
    targets = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in OPT_SHAPES]
    curvature = jnp.asarray(rng.uniform(0.5, 2.0, N_OPT), jnp.float32)
    noise = jnp.asarray(rng.standard_normal((steps, N_OPT, 53)), jnp.float32)
    if kind == "zero_one":
        tx = ozo.zero_one_adam(
            0.03, var_freeze_step=30, var_update_scaler=2, local_step_scaler=8,
            local_step_clipper=4, axis_name=AXIS, collective=collective,
        )  # fmt: skip
    else:
        tx = ozo.onebit_adam(0.03, freeze_step=15, axis_name=AXIS, collective=collective)

    def step(x, s, a, eps):
        offsets = np.cumsum([0] + [math.prod(sh) for sh in OPT_SHAPES])
        g = [a * (p - t) + 0.3 * eps[o:e].reshape(p.shape)
             for p, t, o, e in zip(x, targets, offsets[:-1], offsets[1:])]  # fmt: skip
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    x = [jnp.zeros((N_OPT, *s)) for s in OPT_SHAPES]
    state = mapped(tx.init, "vmap", N_OPT)(x)
    run = mapped(step, "vmap", N_OPT)
    for k in range(steps):
        x, state = run(x, state, curvature, noise[k])
    distance = math.sqrt(sum(float(jnp.sum((p[0] - t) ** 2)) for p, t in zip(x, targets)))
    start = math.sqrt(sum(float(jnp.sum(t**2)) for t in targets))
    return distance / start, x, state


@pytest.mark.parametrize("kind", ["zero_one", "onebit"])
def test_optimizers_run_end_to_end_with_psum(kind):
    psum_dist, x, state = _optimizer_run(kind, "psum")
    two_phase_dist, _, two_phase_state = _optimizer_run(kind, "two_phase")
    # the default backend's state structure without the server error (no server stage)
    no_server = jax.tree.map(
        lambda s: s._replace(server_error=optax.EmptyState()) if isinstance(s, OnebitMeanState)
        else s, two_phase_state, is_leaf=lambda s: isinstance(s, OnebitMeanState),
    )  # fmt: skip
    assert jax.tree.structure(state) == jax.tree.structure(no_server)
    comm = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, OnebitMeanState))
            if isinstance(s, OnebitMeanState)][0]  # fmt: skip
    assert isinstance(comm.worker_error, FlatTree) and comm.server_error == optax.EmptyState()
    # converges (from 100% of the distance to the targets; the gradient noise keeps it above
    # ~0.1) at least as well as the two-phase backend (measured: 0/1 Adam 0.15 vs 0.39,
    # 1-bit Adam 0.08 vs 0.13)
    assert psum_dist < 0.2 and two_phase_dist < 0.5
    assert psum_dist < 1.2 * two_phase_dist
    if kind == "onebit":  # synchronised after every step
        for leaf in x:
            assert np.array_equal(np.asarray(leaf), np.broadcast_to(leaf[0], leaf.shape))
