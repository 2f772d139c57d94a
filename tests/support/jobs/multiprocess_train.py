"""Train a small MLP with 0/1 Adam through every phase, on any process layout; save every step.

Run it on 2 processes x 2 devices through the launcher, or alone on one process with 4
simulated devices (JAX's in-process collectives, no ``jax.distributed``), and compare the saved
trajectories (``tests/test_multiprocess.py`` does both, from ``tests/``)::

    cd tests
    python -m optax_zero_one.integration.launch --processes 2 --devices-per-process 2 -- \\
        support.jobs.multiprocess_train --out /tmp/mp_2x2
    python -m support.jobs.multiprocess_train --out /tmp/mp_1x4

The worker axis spans every device of every process (one worker per device); params and
optimizer state use the worker layout (leading axis sharded ``P("w")``); each worker passes its
local gradient. The schedule (``var_freeze_step=12, var_update_scaler=2, local_step_scaler=4,
local_step_clipper=4``) gives variance, compressed, local and sync steps within 40 steps. Each
step runs the program compiled for its kind (``optax_zero_one.dispatch_by_kind``, the kind
chosen on the host from the schedule); the kind saved for each worker is read back from that
worker's own state (the kind of the step its counter says it took), and the run stops if a
worker did not take a step.

Two modes, each saved as ``{mode}_p{process}.npz`` (this process's workers only, read with
``optax_zero_one.local_rows``; also ``optax_zero_one.unreplicate`` of the final params and
state, and the error it gives for a worker of another process):

- ``exact``: gradients are rounded to multiples of 2**-12 (and clipped to +-64), so that the
  float all-reduce of a variance step is exact in any summation order: the whole run must then
  be bitwise identical on every layout (the byte collectives move bits, the rest is the same
  per-device program);
- ``raw``: plain gradients; the multi-process float all-reduce sums in another order than the
  in-process one, so runs agree to float rounding.
"""

from __future__ import annotations

import os

# Run alone: 4 simulated devices, 2 threads each (before JAX starts; the launcher sets both).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("PJRT_NPROC", str(2 * int(os.environ["JAX_NUM_CPU_DEVICES"])))

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

AXIS = "w"
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
SIZES = (16, 32, 8)
BATCH = 8
GRID = 2.0**-12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the .npz files")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", default="exact,raw")
    opts = parser.parse_args(argv)
    job = ozo.initialize_from_env()
    mesh = ozo.worker_mesh(AXIS)
    n = mesh.devices.size
    rng = np.random.default_rng(0)
    params0 = {
        f"layer{i}": {
            "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros((b,), np.float32),
        }
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))
    }
    teacher = rng.standard_normal((SIZES[0], SIZES[-1])).astype(np.float32)

    def batch(step: int, worker: int, exact: bool) -> dict:
        r = np.random.default_rng([step, worker])
        x = r.standard_normal((BATCH, SIZES[0])).astype(np.float32)
        y = np.tanh(x @ teacher) + 0.1 * r.standard_normal((BATCH, SIZES[-1]))
        return {"x": x, "y": y.astype(np.float32), "exact": np.asarray(exact)}

    def loss(params: dict, data: dict) -> jax.Array:
        h = data["x"]
        for i in range(len(SIZES) - 1):
            layer = params[f"layer{i}"]
            h = h @ layer["w"] + layer["b"]
            h = jnp.tanh(h) if i < len(SIZES) - 2 else h
        return jnp.mean(jnp.square(h - data["y"]))

    tx = ozo.zero_one_adam(
        optax.exponential_decay(0.02, 10, 0.8), weight_decay=1e-2, axis_name=AXIS, **SCHEDULE
    )
    schedule = ozo.zero_one_schedule(**SCHEDULE)
    kind_of_step = schedule.indices(opts.steps)  # index into ozo.STEP_KINDS of steps 1..steps

    def spmd(fn):
        return jax.jit(ozo.on_workers(fn, mesh))

    def one_step(params, state, data, step_kind=None):
        grads = jax.grad(loss)(params, data)
        # exact mode: a grid coarse enough that any summation order gives the same float sum
        on_grid = jax.tree.map(lambda g: jnp.round(jnp.clip(g, -64, 64) / GRID) * GRID, grads)
        grads = jax.tree.map(lambda a, b: jnp.where(data["exact"], a, b), on_grid, grads)
        updates, state = tx.update(grads, state, params, step_kind=step_kind)
        return optax.apply_updates(params, updates), state

    # one compilation each (per step kind for the step), for both modes
    init = spmd(tx.init)
    step = ozo.dispatch_by_kind(
        lambda kind: spmd(functools.partial(one_step, step_kind=kind)), schedule
    )
    os.makedirs(opts.out, exist_ok=True)
    for mode in opts.modes.split(","):
        if mode not in ("exact", "raw"):
            parser.error(f"unknown mode {mode!r}")
        params = ozo.to_workers(lambda i: params0, mesh)
        state = init(params)
        saved: dict[str, np.ndarray] = {}
        kinds = []
        for k in range(1, opts.steps + 1):
            data = ozo.to_workers(lambda i, k=k, e=mode == "exact": batch(k, i, e), mesh)
            params, state = step(params, state, data)
            jax.block_until_ready((params, state))  # pace the simulated devices (deadlock)
            workers, leaves = ozo.local_rows((params, state))
            for j, leaf in enumerate(leaves):
                saved[f"step{k:03d}_leaf{j:03d}"] = leaf
            # each worker's update count, from its own state: it took step k, of this kind
            counts = ozo.local_rows(state.inner_state.count)[1][0]
            if not (counts == k).all():
                raise RuntimeError(f"step {k}: workers {workers} hold counts {counts}")
            kinds.append(kind_of_step[counts - 1])
        names = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path((params, state))
        ]
        # unreplicate on arrays that span other processes: this process's first worker, and a
        # clear error for a worker it does not hold
        for j, leaf in enumerate(jax.tree.leaves(ozo.unreplicate((params, state)))):
            saved[f"unreplicated_leaf{j:03d}"] = leaf
        refusal = ""
        other = next((i for i in range(n) if i not in workers), None)
        if other is not None:
            try:
                ozo.unreplicate(params, worker=other)
            except ValueError as err:
                refusal = str(err)
        path = os.path.join(opts.out, f"{mode}_p{job.process_id}.npz")
        np.savez(
            path,
            workers=workers,
            unreplicated_worker=workers[0],
            unreplicate_refusal=np.asarray(refusal),
            kinds=np.stack(kinds, axis=1),  # (local workers, steps)
            names=np.asarray(names),
            **saved,
        )
        first = np.stack(kinds, axis=1)[0]
        counts = {name: int(np.sum(first == i)) for i, name in enumerate(ozo.STEP_KINDS)}
        print(
            f"{mode}: {opts.steps} steps on {job.num_processes} x {job.local_devices} devices "
            f"({n} workers) -> {path}; step kinds {json.dumps(counts)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
