"""The worker layout across devices and processes.

Helpers for data-parallel training in which every device is one worker and the worker axis may
span several processes (``jax.distributed``), where no process can address every device:

- :func:`initialize_from_env`: join the job that ``python -m optax_zero_one.integration.launch``
  started
  (a no-op in a process that it did not start);
- :func:`worker_mesh`: a 1-D mesh over the devices of every process, in process order;
- :func:`to_workers`: a tree in the worker layout (a leading worker axis sharded over the mesh),
  each process placing only the rows of its own devices;
- :func:`local_rows`: this process's rows of a tree in the worker layout, as NumPy arrays;
- :func:`on_workers`: one worker's function lifted to the worker layout with ``jax.shard_map``.

Nothing here sets JAX's configuration: ask for simulated CPU devices before JAX starts (e.g.
``JAX_NUM_CPU_DEVICES``, which the launcher sets for each process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_zero_one.core import _checks, _graph

# The environment variables ``optax_zero_one.integration.launch`` sets for each process.
COORDINATOR = "OZO_COORDINATOR"  # host:port of process 0
NUM_PROCESSES = "OZO_NUM_PROCESSES"
PROCESS_ID = "OZO_PROCESS_ID"
FAILURE_DIR = "OZO_FAILURE_DIR"  # where a failing process notes when it failed
LAUNCHED_PID = "OZO_LAUNCHED_PID"  # the pid of the process the launcher started (run_module)
LAUNCHER_PID = "OZO_LAUNCHER_PID"  # the launcher's pid: the processes it starts die with it


def outside_user_mesh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run outside the caller's context mesh (``jax.set_mesh``), if one is set.

    The host-side helpers (the dispatcher's counts, the workers' comparisons, a device's block
    of the worker layout) run small programs on arrays of one device; under a context mesh
    ``jax.jit`` places every program on the mesh and refuses such arrays ("incompatible
    devices"). The user's own programs keep the mesh: only these helpers leave it.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            context = leave_other_mesh(None)
        except ValueError as e:  # JAX: "`get_mesh` can only be used outside of `jax.jit`"
            raise TypeError(_graph.TRACED) from e
        with context:
            return fn(*args, **kwargs)

    return wrapped


def leave_other_mesh(mesh: jax.sharding.Mesh | None) -> Any:
    """A context that sets ``mesh`` (``None``: no mesh) where the caller has another context
    mesh (``jax.set_mesh``) open, and changes nothing where it has none or that one. JAX's
    ``ValueError`` from ``get_mesh`` where called under a trace."""
    current = jax.sharding.get_mesh()
    if current.empty or current == mesh:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


@outside_user_mesh
def host_allgather(values: np.ndarray) -> np.ndarray:
    """Every process's ``values`` (a small int32 array of the same shape on each), stacked in
    process order: ``(processes, *values.shape)``. A collective: every process must call it.

    Over one device of each process, so that it works whatever the number of devices each
    process holds (``multihost_utils.process_allgather`` places its input on every device and
    failed with a reshape error when one process had 1 device and the other 2: a trial).
    """
    values = np.asarray(values)
    if values.dtype != np.int32:  # JAX keeps 32 bits of wider ints (x64 off): say so
        raise TypeError(f"host_allgather gathers int32 values, got {values.dtype}")
    count = jax.process_count()
    if count == 1:
        return values[None]
    firsts = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        firsts.setdefault(device.process_index, device)
    devices = [firsts[p] for p in range(count)]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("processes",))
    mine = jax.device_put(values[None], firsts[jax.process_index()])
    spread = jax.make_array_from_single_device_arrays(
        (count, *values.shape), NamedSharding(mesh, P("processes")), [mine]
    )
    gathered = _replicate_over(mesh)(spread)
    return np.asarray(gathered.addressable_data(0))


@functools.cache
def _replicate_over(mesh: jax.sharding.Mesh) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


@dataclasses.dataclass(frozen=True)
class DistributedJob:
    """Where this process sits in the job.

    Attributes:
      process_id: this process's rank, ``0 <= process_id < num_processes``.
      num_processes: the number of processes.
      local_devices: devices of this process.
    """

    process_id: int
    num_processes: int
    local_devices: int


def initialize_from_env() -> DistributedJob:
    """Joins the ``jax.distributed`` job that ``optax_zero_one.integration.launch`` started, if it
    did.

    Reads the coordinator address, the job size and this process's rank from the environment
    the launcher set (``OZO_COORDINATOR``, ``OZO_NUM_PROCESSES``, ``OZO_PROCESS_ID``) and calls
    ``jax.distributed.initialize`` with them. Without those variables (a process the launcher
    did not start) it changes nothing: a single-process job. Call it before any JAX
    computation. On a cluster, call ``jax.distributed.initialize()`` instead, which finds its
    arguments in the cluster's environment (SLURM, Kubernetes, ...).

    Returns:
      The :class:`DistributedJob`: rank, number of processes, devices in this process.

    Example:
      >>> job = initialize_from_env()  # first thing in a script the launcher runs
      >>> mesh = worker_mesh("w")
    """
    coordinator = os.environ.get(COORDINATOR)
    if coordinator and os.environ.get(LAUNCHED_PID) not in (None, str(os.getpid())):
        coordinator = None  # a subprocess of a launched process: it inherited the variables
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ[NUM_PROCESSES]),
            process_id=int(os.environ[PROCESS_ID]),
            coordinator_bind_address=coordinator,  # the default binds every interface
        )
    return DistributedJob(jax.process_index(), jax.process_count(), jax.local_device_count())


def worker_mesh(
    axis_name: str, num_workers: int | None = None, devices: Any = None
) -> jax.sharding.Mesh:
    """A 1-D mesh of one worker per device, over the devices of every process.

    Devices are ordered by process, then id, so that each process's workers are consecutive
    rows of the worker layout. The axis type is ``Auto``.

    Args:
      axis_name: the worker axis, the ``axis_name`` the optimizers are built with.
      num_workers: use the first ``num_workers`` devices (default: all of them).
      devices: the devices to choose from (default: ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh`` with the one axis ``axis_name``.

    Example:
      >>> mesh = worker_mesh("w")  # every device of every process
      >>> mesh = worker_mesh("w", 4)  # the first 4 devices
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(
            f"worker_mesh's axis_name must be a non-empty str, got {axis_name!r}: the "
            'arguments are (axis_name, num_workers), e.g. worker_mesh("w", 4).'
        )
    if num_workers is not None:
        _checks.check_int("num_workers", num_workers, 1)
    devices = jax.devices() if devices is None else devices
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if num_workers is not None:
        if num_workers > len(devices):
            raise ValueError(f"{num_workers} workers but only {len(devices)} devices")
        devices = devices[:num_workers]
    return jax.make_mesh(
        (len(devices),),
        (axis_name,),
        devices=devices,
        axis_types=(jax.sharding.AxisType.Auto,),
    )


WorkerAxes = str | tuple[str, ...] | None


def _axis(mesh: jax.sharding.Mesh, axis_name: WorkerAxes) -> str | tuple[str, ...]:
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh axes {mesh.axis_names}: pass the worker axis_name")
        return mesh.axis_names[0]
    return axis_name


def _num_workers(mesh: jax.sharding.Mesh, axis: str | tuple[str, ...]) -> int:
    """Workers on ``axis`` (the product of the sizes of a tuple of axes)."""
    return math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def to_workers(values: Any, mesh: jax.sharding.Mesh, axis_name: WorkerAxes = None) -> Any:
    """Places a tree in the worker layout: a leading worker axis sharded over the mesh.

    ``values`` is either the whole tree, whose leaves have a leading axis of one row per
    worker, or a function ``i -> worker i's tree`` (leaves without the worker axis). In a job
    of several processes each process places only the rows of the devices it owns, so every
    process passes the same values (e.g. computed from a seed) and, given a function, calls it
    only for its own workers. A callable ``values`` is always taken as such a function.

    Args:
      values: a tree of arrays with a leading worker axis, or a function of the worker index.
      mesh: the worker mesh (:func:`worker_mesh`).
      axis_name: the mesh axis of the workers (default: the mesh's only axis), or a tuple of
        axes, e.g. ``("node", "local")`` (worker ``node * local_size + local``).

    Returns:
      The tree as ``jax.Array``s sharded ``P(axis_name)`` over ``mesh``.

    Example:
      >>> mesh = worker_mesh("w", 2)
      >>> params = to_workers(ozo.replicate({"w": np.zeros(3)}, mesh.size), mesh)
      >>> batch = to_workers(lambda i: {"x": np.full((4, 3), float(i))}, mesh)  # worker i's own
      >>> batch["x"].shape
      (2, 4, 3)
    """
    axis = _axis(mesh, axis_name)
    sharding = NamedSharding(mesh, P(axis))
    n = _num_workers(mesh, axis)
    if not callable(values):
        for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
            rows = np.shape(x)[0] if np.ndim(x) else None
            if rows is None or rows % n:
                raise ValueError(
                    f"to_workers: leaf {jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
                    f"whose leading axis does not split over the {n} workers: give every leaf "
                    f"one row per worker (ozo.replicate(tree, {n}) for a tree all workers "
                    f"share), or pass a function of the worker index, i -> worker i's tree."
                )
        if sharding.is_fully_addressable:
            return jax.device_put(values, sharding)
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(
                np.shape(x),
                sharding,
                lambda index: np.asarray(x[index]),
                dtype=_dtype_of(x),  # a process with no device of the mesh reads none
            ),
            values,
        )
    rows: dict[int, list[Any]] = {}

    def leaves_of(i: int) -> list[Any]:
        if i not in rows:
            rows[i] = jax.tree.leaves(values(i))
        return rows[i]

    blocks = sharding.addressable_devices_indices_map((n,)).values()
    mine = sorted({i for index in blocks for i in range(*index[0].indices(n))})
    example = mine[0] if mine else 0  # no device of the mesh here: its shapes only
    first = values(example)
    treedef, examples = jax.tree.structure(first), jax.tree.leaves(first)
    rows[example] = examples

    def leaf(j: int) -> jax.Array:
        shape = (n, *np.shape(examples[j]))

        def block(index: tuple) -> np.ndarray:
            return np.stack([np.asarray(leaves_of(i)[j]) for i in range(*index[0].indices(n))])

        return jax.make_array_from_callback(shape, sharding, block, dtype=_dtype_of(examples[j]))

    return jax.tree.unflatten(treedef, [leaf(j) for j in range(len(examples))])


