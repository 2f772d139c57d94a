"""Each process of a 2-process job trains a 0/1 Adam run of its own, on a mesh of its own
devices, with its own schedule (a sweep; no collective spans the processes); process 1 may
also sit out (``--alone``). Run through the launcher from ``tests/``
(``tests/test_multiprocess.py``): every process that trains prints ``trained``."""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np
import optax

import optax_zero_one as ozo


def main() -> None:
    job = ozo.initialize_from_env()
    alone = "--alone" in sys.argv[1:]
    if alone and job.process_id == 1:
        print("process 1 sits out", flush=True)
        return
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("w",), devices=jax.local_devices(), axis_types=auto)
    freeze = 2 + 2 * job.process_id  # a schedule of its own
    schedule = ozo.zero_one_schedule(var_freeze_step=freeze, local_step_scaler=2)
    tx = ozo.zero_one_adam(1e-2, axis_name="w", var_freeze_step=freeze, local_step_scaler=2)

    def step(p, s, g, step_kind=None):
        u, s = tx.update(g, s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s

    def compile_kind(kind):
        return jax.jit(ozo.on_workers(functools.partial(step, step_kind=kind), mesh))

    p = ozo.to_workers(ozo.replicate({"w": np.zeros(8, np.float32)}, 2), mesh)
    s = jax.jit(ozo.on_workers(tx.init, mesh))(p)
    g = ozo.to_workers(lambda i: {"w": np.full(8, i + 1.0, np.float32)}, mesh)
    train = ozo.dispatch_by_kind(compile_kind, schedule)
    for _ in range(24):  # past the first local steps, where the workers are compared
        p, s = train(p, s, g)
    train.settle()
    print(f"process {job.process_id} trained", flush=True)


if __name__ == "__main__":
    main()
