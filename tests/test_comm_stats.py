"""``parse_hlo`` on the HLO text of the installed jax: known programs read as they are, and a
text it cannot follow is an error, not a silent undercount."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_zero_one as ozo
from optax_zero_one.integration import comm_stats as cs

N = 4


def stats_of(fn, *args):
    mesh = ozo.worker_mesh("w", N)
    return ozo.comm_stats(ozo.on_workers(fn, mesh), *args)


def test_this_jax_is_one_the_parser_was_checked_with():
    assert ".".join(jax.__version__.split(".")[:2]) in cs.CHECKED_WITH_JAX


def test_known_collectives_and_bytes():
    x = jnp.zeros((N, 1024), jnp.float32)  # 4 KiB per worker

    def fn(v):
        total = jax.lax.psum(v, "w")
        gathered = jax.lax.all_gather(v.astype(jnp.uint8), "w")
        return total + gathered.sum(0)

    stats = stats_of(fn, x)
    by_kind = {c.kind: c for c in stats.collectives}
    assert set(by_kind) == {"all-reduce", "all-gather"}
    reduce, gather = by_kind["all-reduce"], by_kind["all-gather"]
    assert (reduce.dtypes, reduce.payload_bytes, reduce.group_size) == (("f32",), 4096, N)
    assert reduce.sent_bytes == pytest.approx(2 * 4096 * (N - 1) / N)  # ring
    assert (gather.dtypes, gather.payload_bytes) == (("u8",), 1024)
    assert gather.sent_bytes == pytest.approx(1024 * (N - 1))
    assert all(c.executions == 1 and not c.conditional for c in stats.collectives)


def test_collectives_in_loops_and_branches():
    x = jnp.ones((N, 16), jnp.float32)

    def fn(v):
        looped = jax.lax.fori_loop(0, 3, lambda i, a: a + jax.lax.psum(a, "w"), v)
        return jax.lax.cond(v[0] > 0, lambda a: a + jax.lax.pmean(a, "w"), lambda a: a, looped)

    found = sorted((c.executions, c.conditional) for c in stats_of(fn, x).collectives)
    assert found == [(1, True), (3, False)], found


def test_a_loop_of_unknown_trip_count_makes_the_totals_an_error_not_zero():
    x = jnp.ones((N, 16), jnp.float32)

    def fn(v):  # runs until the values fall: the trip count is not in the program
        body = lambda c: (c[0] + 1, c[1] * 0.1 + jax.lax.psum(c[1], "w") * 0.0)  # noqa: E731
        return jax.lax.while_loop(lambda c: c[1].sum() > 1.0, body, (0, v))[1]

    stats = stats_of(fn, x)
    assert [c.executions for c in stats.collectives] == [None]
    for total in ("sent_bytes_per_device", "launches", "payload_bytes"):
        with pytest.raises(ValueError, match="trip count"):
            getattr(stats, total)
    assert "not known" in stats.table()


def test_low_precision_element_types_are_counted_and_an_unknown_one_is_an_error():
    # XLA:CPU widens float8 before a collective; XLA:GPU and TPU keep it, as in this text
    text = (
        "HloModule m, num_partitions=8\n\n"
        "ENTRY %main (x: f8e4m3fn[1024]) -> f8e4m3fn[8192] {\n"
        "  %x = f8e4m3fn[1024]{0} parameter(0)\n"
        "  ROOT %ag = f8e4m3fn[8192]{0} all-gather(%x), channel_id=1, "
        "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true\n}\n"
    )
    (gather,) = cs.parse_hlo(text).collectives
    assert gather.payload_bytes == 1024 and gather.sent_bytes == pytest.approx(1024 * 7)
    sizes = {t: cs.array_bytes(f"{t}[64]") for t in ("f8e5m2", "f4e2m1fn", "s2", "s4", "bf16")}
    assert sizes == {"f8e5m2": 64, "f4e2m1fn": 32, "s2": 16, "s4": 32, "bf16": 128}
    with pytest.raises(ValueError, match="no known width"):
        cs.array_bytes("f3e1m1[64]")


def test_keyword_arguments_that_are_not_arrays_are_bound_as_constants():
    x = jnp.ones((N, 8), jnp.float32)
    mesh = ozo.worker_mesh("w", N)

    def fn(v, scale, mode="sum"):
        collective = jax.lax.psum if mode == "sum" else jax.lax.all_gather
        return ozo.on_workers(lambda a: collective(a * scale, "w").sum(0), mesh)(v)

    # a string keyword used to be traced ("not a valid JAX type"); an array one still is
    stats = ozo.comm_stats(fn, x, scale=jnp.float32(2.0), mode="gather")
    assert [c.kind for c in stats.collectives] == ["all-gather"]
    assert ozo.comm_stats(fn, x, scale=2.0).collectives[0].kind == "all-reduce"


def test_a_text_it_cannot_follow_is_an_error():
    x = jnp.zeros((N, 8), jnp.float32)
    mesh = ozo.worker_mesh("w", N)
    text = jax.jit(ozo.on_workers(lambda v: jax.lax.psum(v, "w"), mesh)).lower(x).compile()
    text = text.as_text()
    assert len(cs.parse_hlo(text).collectives) == 1
    # a format the parser does not know: instruction names no longer end in " = "
    mangled = "\n".join(
        line.replace(" = ", " := ") if "all-reduce" in line else line for line in text.splitlines()
    )
    with pytest.raises(RuntimeError, match="HLO text format seems to have changed"):
        cs.parse_hlo(mangled)
    np.testing.assert_equal(len(cs.parse_hlo("").collectives), 0)


@pytest.mark.parametrize(
    "attrs,groups",
    [
        # a group of 2 over the second dimension: 4 groups, consecutive devices
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={1}",
            [(0, 1), (2, 3), (4, 5), (6, 7)],
        ),
        # over the first: strided
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}",
            [(0, 2, 4, 6), (1, 3, 5, 7)],
        ),
        # a size-1 dimension, and both dimensions: one group of all 8
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_1'}",
            [(0, 1), (2, 3), (4, 5), (6, 7)],
        ),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", [tuple(range(8))]),
    ],
)
def test_the_mesh_form_of_replica_groups(attrs, groups):
    """XLA writes some groups over a mesh's named dimensions; read as 'every device' they made a
    local step on a (data, model) mesh seem to send over the data axis (a new-user trial)."""
    assert cs._groups(attrs) == tuple(groups)
    assert cs._group_size(attrs, default=8) == len(groups[0])


def test_a_permute_is_put_on_the_axes_its_pairs_cross():
    """A collective-permute names no replica groups: it was put on every mesh axis, so a permute
    within 'model' counted as traffic across 'node' in sent_bytes_by_axes (a trial; XLA emits
    such permutes in a dp.jit step on a (node, local, model) mesh)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("node", "model"), axis_types=auto)
    spec = jax.sharding.PartitionSpec("node", "model")

    def shift(axis, perm):
        return jax.shard_map(
            lambda x: jax.lax.ppermute(x, axis, perm=perm), mesh=mesh, in_specs=spec, out_specs=spec
        )

    x = jax.ShapeDtypeStruct((4, 2 * 256), jnp.float32)
    within = ozo.comm_stats(shift("model", [(0, 1), (1, 0)]), x)
    assert within.collectives[0].mesh_axes(mesh) == ("model",)
    assert within.sent_bytes_by_axes(mesh) == {("model",): 1024.0}
    across = ozo.comm_stats(shift("node", [(i, (i + 1) % 4) for i in range(4)]), x)
    assert across.collectives[0].mesh_axes(mesh) == ("node",)


def test_a_step_dispatched_by_kind_is_refused_with_the_fix():
    tx = ozo.zero_one_adam(1e-2, axis_name="w", var_freeze_step=4)
    step = ozo.dispatch_by_kind(lambda kind: None, ozo.zero_one_schedule(var_freeze_step=4))
    with pytest.raises(ValueError, match=r"one per kind .*functools.partial\(step, step_kind=kind"):
        ozo.comm_stats(step, jnp.zeros((N, 3)), tx)
