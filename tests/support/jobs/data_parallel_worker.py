"""``ozo.data_parallel`` on a ("data"=4, "model"=2) mesh, in one process or across several.

Driven by ``tests/test_data_parallel.py``, from ``tests/``::

    python -m optax_zero_one.integration.launch --processes 2 --devices-per-process 4 -- \\
        support.jobs.data_parallel_worker --out DIR

Every process places the params (``jax.make_array_from_callback``, as a multi-host user does),
converts them to the worker layout, trains 14 steps through every step kind and writes
``DIR/p<rank>.npz``: each step's mean loss over the data workers, and the evaluation params
(``dp.synchronized_params``) gathered to every process. :func:`train` is also what the test
runs in its own process, on 8 devices, as the reference.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX initialises its backend (docs/testing.md)
    os.environ.setdefault("PJRT_NPROC", "16")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import pathlib  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
STEPS = 14


def host_params(seed: int = 0, width: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (0.3 * rng.standard_normal((16, width))).astype(np.float32),
        "w2": (0.3 * rng.standard_normal((width, 4))).astype(np.float32),
        "b": np.zeros((4,), np.float32),
    }


def make_tx(
    freeze: int = 6, onebit: bool = False, num_workers: int | None = None
) -> optax.GradientTransformationExtraArgs:
    """0/1 Adam whose 14 steps take the kinds 0 0 1 0 1 0 3 3 3 3 2 3 2 3 (every kind);
    ``onebit``: 1-bit Adam, compressed from step ``freeze`` on; ``num_workers``: built for that
    many data workers (to init outside the mesh)."""
    if onebit:
        return ozo.onebit_adam(1e-2, axis_name="data", freeze_step=freeze, num_workers=num_workers)
    return ozo.zero_one_adam(
        1e-2,
        axis_name="data",
        num_workers=num_workers,
        var_freeze_step=freeze,
        var_update_scaler=2,
        local_step_scaler=4,
        local_step_clipper=2,
    )


# make_tx()'s step kinds
SCHEDULE = ozo.zero_one_schedule(
    var_freeze_step=6, var_update_scaler=2, local_step_scaler=4, local_step_clipper=2
)


def loss_fn(p: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] + p["b"] - jnp.sin(x[:, :4])) ** 2)


def batches(steps: int = STEPS, rows: int = 32) -> list[np.ndarray]:
    """The global batches, the same in every process."""
    rng = np.random.default_rng(1)
    return [rng.standard_normal((rows, 16)).astype(np.float32) for _ in range(steps)]


def job_mesh(model: int = 2, kind: str = "Auto") -> jax.sharding.Mesh:
    """``("data"=4, "model")`` over the job's devices, in process order; axes of ``kind``."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[: 4 * model]
    types = (getattr(jax.sharding.AxisType, kind),) * 2
    return jax.make_mesh((4, model), ("data", "model"), axis_types=types, devices=devices)


def setup(
    mesh: jax.sharding.Mesh, seed: int = 0, width: int = 32, loss: Any = loss_fn, **tx: object
) -> tuple:
    """``(dp, tx, step, params)``: the params placed as a multi-host jit user places them
    (sharded as ``SPECS`` says over the mesh's axes), the helper, its optimizer (``tx``:
    :func:`make_tx`'s arguments) and the step. ``seed``, ``width``: of the host params (a
    process given its own seed builds params apart); ``loss``: the model's loss."""

    def spec(name: str) -> P:
        return SPECS[name] if "model" in mesh.axis_names else P()

    params = {
        k: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec(k)), lambda i, x=x: x[i])
        for k, x in host_params(seed, width).items()
    }
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(make_tx(**tx))

    def step(p: dict, s: object, x: jax.Array, step_kind: object = None) -> tuple:
        value, g = jax.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s, value

    return dp, tx, step, params


def train(
    mesh: jax.sharding.Mesh,
    steps: int = STEPS,
    seed: int = 0,
    schedule: object = None,
    rows: int = 32,
    **built: object,
) -> dict:
    """Trains ``steps`` steps (dispatched by kind with ``schedule``); returns the helper, the
    final params, state and compiled step, and the mean loss over the data workers of every
    step. ``built``: :func:`setup`'s ``width`` and :func:`make_tx`'s arguments."""
    dp, tx, step, params = setup(mesh, seed, **built)
    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    train_step = dp.jit(step, schedule=schedule)
    losses = []
    mean = jax.jit(jnp.mean, out_shardings=NamedSharding(mesh, P()))  # readable everywhere
    for x in batches(steps, rows):
        params_w, state, loss = jax.block_until_ready(train_step(params_w, state, x))
        losses.append(float(np.asarray(mean(loss).addressable_data(0))))
    return dict(dp=dp, tx=tx, params_w=params_w, state=state, losses=losses, step=train_step)