def _dtype_of(x: Any) -> np.dtype:
    """The dtype JAX gives ``x`` (canonical: float64 is float32 without x64), without the
    warnings ``np.result_type`` of a ``jax.Array`` or an explicit float64 request raise."""
    return jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))


@outside_user_mesh
def on_each_device(program: Callable[..., tuple], blocks: list[jax.Array], *static: tuple) -> list:
    """``program``'s results for ``blocks`` (arrays of one device each), in their order: one
    call per device with that device's blocks as a tuple (and the entries of each ``static``
    tuple that go with them), so that host-side helpers compile one small program per device,
    not one per block shape and device (op by op: 800 and 1,360 compiles at 100 leaves on 8
    devices in a trial of restart costs, ~37 s without a compilation cache)."""
    on_device: dict[Any, list[int]] = {}
    for i, block in enumerate(blocks):
        on_device.setdefault(next(iter(block.devices())), []).append(i)
    out: list[Any] = [None] * len(blocks)
    for where in on_device.values():
        taken = [tuple(blocks[i] for i in where), *(tuple(s[i] for i in where) for s in static)]
        for i, result in zip(where, program(*taken), strict=True):
            out[i] = result
    return out


def _addressable_rows(x: Any) -> tuple[list[int], np.ndarray]:
    """The rows of a worker-layout array that this process holds: (indices, their values)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        x = np.asarray(jax.device_get(x))
        return list(range(x.shape[0])), x
    n = x.shape[0]
    blocks: dict[int, np.ndarray] = {}
    filled: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        first = shard.index[0]
        data = np.asarray(shard.data)
        if isinstance(first, int):  # e.g. a pmap layout: the shard has no worker axis
            first, data = slice(first, first + 1), data[None]
        start, stop, _ = first.indices(n)
        if start not in blocks:
            blocks[start] = np.empty((stop - start, *x.shape[1:]), data.dtype)
            filled[start] = np.zeros(blocks[start].shape, bool)
        part = (slice(None), *shard.index[1:])  # a model axis splits a row over devices
        blocks[start][part] = data
        filled[start][part] = True
    if not all(f.all() for f in filled.values()):
        raise ValueError(
            "some of this process's worker rows are split over devices of other processes (a "
            "model axis across processes): gather them first, e.g. with "
            "jax.experimental.multihost_utils.process_allgather"
        )
    starts = sorted(blocks)
    data = np.concatenate([blocks[s] for s in starts])
    indices = [i for s in starts for i in range(s, s + len(blocks[s]))]
    if len(set(indices)) != len(indices):
        raise ValueError("the array's rows are not split into disjoint blocks over devices")
    return indices, data


def local_rows(tree: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """This process's rows of a tree in the worker layout: ``(worker indices, leaves)``.

    Reads only the shards this process can address (no communication), so it works when the
    worker axis spans other processes' devices. In a single process it returns every row.

    Args:
      tree: a tree of arrays with a leading worker axis (e.g. made by :func:`to_workers`).

    Returns:
      The indices of this process's workers (increasing, int64) and the tree's leaves as NumPy
      arrays whose leading axis runs over those workers. Raises ``ValueError`` if the leaves
      are not split alike over the workers.

    Example:
      >>> mesh = worker_mesh("w", 2)
      >>> workers, leaves = local_rows(to_workers(ozo.replicate({"w": np.zeros(3)}, 2), mesh))
      >>> workers, [leaf.shape for leaf in leaves]  # then e.g. np.savez(..., *leaves)
      (array([0, 1]), [(2, 3)])
    """
    workers: list[int] | None = None
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not np.ndim(leaf):
            raise ValueError(
                f"local_rows needs the worker layout (a leading worker axis on every leaf); leaf "
                f"{_checks.leaf_name(path)} is a scalar. Pass the tree the mapped step made."
            )
        rows, data = _addressable_rows(leaf)
        if workers is None:
            workers = rows
        elif rows != workers:
            raise ValueError("leaves are not sharded alike over the worker axis")
        out.append(data)
    return np.asarray(workers or [], dtype=np.int64), out


def check_mesh(mesh: Any, call: str, *also: type) -> None:
    """Raises ``TypeError`` naming ``call`` (its signature) unless ``mesh`` is a
    ``jax.sharding.Mesh`` (or one of ``also``): the arguments given in another order."""
    if not isinstance(mesh, (jax.sharding.Mesh, *also)):
        raise TypeError(
            f"{call}: mesh must be a jax.sharding.Mesh, got a {type(mesh).__name__} (the "
            "arguments in another order?)."
        )


def on_workers(
    fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: WorkerAxes = None,
    *,
    batched: bool = False,
) -> Callable[..., Any]:
    """One worker's function lifted to the worker layout with ``jax.shard_map``.

    Every argument and result of the returned function has a leading worker axis sharded over
    the mesh; each device sees a block of one row, which is dropped before ``fn`` runs and
    restored after (scalars ``fn`` returns become one row per worker). Inside ``fn`` the
    worker axis is bound, so collectives over ``axis_name`` (and the optimizers built with it)
    work. Not jitted: wrap it in ``jax.jit``.

    Args:
      fn: ``(*one worker's trees) -> one worker's trees``.
      mesh: the worker mesh (:func:`worker_mesh`).
      axis_name: the mesh axis of the workers (default: the mesh's only axis), or a tuple of
        axes such as ``("node", "local")`` for hierarchical compression.
      batched: run ``fn`` under ``jax.vmap`` over each device's one-row block instead of on the
        row. For a program compiled for one step kind (``step_kind=``): XLA:CPU then writes the
        new params and state in place over the donated old ones, where dropping the row makes
        it copy them (``docs/jit.md``, "Performance on CPU"). An update that decides its kind in
        the graph (no ``step_kind``) is not run under the vmap, where its conditionals would
        become selects: ``fn`` then runs on the row, with a warning. A ``lax.cond`` on the
        worker's own values in ``fn`` runs both branches, as under any ``vmap``.

    Returns:
      ``fn`` on trees in the worker layout.

    Example:
      >>> mesh = worker_mesh("w", 2)
      >>> tx = ozo.zero_one_adam(1e-3, axis_name="w")
      >>> params = to_workers(ozo.replicate({"w": np.zeros(3)}, 2), mesh)
      >>> opt_state = jax.jit(on_workers(tx.init, mesh))(params)
      >>> def worker_step(params, opt_state, grads):  # one worker, as under shard_map
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> step = jax.jit(on_workers(worker_step, mesh), donate_argnums=(0, 1))
      >>> params, opt_state = step(params, opt_state, to_workers(lambda i: {"w": np.ones(3)}, mesh))
    """
    check_mesh(mesh, "on_workers(fn, mesh, axis_name)", jax.sharding.AbstractMesh)
    axis = _axis(mesh, axis_name)
    body = worker_body(fn, batched, axis, "on_workers")
    return jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis))


def worker_body(fn: Callable[..., Any], batched: bool, axes: Any, owner: str) -> Callable[..., Any]:
    """``fn`` on one worker's trees as a ``shard_map`` body over blocks of one row: on the row
    (dropped before ``fn``, restored after), or under ``jax.vmap`` over the block (``batched``;
    see :func:`on_workers`). While ``fn`` is traced, the library's transforms must communicate
    over ``axes`` (one axis, or ``(slow, fast)``): one built for another axis, or for none,
    raises, as JAX would run it and the workers would never average (``owner`` names the
    helper in the error)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    expected = names[0] if len(names) == 1 else names

    def body(*args: Any) -> Any:
        _check_one_row_each(args, names, owner)
        with _checks.expect_worker_axes(expected, owner):
            if batched:
                try:
                    with _graph.rows_batched():
                        return jax.vmap(fn)(*args)
                except (_graph.DecidedInGraph, ValueError) as err:
                    # an update traced before, on the row, inside the user's own jax.jit comes
                    # from jit's cache without running switch: JAX's batching of its
                    # conditional then fails with this error (JAX 0.10)
                    if isinstance(err, ValueError) and not _graph.is_unbatchable_switch(err):
                        raise
                    why = (
                        "the optimizer's update got no step_kind, so it decides its step kind "
                        "in the graph"
                        if isinstance(err, _graph.DecidedInGraph)
                        else "a conditional in it could not be batched (the optimizer's update "
                        "without step_kind, from a jitted function's cache, or a lax.cond of "
                        "your own: optax.apply_if_finite or MultiSteps' skip_not_finite around "
                        "the optimizer decide per worker, and one worker's NaN then hangs the "
                        "job in a collective the others wait in; docs/usage.md)"
                    )
                    warnings.warn(
                        f"{owner}: {why}; the step runs on each worker's row instead of under "
                        "vmap (batched=False; XLA:CPU then copies the params and state each "
                        "step, docs/jit.md). With dp.jit(step, schedule=...), forward the "
                        "step_kind your step receives: tx.update(grads, opt_state, params, "
                        "step_kind=step_kind).",
                        stacklevel=1,
                    )
            out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

    return body


def _check_one_row_each(args: Any, names: tuple[str, ...], owner: str) -> None:
    """Raises ``ValueError`` unless every argument's block (what one device sees) is one row:
    a leading axis of ``k`` rows per worker would silently train on row 0 and drop the rest."""
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        shape = np.shape(x)
        if shape and shape[0] != 1:
            workers = math.prod(jax.lax.axis_size(name) for name in names)
            where = f"positional argument {path[0].idx}" + (
                f", leaf {jax.tree_util.keystr(path[1:])}," if len(path) > 1 else ""
            )
            raise ValueError(
                f"{owner}: {where} has a leading axis of "
                f"{shape[0] * workers}, where the worker layout has one entry per worker "
                f"({workers}). Each worker would see only the first of its {shape[0]} rows. "
                "Give every argument a leading axis of one entry per worker: reshape a global "
                f"batch to (workers, per_worker, ...) with x.reshape({workers}, -1, "
                "*x.shape[1:]), and build params for as many workers as the mesh has "
                "(ozo.replicate(params, num_workers)); ozo.data_parallel(...).jit takes a "
                "global batch itself."
            )
