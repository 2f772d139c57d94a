"""What each step kind sends, read from the compiled program on 8 simulated devices.

A step's kind is passed to ``update`` as a static hint (``step_kind=``), so the program traces
that kind alone and holds exactly what it executes, with no loop and no conditional. Without the
hint the program holds every kind behind conditionals decided from the counters.
"""

import re

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


ZERO_ONE_SCHEDULE = ozo.StepSchedule(VARIANCE, LOCAL)


def kind_at(tx, k):
    """The static kind of step ``k`` for ``tx`` (0/1 Adam or 1-bit Adam)."""
    if tx is ZERO_ONE:
        return ZERO_ONE_SCHEDULE.kind(k)
    return ozo.onebit_schedule(ONEBIT_FREEZE).kind(k)


def stats_at(tx, kind):
    mesh = jax.make_mesh((N,), (AXIS,))
    sharded = NamedSharding(mesh, P(AXIS))
    params = [jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=sharded) for s in SHAPES]
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), params)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded), state)

    def step(p, g, s):
        return tx.update(g, s, p, step_kind=kind)

    return ozo.comm_stats(on_workers(step, mesh), params, params, state)


def on_workers(step, mesh):
    """``step`` on one worker's trees, under ``shard_map`` over the worker axis of ``mesh``
    (every argument and result with a leading worker axis of one per device)."""

    def body(*args):
        out = step(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


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


def test_the_schedule_gives_the_intended_kinds():
    names = {k: ZERO_ONE_SCHEDULE.kind(k).name for k in (1, 3, 11, 13)}
    assert names == {1: "variance", 3: "compressed", 11: "sync", 13: "local"}
    assert [ozo.STEP_KINDS[i] for i in ozo.step_kinds(VARIANCE, LOCAL, 13)] == [
        "variance", "variance", "compressed", "variance", "compressed", "variance",
        "compressed", "variance", "compressed", "compressed", "sync", "sync", "local",
    ]  # fmt: skip
    assert ZERO_ONE_SCHEDULE.indices(13).tolist() == ozo.step_kinds(VARIANCE, LOCAL, 13).tolist()
    onebit = ozo.onebit_schedule(ONEBIT_FREEZE)
    assert onebit.indices(12).tolist() == [0] * ONEBIT_FREEZE + [1] * (12 - ONEBIT_FREEZE)


def assert_float_allreduce(stats):
    assert stats.count() == 1 and stats.count("all-reduce") == 1, stats.table()
    (c,) = stats.collectives
    # the flat buffer: every element, plus each leaf's padding to a multiple of 8 N
    layout = ozo.core.flat.Layout.of([jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES], N)
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
    stats = stats_at(ZERO_ONE, kind_at(ZERO_ONE, k))
    assert kind_at(ZERO_ONE, k).name == kind
    if kind == "variance":
        assert_float_allreduce(stats)
    elif kind == "local":
        assert stats.count() == 0, stats.table()
        assert stats.sent_bytes_per_device == 0
    else:
        assert_one_bit(stats)


@pytest.mark.parametrize("k,kind", [(1, "warmup"), (11, "compressed")])
def test_onebit_adam_traffic_per_step_kind(k, kind):
    stats = stats_at(ONEBIT, kind_at(ONEBIT, k))
    assert kind_at(ONEBIT, k).name == kind
    if kind == "warmup":
        assert_float_allreduce(stats)
    else:
        assert_one_bit(stats)


def test_unhinted_program_keeps_collectives_behind_conditionals():
    """Without the hint all kinds are in the program, every collective inside a conditional."""
    stats = stats_at(ZERO_ONE, None)
    assert stats.count("all-reduce") == 1
    assert stats.count("all-to-all") == 2 and stats.count("all-gather") == 2
    assert all(c.conditional for c in stats.collectives), stats.table()


@pytest.mark.parametrize("tx", [ZERO_ONE, ONEBIT], ids=["zero_one_adam", "onebit_adam"])
def test_hinted_programs_hold_no_loop_and_no_conditional(tx):
    kinds = ZERO_ONE_SCHEDULE.kinds if tx is ZERO_ONE else ozo.onebit_schedule(1).kinds
    for kind in kinds:
        text = hlo_of(tx, kind)
        assert " while(" not in text and "conditional(" not in text, kind
    assert "conditional(" in hlo_of(tx, None)  # the test can tell


def hlo_of(tx, kind):
    params = [jnp.zeros((N, *s)) for s in SHAPES]
    state = jax.vmap(tx.init, axis_name=AXIS)(params)

    def step(p, g, s):
        return tx.update(g, s, p, step_kind=kind)

    program = jax.jit(jax.vmap(step, axis_name=AXIS))
    return program.lower(params, params, state).compile().as_text()


def _distinct_cut_kernels(text):
    """The fused computations of an optimised HLO text that cut a leaf out of a flat buffer
    (``dynamic-slice``): how many there are, and how many differ once names are dropped."""
    bodies = re.findall(r"^%fused\S* \(.*?\n(.*?)\n\}", text, re.M | re.S)
    cuts = [b for b in bodies if "dynamic-slice(" in b]
    plain = {re.sub(r"%?[\w.-]+\.\d+|metadata=\{[^}]*\}", "_", b) for b in cuts}
    return len(cuts), len(plain)


def _compiled_hinted_step(kind_name, copies, mapping="vmap"):
    """The optimised HLO text of 0/1 Adam's hinted ``kind_name`` step on ``N`` workers, for
    ``copies`` pairs of leaves of shapes ``(16, 8)`` and ``(8,)``."""
    tx = ozo.zero_one_adam(1e-3, var_freeze_step=2, axis_name=AXIS)
    kinds = ozo.StepSchedule(
        ozo.VarianceDoubling(freeze_step=2), ozo.LocalStepDoubling(scaler=1, clipper=4)
    ).kinds
    kind = next(k for k in kinds if k.name == kind_name)
    params = [jnp.zeros((N, *s)) for s in [(16, 8), (8,)] * copies]
    state = jax.vmap(tx.init, axis_name=AXIS)(params)

    def step(p, g, s):
        return tx.update(g, s, p, step_kind=kind)

    if mapping == "vmap":
        program = jax.jit(jax.vmap(step, axis_name=AXIS))
    else:
        mesh = jax.make_mesh((N,), (AXIS,))
        program = jax.jit(on_workers(step, mesh))
        params, state = jax.device_put((params, state), NamedSharding(mesh, P(AXIS)))
    return program.lower(params, params, state).compile().as_text()


@pytest.mark.parametrize("mapping", ["vmap", "shard_map"])
def test_cuts_of_leaves_of_one_shape_are_one_kernel(mapping):
    """``flatten`` hands each leaf's offset to its cut as a value of its own, so the cuts of
    leaves of one shape are one kernel (compiled once): compile time follows the number of
    leaf shapes, not of leaves. (Under shard_map XLA fuses one cut apart from the rest since
    the local direction is 0 where v is 0: 3 kernels for 2 shapes, at 6 leaves as at 12.)"""
    cuts, distinct = _distinct_cut_kernels(_compiled_hinted_step("local", 6, mapping))
    assert cuts >= 12  # the test sees the cuts of all 12 leaves
    assert distinct <= 3, (cuts, distinct)
    fewer = _distinct_cut_kernels(_compiled_hinted_step("local", 3, mapping))
    assert fewer == (6, distinct), (fewer, distinct)  # the same kernels for half the leaves


def _counter_ops(text):
    """How many instructions of an optimised HLO text come from the counters' integer
    remainders (the arithmetic behind a hint check and the policies)."""
    return len(re.findall(r"op_name=\"[^\"]*remainder", text))


@pytest.mark.parametrize("kind_name", ["compressed", "local", "sync"])
def test_counter_checks_are_computed_once_not_per_leaf(kind_name):
    """The scalar checks that gate a hinted step (its kind against the counters, finiteness,
    a skip) are computed once and read by every leaf's kernel (``_graph.computed_once``):
    XLA would otherwise copy the counters' arithmetic into each leaf's fused write, and the
    program would grow with the leaves. Same shapes, 2 and 12 leaves: as many counter ops."""

    def counter_ops(copies):
        return _counter_ops(_compiled_hinted_step(kind_name, copies))

    few, many = counter_ops(1), counter_ops(6)
    assert few > 0  # the test sees them
    assert many == few, (few, many)
