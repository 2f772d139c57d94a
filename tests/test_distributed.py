"""The worker-layout helpers for several processes, in one process (8 simulated devices): the
mesh, both forms of ``to_workers``, ``local_rows``, ``on_workers`` and ``unreplicate``. Across
processes they are exercised by ``tests/test_multiprocess.py`` and ``tests/test_launch.py``."""

import jax
import numpy as np
import pytest

import optax_zero_one as ozo

AXIS = "w"


def test_worker_mesh_orders_devices_and_takes_the_first():
    mesh = ozo.worker_mesh(AXIS, 4)
    assert mesh.axis_names == (AXIS,) and mesh.devices.shape == (4,)
    assert list(mesh.devices.flat) == jax.devices()[:4]
    assert ozo.worker_mesh(AXIS).devices.size == jax.device_count()
    with pytest.raises(ValueError, match="workers but only"):
        ozo.worker_mesh(AXIS, jax.device_count() + 1)


def test_to_workers_from_a_stacked_tree_or_a_function_of_the_worker():
    mesh = ozo.worker_mesh(AXIS, 4)
    stacked = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(4)}
    per_worker = ozo.to_workers(lambda i: {"a": stacked["a"][i], "b": stacked["b"][i]}, mesh)
    for tree in (ozo.to_workers(stacked, mesh), per_worker):
        assert tree["a"].sharding.spec == jax.sharding.PartitionSpec(AXIS)
        workers, leaves = ozo.local_rows(tree)
        assert workers.tolist() == [0, 1, 2, 3]
        np.testing.assert_array_equal(leaves[0], stacked["a"])
        np.testing.assert_array_equal(leaves[1], stacked["b"])


def test_on_workers_binds_the_axis_and_unreplicate_reads_one_worker():
    # (a worker of another process: ValueError, in tests/test_multiprocess.py)
    mesh = ozo.worker_mesh(AXIS, 4)
    x = ozo.to_workers(lambda i: np.full(2, i, np.float32), mesh)
    total = jax.jit(
        ozo.on_workers(lambda v: (jax.lax.psum(v, AXIS), jax.lax.axis_index(AXIS)), mesh)
    )
    sums, index = jax.block_until_ready(total(x))
    np.testing.assert_array_equal(np.asarray(sums), np.full((4, 2), 6.0))
    assert np.asarray(index).tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(ozo.unreplicate(x), [0.0, 0.0])
    np.testing.assert_array_equal(ozo.unreplicate(x, worker=3), [3.0, 3.0])
    np.testing.assert_array_equal(ozo.unreplicate(x, worker=-1), [3.0, 3.0])


@pytest.mark.parametrize("batched", [False, True])
def test_on_workers_refuses_more_than_one_row_per_worker(batched):
    """A global batch (or params for twice the workers) gives each device a block of several
    rows; taking the block's first row would train on a fraction of the data, silently."""
    mesh = ozo.worker_mesh(AXIS, 4)
    step = jax.jit(ozo.on_workers(lambda p, x: (p, x.sum()), mesh, batched=batched))
    params = ozo.to_workers({"w": np.zeros((4, 3), np.float32)}, mesh)
    step(params, np.ones((4, 8, 3), np.float32))  # the worker layout: one row per worker
    with pytest.raises(ValueError, match=r"positional argument 1 has a leading axis of 32, .* "
                       r"one entry per worker \(4\).*x.reshape\(4, -1"):  # fmt: skip
        step(params, np.ones((32, 3), np.float32))
    with pytest.raises(ValueError, match=r"positional argument 0, leaf \['w'\], has a leading"):
        step({"w": np.zeros((8, 3), np.float32)}, np.ones((4, 8, 3), np.float32))


def test_initialize_from_env_without_the_launcher_is_one_process(monkeypatch):
    monkeypatch.delenv("OZO_COORDINATOR", raising=False)
    job = ozo.initialize_from_env()
    assert job == ozo.integration.distributed.DistributedJob(0, 1, jax.local_device_count())
