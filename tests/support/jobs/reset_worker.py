"""``ozo.reset_compression`` in a multi-process job: a 4-worker state moved to this job's workers.

Run through the launcher from ``tests/`` (``tests/test_multiprocess.py`` does)::

    python -m optax_zero_one.integration.launch --processes 2 --devices-per-process 1 -- \\
        support.jobs.reset_worker

The saved run's params and state (4 workers, after a few steps with different gradients per
worker, so that their momenta and error buffers differ) are placed over every device of the
job (two rows per device: arrays no process can read alone), and ``fresh_state`` is this job's
``init`` in the worker layout. Each process checks that the rows it holds of the result equal
the same reset done on host copies in one process, and prints ``reset ok``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

AXIS = "w"
SAVED_WORKERS = 4
SCHEDULE = dict(var_freeze_step=3, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2)


def saved_run() -> tuple[dict, object]:
    """Params and state of 4 simulated workers after 6 steps (host copies, one process)."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": np.zeros(3, np.float32)}
    tx = ozo.zero_one_adam(1e-2, axis_name=AXIS, **SCHEDULE)
    p = ozo.replicate(params, SAVED_WORKERS)
    s = jax.vmap(tx.init, axis_name=AXIS)(p)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(jax.vmap(step, axis_name=AXIS))
    for k in range(6):
        g = jax.tree.map(lambda x, k=k: rng.standard_normal(x.shape).astype(np.float32), p)
        p, s = run(p, s, g)
    return jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, s)


def main() -> int:
    job = ozo.initialize_from_env()
    mesh = ozo.worker_mesh(AXIS)
    n = mesh.devices.size
    params, state = saved_run()
    tx = ozo.zero_one_adam(1e-2, axis_name=AXIS, **SCHEDULE)
    start = ozo.replicate(jax.tree.map(lambda x: x[0], params), n)
    # host copies, one process: the reference
    host_fresh = jax.tree.map(np.asarray, jax.vmap(tx.init, axis_name=AXIS)(start))
    want = ozo.reset_compression(params, state, host_fresh)
    # the same over the job's devices: every array spans both processes
    rows = NamedSharding(mesh, P(AXIS))
    spread = lambda x: jax.make_array_from_callback(x.shape, rows, lambda i: x[i])  # noqa: E731
    fresh = jax.jit(ozo.on_workers(tx.init, mesh))(ozo.to_workers(start, mesh))
    got = ozo.reset_compression(jax.tree.map(spread, params), jax.tree.map(spread, state), fresh)
    mine, got_rows = ozo.local_rows(got)
    want_rows = [np.asarray(x)[mine] for x in jax.tree.leaves(want)]
    for g, w in zip(got_rows, want_rows, strict=True):
        np.testing.assert_array_equal(g, w)
    print(f"reset ok: process {job.process_id}, workers {list(mine)} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
