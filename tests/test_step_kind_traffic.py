"""What each step kind sends, read from the compiled program on 8 simulated devices.

To compile one step kind on its own, the state's counters are replaced by Python ints pinned to a
step of that kind: the step kind is then known at trace time and only its branch is traced, so
the program holds exactly what that kind executes. (XLA keeps a loop or ``conditional`` with
collectives even when its trip count or index is a constant, so pinning to int32 constants would
not do.) With live counters the program holds every kind, each communicating kind in its own loop
of zero or one trip, and a kind that is not taken runs no instruction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mapping import AXIS

import optax_zero_one as ozo

N = 8
SHAPES = [(64, 32), (32,), (32, 10), (10,)]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
VARIANCE = ozo.VarianceDoubling(freeze_step=10, update_scaler=2)  # variance: 1, 2, 4, 6, 8
LOCAL = ozo.LocalStepDoubling(scaler=1, clipper=4)  # syncs 11, 12, 16, 20, ...


def pin(state, k):
    """The state with its counters replaced by Python ints: the update traces one kind only."""
    if any(isinstance(s, ozo.LocalStepSyncState) for s in _nodes(state)):
        return ozo.pin_step(state, k, VARIANCE, LOCAL)
    return ozo.pin_step(state, k, ozo.FullPrecisionWarmup(ONEBIT_FREEZE))


def _nodes(state):
    return jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, ozo.LocalStepSyncState))


def stats_at(tx, k, inner):
    mesh = jax.make_mesh((N,), (AXIS,))
    sharded = NamedSharding(mesh, P(AXIS))
    params = [jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=sharded) for s in SHAPES]
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), params)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded), state)

    def body(p, g, s):
        p, g, s = jax.tree.map(lambda x: x[0], (p, g, s))
        s = inner(s, lambda t: pin(t, k))
        out = tx.update(g, s, p)
        return jax.tree.map(lambda x: x[None], out)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return ozo.comm_stats(fn, params, params, state)


def zero_one_state(s, f):
    return f(s)


def onebit_state(s, f):
    return f(s)


ZERO_ONE = ozo.zero_one_adam(
    1e-3,
    var_freeze_step=VARIANCE.freeze_step,
    var_update_scaler=VARIANCE.update_scaler,
    local_step_scaler=LOCAL.scaler,
    local_step_clipper=LOCAL.clipper,
    axis_name=AXIS,
)
ONEBIT_FREEZE = 10
ONEBIT = ozo.onebit_adam(1e-3, freeze_step=ONEBIT_FREEZE, axis_name=AXIS)


def test_the_pinned_steps_have_the_intended_kinds():
    kinds = {}
    for k in (1, 3, 11, 13):
        state = jax.vmap(ZERO_ONE.init, axis_name=AXIS)([jnp.zeros((N, *s)) for s in SHAPES])
        state = jax.tree.map(lambda x: x[0], state)
        pinned = pin(state, k)
        live = jax.tree.map(jnp.asarray, pinned)
        kind = ozo.step_kind(pinned, VARIANCE, LOCAL)
        assert isinstance(kind, int) and kind == int(ozo.step_kind(live, VARIANCE, LOCAL))
        kinds[k] = ozo.STEP_KINDS[kind]
    assert kinds == {1: "variance", 3: "compressed", 11: "sync", 13: "local"}
    assert [ozo.STEP_KINDS[i] for i in ozo.step_kinds(VARIANCE, LOCAL, 13)] == [
        "variance", "variance", "compressed", "variance", "compressed", "variance",
        "compressed", "variance", "compressed", "compressed", "sync", "sync", "local",
    ]  # fmt: skip


def assert_float_allreduce(stats):
    assert stats.count() == 1 and stats.count("all-reduce") == 1, stats.table()
    (c,) = stats.collectives
    # the flat buffer: every element, plus each leaf's padding to a multiple of N lcm(N, 8)
    layout = ozo.Layout.of([jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES], N)
    assert c.dtypes == ("f32",) and c.payload_bytes == 4 * N * layout.width and not c.conditional
    assert 4 * NUMEL <= c.payload_bytes <= 1.05 * 4 * NUMEL


def assert_one_bit(stats):
    assert stats.count() == 2, stats.table()
    assert stats.count("all-to-all") == 1 and stats.count("all-gather") == 1
    for c in stats.collectives:
        assert c.dtypes == ("u8",) and c.group_size == N and not c.conditional
    # ~1/8 byte per element per phase, plus padding and 4 bytes of scale per leaf
    limit = 2 * (N - 1) / N * NUMEL / 8
    assert limit <= stats.sent_bytes_per_device <= 1.25 * limit + 2 * (N - 1) * 4 * len(SHAPES)


@pytest.mark.parametrize(
    "k,kind", [(1, "variance"), (3, "compressed"), (11, "sync"), (13, "local")]
)
def test_zero_one_adam_traffic_per_step_kind(k, kind):
    stats = stats_at(ZERO_ONE, k, zero_one_state)
    if kind == "variance":
        assert_float_allreduce(stats)
    elif kind == "local":
        assert stats.count() == 0, stats.table()
        assert stats.sent_bytes_per_device == 0
    else:
        assert_one_bit(stats)


@pytest.mark.parametrize("k,kind", [(1, "warmup"), (11, "compressed")])
def test_onebit_adam_traffic_per_step_kind(k, kind):
    stats = stats_at(ONEBIT, k, onebit_state)
    if kind == "warmup":
        assert_float_allreduce(stats)
    else:
        assert_one_bit(stats)


def test_unpinned_program_keeps_collectives_behind_guards():
    """With live counters all kinds are in the program, each inside its own loop of zero or one
    trip (a trip count unknown at compile time), none unconditionally."""
    stats = stats_at(ZERO_ONE, 1, lambda s, f: s)
    assert stats.count("all-reduce") == 1
    assert stats.count("all-to-all") == 2 and stats.count("all-gather") == 2
    assert all(c.executions is None and not c.conditional for c in stats.collectives)