def evaluation(run: dict) -> dict[str, np.ndarray]:
    """The evaluation params (``dp.synchronized_params``), gathered to every process."""
    evaluated = run["dp"].synchronized_params(run["params_w"], run["state"])
    replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(run["dp"].mesh, P()))(evaluated)
    return {k: np.asarray(v.addressable_data(0)) for k, v in replicated.items()}


def reset(run: dict, out: pathlib.Path, rank: int) -> None:
    """Moves ``run``'s state (arrays that span every process) onto ("data"=2, "model"=2), two
    devices of each process, and trains 4 more steps there (dispatched: the dispatcher compares
    the workers across processes). Writes the evaluation params before and after the move, the
    losses after it, and whether the move equals the same move from host copies."""
    from jax.experimental import multihost_utils

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    by_process = [[d for d in devices if d.process_index == p][:2] for p in (0, 1)]
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=auto, devices=by_process[0] + by_process[1]
    )
    dp, tx, step, params = setup(mesh)
    fresh = dp.init(tx, dp.to_workers(params))
    moved = dp.reset_compression(run["params_w"], run["state"], fresh)
    gathered = lambda x: multihost_utils.process_allgather(x, tiled=True)  # noqa: E731
    from_host = dp.reset_compression(
        *jax.tree.map(gathered, (run["params_w"], run["state"])), fresh
    )
    same = all(
        np.array_equal(a.data, b.data)
        for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(from_host), strict=True)
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True)
    )
    after = evaluation(dict(dp=dp, params_w=moved[0], state=moved[1]))
    before = evaluation(run)
    train_step = dp.jit(step, schedule=SCHEDULE)
    params_w, state = moved
    mean = jax.jit(jnp.mean, out_shardings=NamedSharding(mesh, P()))
    losses = []
    for x in batches(4):
        params_w, state, loss = jax.block_until_ready(train_step(params_w, state, x))
        losses.append(float(np.asarray(mean(loss).addressable_data(0))))
    out.mkdir(parents=True, exist_ok=True)
    np.savez(
        out / f"reset_p{rank}.npz",
        same_as_from_host=same,
        losses=losses,
        **{f"before_{k}": v for k, v in before.items()},
        **{f"after_{k}": v for k, v in after.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument(
        "--seed-per-process", action="store_true", help="a user's mistake: params apart"
    )
    parser.add_argument(
        "--differ",
        choices=["schedule", "batch", "width"],
        help="a user's mistake: process 1 runs another schedule (and var_freeze_step), a "
        "batch of another size, or a model of another width",
    )
    parser.add_argument(
        "--in-graph", action="store_true", help="dp.jit without a schedule (with --differ)"
    )
    parser.add_argument("--onebit", action="store_true", help="1-bit Adam (--seed-per-process)")
    parser.add_argument(
        "--reset",
        action="store_true",
        help="move the trained state onto ('data'=2, 'model'=2) with dp.reset_compression",
    )
    args = parser.parse_args()
    job = ozo.initialize_from_env()
    if args.reset:
        reset(train(job_mesh()), args.out, job.process_id)
        return
    if args.seed_per_process:  # dispatched: the dispatcher compares the workers
        onebit = dict(onebit=True, freeze=4) if args.onebit else {}
        schedule = ozo.onebit_schedule(4) if args.onebit else SCHEDULE
        train(job_mesh(), seed=job.process_id, schedule=schedule, **onebit)
        return
    if args.differ:
        other = job.process_id == 1
        late = ozo.zero_one_schedule(
            var_freeze_step=7, var_update_scaler=2, local_step_scaler=4, local_step_clipper=2
        )
        later = other and args.differ == "schedule"
        train(
            job_mesh(),
            schedule=None if args.in_graph else late if later else SCHEDULE,
            rows=40 if other and args.differ == "batch" else 32,
            width=34 if other and args.differ == "width" else 32,
            freeze=7 if later else 6,
        )
        return
    run = train(job_mesh())
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / f"p{job.process_id}.npz", losses=run["losses"], **evaluation(run))


if __name__ == "__main__":
    main()
