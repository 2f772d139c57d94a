"""A 0/1 Adam training run that checkpoints with Orbax, can be killed at any step, and resumes.

Driven by ``tests/test_resume.py`` as a subprocess, from ``tests/``::

    python -m support.jobs.resume_worker --mode shard_map --workers 4 --ckpt DIR [--pace 0.02]
                                         [--reference OUT.json]

It resumes from the latest checkpoint in ``DIR`` if there is one (printing
``restored STEP DIGEST KIND ACCUMULATOR_NONZERO``), then trains to ``STEPS``, saving every
worker's params and full optimizer state at the steps in ``SAVE_STEPS`` and printing
``step K DIGEST`` after step ``K`` (after its checkpoint is committed). ``DIGEST`` is a SHA-256
of the bytes of every worker's params and state, so two runs agree on it only if they are
bitwise identical. With ``--reference`` it then repeats the whole run from scratch in the same
process, uninterrupted and without checkpoints, and writes both runs' digests to ``OUT.json``.

The schedule (``F = 20``, ``kappa = 2``, ``alpha = 4``, ``H = 4``) puts variance, compressed,
sync and local steps in 42 steps; checkpoints every third step fall in phase A (before the
freeze) and in the middle of local-step intervals (steps 27, 30, 33, 39).

The functions above ``main`` are also imported by the tests (problem, optimizer, save/restore).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX initialises its backend (docs/testing.md)
    os.environ.setdefault("PJRT_NPROC", "16")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from support.mapping import AXIS, mapped  # noqa: E402

STEPS = 42
SAVE_STEPS = tuple(range(3, STEPS + 1, 3))
SCHEDULE = dict(var_freeze_step=20, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
SHAPES = {"w": (6, 5), "b": (7,), "s": (), "c": (3, 1, 3)}


def make_tx(num_workers: int | None = None) -> optax.GradientTransformation:
    """0/1 Adam with a schedule, weight decay and a mask: every piece of state is exercised."""
    mask = {"w": 1.0, "b": np.arange(7) % 2, "s": 1.0, "c": 1.0}
    return ozo.zero_one_adam(
        lambda count: 0.05 * 0.98**count,
        weight_decay=0.01,
        axis_name=AXIS,
        num_workers=num_workers,
        mask=mask,
        **SCHEDULE,
    )


def problem() -> tuple[dict, dict]:
    """Initial params and targets (worker 0's view; every worker starts equal)."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    targets = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return params, targets


def loss_fn(params: Any, targets: Any) -> jax.Array:
    """The shared objective: 0.5 ||x - t||^2 over all leaves."""
    return sum(
        0.5 * jnp.sum(jnp.square(p - t)) for p, t in zip(*map(jax.tree.leaves, (params, targets)))
    )


def build(mode: str, num_workers: int, tx: optax.GradientTransformation | None = None) -> tuple:
    """``(init, step)`` in the worker layout for ``mode`` (``vmap``/``pmap``/``shard_map``).

    ``step(params, state, noise)`` takes each worker's gradient noise (see :func:`noise`); each
    worker's gradient is its own curvature times the shared gradient, plus its noise.
    """
    tx = tx or make_tx()
    _, targets = problem()

    def step(params: Any, state: Any, noise: Any) -> tuple:
        curvature = 0.5 + 0.5 * jax.lax.axis_index(AXIS).astype(jnp.float32)
        grads = jax.tree.map(
            lambda g, z: curvature * g + z, jax.grad(loss_fn)(params, targets), noise
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return mapped(tx.init, mode, num_workers), mapped(step, mode, num_workers)


def noise(step: int, num_workers: int) -> dict:
    """Every worker's gradient noise at ``step``, in the worker layout (deterministic)."""
    rng = np.random.default_rng([step, num_workers])
    return {
        k: (0.3 * rng.standard_normal((num_workers, *s))).astype(np.float32)
        for k, s in SHAPES.items()
    }


def initial(init: Any, num_workers: int) -> tuple[Any, Any]:
    """Fresh params and state in the worker layout."""
    params = ozo.replicate(problem()[0], num_workers)
    state = init(params)
    return init_params_like(params, state), state


def init_params_like(params: Any, state: Any) -> Any:
    """``params`` placed like ``state`` (so that a restore target carries the right sharding)."""
    sharding = jax.tree.leaves(state)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # the worker axis alone: any rank
        spec = jax.sharding.PartitionSpec(sharding.spec[0])
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.device_put(params, sharding)


def digest(tree: Any) -> str:
    """SHA-256 of every leaf's bytes (and dtype and shape), in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def manager(directory: str) -> ocp.CheckpointManager:
    """An Orbax manager that keeps every checkpoint (they are small)."""
    return ocp.CheckpointManager(
        os.path.abspath(directory), item_handlers=ocp.StandardCheckpointHandler()
    )


def save(mgr: ocp.CheckpointManager, step: int, params: Any, state: Any) -> None:
    """Saves every worker's params and full optimizer state, and waits for the commit."""
    mgr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
    mgr.wait_until_finished()


def restore(
    mgr: ocp.CheckpointManager, step: int, like: tuple[Any, Any], num_workers: int
) -> tuple[Any, Any]:
    """Restores step ``step`` against a target shaped like ``like`` (this run's fresh state).

    The worker count is checked on the checkpoint's metadata first, so that a checkpoint made by
    another number of workers fails with an explanation rather than Orbax's shape mismatch.
    """
    ozo.check_worker_count(mgr.item_metadata(step), num_workers)
    params, state = like
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    restored = mgr.restore(step, args=ocp.args.StandardRestore(target))
    return restored["params"], restored["opt_state"]


def train(
    init: Any, step: Any, num_workers: int, ckpt: str | None, pace: float, out: Any
) -> dict[int, str]:
    """Trains to ``STEPS`` (resuming from ``ckpt`` if it has a checkpoint); digests per step."""
    params, state = initial(init, num_workers)
    mgr = manager(ckpt) if ckpt else None
    start = 0
    if mgr is not None and mgr.latest_step() is not None:
        start = mgr.latest_step()
        params, state = restore(mgr, start, (params, state), num_workers)
        one = ozo.unreplicate(state)
        variance = ozo.VarianceDoubling(SCHEDULE["var_freeze_step"], SCHEDULE["var_update_scaler"])
        local = ozo.LocalStepDoubling(SCHEDULE["local_step_scaler"], SCHEDULE["local_step_clipper"])
        kind = ozo.step_kind(one, ozo.StepSchedule(variance, local)).name
        x = ozo.unreplicate(params)
        anchor = ozo.synchronized_params(x, one)
        moved = any(np.any(a != p) for a, p in zip(jax.tree.leaves(anchor), jax.tree.leaves(x)))
        print(
            f"restored {start} {digest((params, state))} {kind} {int(moved)}", file=out, flush=True
        )
    digests = {}
    for k in range(start + 1, STEPS + 1):
        params, state = step(params, state, noise(k, num_workers))
        jax.block_until_ready((params, state))  # pace the loop (simulated-device deadlock)
        if mgr is not None and k in SAVE_STEPS:
            save(mgr, k, params, state)
        digests[k] = digest((params, state))
        print(f"step {k} {digests[k]}", file=out, flush=True)
        if pace:
            time.sleep(pace)
    if mgr is not None:
        mgr.close()
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("vmap", "pmap", "shard_map"), default="shard_map")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--reference", help="also run uninterrupted; write digests here")
    parser.add_argument("--compile-cache", help="JAX persistent compilation cache directory")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    if args.compile_cache:  # later processes of a test reuse the first one's executables
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    init, step = build(args.mode, args.workers)
    resumed = train(init, step, args.workers, args.ckpt, args.pace, sys.stdout)
    if args.reference:  # same compiled program, from scratch, never interrupted
        with open(os.devnull, "w") as quiet:
            reference = train(init, step, args.workers, None, 0.0, quiet)
        with open(args.reference, "w") as f:
            json.dump({"resumed": resumed, "reference": reference}, f)


if __name__ == "__main__":
    main()
