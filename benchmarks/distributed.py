"""The child side of ``benchmarks.launch``: join the ``jax.distributed`` job the launcher set up.

The launcher passes everything through environment variables, so a script needs one call at
its top, before any JAX computation::

    from benchmarks import distributed
    distributed.initialize_from_env()   # no-op when not started by the launcher

Variables (all set by ``benchmarks.launch``):

- ``OZO_COORDINATOR``: ``host:port`` of the coordinator (process 0), e.g. ``127.0.0.1:41231``;
- ``OZO_NUM_PROCESSES``, ``OZO_PROCESS_ID``: the job size and this process's rank;
- ``OZO_DEVICES_PER_PROCESS``: simulated CPU devices in this process (``jax_num_cpu_devices``).

The launcher starts each process as ``python -m benchmarks.distributed MODULE ARGS``
(:func:`run_module`), which runs the module as ``__main__`` and, if it fails, exits at once with
its status: a plain ``sys.exit(1)`` would first wait up to 5 minutes in ``jax.distributed``'s
shutdown barrier for processes that may be stuck in a collective with the one that failed.

Also here: the global worker mesh and moving per-worker NumPy data in and out of the worker
layout when no process can address every device.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

COORDINATOR = "OZO_COORDINATOR"
NUM_PROCESSES = "OZO_NUM_PROCESSES"
PROCESS_ID = "OZO_PROCESS_ID"
DEVICES_PER_PROCESS = "OZO_DEVICES_PER_PROCESS"
FAILURE_DIR = "OZO_FAILURE_DIR"  # where run_module notes when this process failed


@dataclasses.dataclass(frozen=True)
class Job:
    """Where this process sits in the job."""

    process_id: int
    num_processes: int
    local_devices: int

    @property
    def num_devices(self) -> int:
        return self.num_processes * self.local_devices


def initialize_from_env(default_devices: int | None = None) -> Job:
    """Configures JAX for this process and joins the distributed job, if the launcher started us.

    Sets ``jax_num_cpu_devices`` (from ``OZO_DEVICES_PER_PROCESS``, else ``default_devices``)
    and, when ``OZO_COORDINATOR`` is set, calls ``jax.distributed.initialize`` on it. Must run
    before JAX first uses its backend. Without the launcher's variables it is a single-process
    job (``default_devices`` simulated devices, or JAX's default).

    Returns:
      The :class:`Job` (rank, number of processes, devices in this process).
    """
    devices = os.environ.get(DEVICES_PER_PROCESS)
    count = int(devices) if devices else default_devices
    if count is not None:
        os.environ.setdefault("PJRT_NPROC", str(max(2 * count, 2)))  # JAX_NOTES: deadlock
        jax.config.update("jax_num_cpu_devices", count)
    coordinator = os.environ.get(COORDINATOR)
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ[NUM_PROCESSES]),
            process_id=int(os.environ[PROCESS_ID]),
            coordinator_bind_address=coordinator,  # the default binds every interface
        )
    return Job(jax.process_index(), jax.process_count(), jax.local_device_count())


def worker_mesh(axis: str) -> jax.sharding.Mesh:
    """A 1-D mesh over every device of every process, in process order (Auto axis type)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.make_mesh(
        (len(devices),), (axis,), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
    )


def to_workers(per_worker: Callable[[int], Any], mesh: jax.sharding.Mesh) -> Any:
    """Builds a tree in the worker layout from ``per_worker(i)`` (a tree of NumPy arrays).

    Each process calls ``per_worker`` once for each worker whose device it owns, so every
    process must be able to compute any worker's value (e.g. from a seed).
    """
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    devices = list(mesh.devices.flat)
    mine = [(i, d) for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    values = {i: jax.tree.flatten(per_worker(i)) for i, _ in mine}
    treedef = values[mine[0][0]][1]
    leaves = []
    for j, example in enumerate(values[mine[0][0]][0]):
        shape = (len(devices), *np.shape(example))
        blocks = [jax.device_put(np.asarray(values[i][0][j])[None], d) for i, d in mine]
        leaves.append(jax.make_array_from_single_device_arrays(shape, sharding, blocks))
    return jax.tree.unflatten(treedef, leaves)


def local_rows(tree: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """This process's rows of a tree in the worker layout: ``(worker indices, leaves)``.

    Each leaf comes back as a NumPy array whose leading axis runs over the returned worker
    indices (in increasing order). No communication: only addressable shards are read.
    """
    leaves = jax.tree.leaves(tree)
    workers: list[int] | None = None
    out = []
    for leaf in leaves:
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        rows = [s.index[0].start or 0 for s in shards]
        if workers is None:
            workers = rows
        elif rows != workers:
            raise ValueError("leaves are not sharded alike over the worker axis")
        out.append(np.concatenate([np.asarray(s.data) for s in shards]))
    return np.asarray(workers or [], dtype=np.int64), out


def run_module(module: str, args: Sequence[str]) -> None:
    """Runs ``python -m module *args`` in this process; on failure exits at once (``os._exit``).

    A clean exit (``None``/``0``) returns normally, so ``jax.distributed``'s shutdown barrier
    runs as usual. Any exception or non-zero ``sys.exit`` prints what it would have printed and
    ends the process immediately with its status, skipping the barrier.
    """
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        if code is None or code == 0:
            return
        _note_failure()
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _exit_now(code)
    except BaseException:
        _note_failure()
        traceback.print_exc()
        _exit_now(1)


def _note_failure() -> None:
    """Tells the launcher when this process failed (before the others notice and fail too)."""
    directory = os.environ.get(FAILURE_DIR)
    if directory:
        with open(os.path.join(directory, os.environ.get(PROCESS_ID, "0")), "w") as f:
            f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: comparable across processes


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m benchmarks.distributed MODULE [ARGS...]")
    run_module(sys.argv[1], sys.argv[2:])
