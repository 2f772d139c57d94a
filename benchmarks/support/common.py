"""Shared plumbing for the benchmarks: simulated CPU devices, a data-parallel training step under
``jax.shard_map``, and the bytes each step kind communicates.

Simulated devices on a small CPU machine need two things (``docs/testing.md``): ``PJRT_NPROC``
at least twice the device count, set before JAX first uses its backend, and a loop that waits
for every step (:func:`run_step` does). A benchmark module sets ``JAX_PLATFORMS`` at its very
top (JAX reads it when it is imported) and calls :func:`setup_cpu_devices` in ``main`` with the
device count its options ask for, which sets ``PJRT_NPROC`` from that count (importing JAX does
not start its backend; a fixed ``PJRT_NPROC`` at the top would fit the default options only)::

    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

The worker layout (a leading worker axis sharded over a 1-D mesh on :data:`AXIS`) comes from the
library: ``ozo.worker_mesh``, ``ozo.to_workers``, ``ozo.on_workers``.

Communication is measured, not estimated, and always the same way: :func:`comm_stats_on_workers`
compiles a function over the worker mesh (compile only) and :func:`comm_stats_of_compiled` reads
the collectives out of the optimised HLO (with
:func:`optax_zero_one.integration.comm_stats.parse_hlo`). Every script that counts collectives
goes through these two: :func:`traffic_per_kind` (the whole training step, once per step kind,
for the kind alone through the ``step_kind=`` hint), :func:`update_comm_stats` (one optimizer
update, ``benchmarks.comm_volume``) and :func:`mean_comm_stats` (one call of a mean,
``benchmarks.comm_report`` and ``benchmarks.psum_report``).
Training runs the same programs: :func:`train_step` compiles one per kind and picks each step's on
the host (:func:`optax_zero_one.dispatch_by_kind`). Bytes per worker of a run = sum over steps of
the bytes of the kind each step took.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_zero_one as ozo

AXIS = "w"
NODE_AXES = ("node", "local")  # a two-level mesh: nodes, and workers inside a node
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"  # the repository's results/


def worker_axes(mesh: jax.sharding.Mesh) -> str | tuple[str, ...]:
    """The mesh axes the workers run over: the only one of a 1-D mesh, else all of them (a
    worker is a device; e.g. ``("node", "local")``, worker ``node * local_size + local``)."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def node_mesh(nodes: int, local: int) -> jax.sharding.Mesh:
    """A ``("node", "local")`` mesh of ``nodes x local`` simulated devices."""
    return jax.make_mesh((nodes, local), NODE_AXES, devices=jax.devices()[: nodes * local])


def mesh_of(num_workers: int | tuple[int, int]) -> jax.sharding.Mesh:
    """The mesh of ``N`` flat workers on :data:`AXIS`, or of ``(nodes, local)`` (a
    :func:`node_mesh`)."""
    if isinstance(num_workers, tuple):
        return node_mesh(*num_workers)
    return ozo.worker_mesh(AXIS, num_workers)


# glibc's allocator told to keep what XLA:CPU frees (docs/jit.md, "Performance on CPU"): one
# arena (the per-thread arenas of XLA's worker threads hand freed pages back with madvise
# whatever the trim threshold), no mmap for large blocks (the mmap threshold cannot be set above
# 32 MB), no trim below 4 GB, 512 MB of slack. Without it a 0/1 Adam sync step through dp.jit at
# 4.2M parameters page-faulted 32,914 times (134 MB) per step and took 92-112 ms; with it none,
# 40-42 ms. glibc reads these once, when the process starts.
KEEP_MEMORY = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
    "MALLOC_TOP_PAD_": "536870912",
}
SYSTEM_ALLOCATOR = "--system-allocator"  # a timing benchmark's flag: glibc as it comes


def allocator_settings() -> dict[str, str]:
    """This process's :data:`KEEP_MEMORY` variables (empty: glibc as it comes)."""
    return {k: os.environ[k] for k in KEEP_MEMORY if k in os.environ}


def allocator_note(settings: dict[str, str]) -> str:
    """How a report names the allocator's ``settings`` (:func:`allocator_settings`); empty if
    there are none."""
    if not settings:
        return ""
    values = " ".join(f"{k}={v}" for k, v in settings.items())
    return f"glibc's allocator keeping its memory ({values}; `{SYSTEM_ALLOCATOR}` to run without)."


def rerun_keeping_memory(module: str) -> None:
    """Re-executes ``python -m module`` with :data:`KEEP_MEMORY` in its environment, unless it
    is there already, JAX runs on another platform than the CPU, or the command line says
    :data:`SYSTEM_ALLOCATOR`. For a timing benchmark's ``__main__`` block only: the
    allocator's settings must be in place before the process starts."""
    if SYSTEM_ALLOCATOR in sys.argv or os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
        return
    if allocator_settings() == KEEP_MEMORY:
        return
    argv = [sys.executable, "-m", module, *sys.argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, **KEEP_MEMORY})


def setup_cpu_devices(count: int) -> int:
    """Asks for ``count`` simulated CPU devices; call before JAX first uses its backend.

    Sets ``PJRT_NPROC`` (the deadlock guard, ``2 count``) and ``JAX_PLATFORMS=cpu`` if unset,
    then ``jax_num_cpu_devices``. If the backend already runs (e.g. under pytest, whose
    ``conftest.py`` made 8 devices) its devices are kept.

    Returns:
      The number of devices JAX has. Raises ``RuntimeError`` if it is less than ``count``.
    """
    os.environ.setdefault("PJRT_NPROC", str(max(2 * count, 2)))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with contextlib.suppress(RuntimeError):  # backend already up: keep its devices
        jax.config.update("jax_num_cpu_devices", count)
    if jax.device_count() < count:
        raise RuntimeError(
            f"need {count} devices, JAX has {jax.device_count()}: set up the simulated "
            "devices before anything uses JAX (see benchmarks/support/common.py)."
        )
    return jax.device_count()


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as the benchmarks run it.

    Attributes:
      name: label in tables and plots.
      tx: the transform; its ``update`` gets ``(grads, state, params)`` on each worker.
      average_grads: ``True`` for plain data-parallel optimizers: gradients are averaged with a
        float32 ``pmean`` before ``tx`` (what users run today). ``False`` for optimizers that do
        their own communication and take local gradients.
      kind_names: names of the step kinds, indexed as :meth:`kind_index` returns.
      schedule: the optimizer's :class:`optax_zero_one.StepSchedule` (``None`` for an optimizer
        with one step kind, which gets no hint).
    """

    name: str
    tx: optax.GradientTransformation
    average_grads: bool
    kind_names: tuple[str, ...] = ("all-reduce",)
    schedule: ozo.StepSchedule | None = None

    def kind(self, step: int) -> ozo.StepKind | None:
        """The static kind of 1-based ``step`` (``None`` without a schedule)."""
        return None if self.schedule is None else self.schedule.kind(step)

    def kind_index(self, kind: ozo.StepKind | None) -> int:
        """``kind``'s index into :attr:`kind_names`."""
        return 0 if kind is None else self.kind_names.index(kind.name)


def zero_one_spec(
    name: str,
    tx: optax.GradientTransformation,
    variance_policy: ozo.VariancePolicy,
    local_step_policy: ozo.LocalStepPolicy,
) -> OptimizerSpec:
    """0/1 Adam's step kinds (:data:`optax_zero_one.STEP_KINDS`) for a transform built with
    the given policies."""
    schedule = ozo.StepSchedule(variance_policy, local_step_policy)
    return OptimizerSpec(name, tx, False, ozo.STEP_KINDS, schedule)


def onebit_spec(name: str, tx: optax.GradientTransformation, freeze_step: int) -> OptimizerSpec:
    """1-bit Adam's step kinds (:data:`optax_zero_one.core.kinds.ONEBIT_STEP_KINDS`: warm-up,
    compressed)
    for a transform with warm-up length ``freeze_step``."""
    return OptimizerSpec(
        name, tx, False, ozo.core.kinds.ONEBIT_STEP_KINDS, ozo.onebit_schedule(freeze_step)
    )


def worker_step(
    spec: OptimizerSpec,
    loss_fn: Callable[[Any, Any], jax.Array],
    axes: str | tuple[str, ...],
    step_kind: ozo.StepKind | None = None,
) -> Callable[..., Any]:
    """One worker's training step, ``(params, state, batch) -> (params, state, loss)``, for the
    step kind ``step_kind`` (the optimizer's hint; ``None``: decided in the graph); ``axes``
    are the workers' mesh axes (:func:`worker_axes`), over which a plain data-parallel
    optimizer averages its gradients."""

    def step(params: Any, state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if spec.average_grads:
            grads = jax.lax.pmean(jax.tree.map(lambda g: g.astype(jnp.float32), grads), axes)
        updates, state = spec.tx.update(grads, state, params, step_kind=step_kind)
        return optax.apply_updates(params, updates), state, loss

    return step


def make_step(
    spec: OptimizerSpec,
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: jax.sharding.Mesh,
    step_kind: ozo.StepKind | None = None,
) -> Callable[..., Any]:
    """The data-parallel training step, ``(params, state, batch) -> (params, state, loss)``,
    for the step kind ``step_kind`` (the optimizer's hint; ``None``: decided in the graph).

    All arguments and results are in the worker layout (leading worker axis over ``mesh``).
    ``loss`` is each worker's loss on its own batch. Not jitted: wrap it in ``jax.jit`` (and
    donate), or let :func:`train_step` do it for every kind.
    """
    axes = worker_axes(mesh)
    return ozo.on_workers(worker_step(spec, loss_fn, axes, step_kind), mesh, axes)


class TrainStep:
    """The training step of :func:`make_step`, one jitted program per step kind (donating
    params and state), the kind of each step chosen on the host.

    Calling it returns ``(params, state, loss, kind)``, ``kind`` the index (into
    ``spec.kind_names``) of the program that ran. ``programs`` holds the jitted programs by
    kind name (``"all-reduce"`` for an optimizer without a schedule).
    """

    def __init__(self, spec: OptimizerSpec, loss_fn: Callable[..., Any], mesh: Any):
        self.spec = spec

        def compile_kind(kind: ozo.StepKind | None) -> Callable[..., Any]:
            return jax.jit(make_step(spec, loss_fn, mesh, kind), donate_argnums=(0, 1))

        if spec.schedule is None:
            self.programs = {spec.kind_names[0]: compile_kind(None)}
            self.dispatcher = None
        else:
            self.dispatcher = ozo.dispatch_by_kind(compile_kind, spec.schedule)
            self.programs = self.dispatcher.programs

    def __call__(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any, int]:
        if self.dispatcher is None:
            return (*self.programs[self.spec.kind_names[0]](params, state, batch), 0)
        kind = self.dispatcher.next_kind(state)
        params, state, loss = self.dispatcher(params, state, batch)
        return params, state, loss, self.spec.kind_index(kind)

    def program(self, kind: int = 0) -> Any:
        """The jitted program of kind index ``kind`` (compiled at its first use)."""
        if self.dispatcher is None:
            return self.programs[self.spec.kind_names[0]]
        return self.dispatcher.program(self.spec.schedule.kinds[kind])


def train_step(spec: OptimizerSpec, loss_fn: Callable[..., Any], mesh: Any) -> TrainStep:
    """A :class:`TrainStep`: what the benchmarks train with."""
    return TrainStep(spec, loss_fn, mesh)


def run_step(step: Callable[..., Any], *args: Any) -> Any:
    """Calls a compiled multi-device step and waits for it (the simulated-device deadlock)."""
    return jax.block_until_ready(step(*args))


# --- Compile and count: the one path from a program to the collectives it holds ---

CommStats = ozo.integration.comm_stats.CommStats

# XLA:CPU option that makes a compile for accounting ~2x faster (10 leaves of the compressed mean:
# ~10 s -> ~5 s on the shared 2-core machine): no LLVM optimisation of the generated code. It
# does not touch the HLO passes that place, split or combine collectives
# (tests/test_comm_volume.py checks the stats are identical). Turning off XLA:CPU's fusion
# emitters as well looked faster on the compressed mean but doubled the compile of a float
# pmean, and BERT-Large's stalled in layout assignment for > 15 min, so it is not used.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def comm_stats_of_compiled(compiled: jax.stages.Compiled) -> CommStats:
    """The collectives of a compiled program, read from its optimised HLO: the one place the
    benchmarks read them (:func:`optax_zero_one.integration.comm_stats.parse_hlo`)."""
    return ozo.integration.comm_stats.parse_hlo(compiled.as_text())


def comm_stats_on_workers(
    fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    *args: Any,
    compiler_options: dict[str, Any] | None = None,
) -> CommStats:
    """Compiles one worker's ``fn`` over the worker mesh (compile only) and reads its collectives.

    The benchmarks' one compile-and-count path: ``fn`` is lifted to the worker layout over all
    of ``mesh``'s worker axes (``ozo.on_workers(fn, mesh, worker_axes(mesh))``), jitted, lowered
    for ``args`` and compiled; :func:`comm_stats_of_compiled` reads the result.

    Args:
      fn: ``(*one worker's trees) -> one worker's trees``; collectives over :func:`worker_axes`.
      mesh: the worker mesh (:func:`mesh_of`).
      *args: the arguments in the worker layout: ``jax.ShapeDtypeStruct`` (e.g. from
        :func:`worker_specs`) or arrays, of which only shapes, dtypes and shardings are used.
      compiler_options: XLA options for the compile, e.g. :data:`FAST_COMPILE` (the HLO passes
        that place and combine collectives run either way; only code generation is cheaper).

    Returns:
      The :class:`optax_zero_one.integration.comm_stats.CommStats` of the optimised program.
    """

    def spec(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    program = jax.jit(ozo.on_workers(fn, mesh, worker_axes(mesh)))
    lowered = program.lower(*jax.tree.map(spec, args))
    return comm_stats_of_compiled(lowered.compile(compiler_options))


def worker_specs(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``ShapeDtypeStruct``s of one worker's ``tree`` with a leading worker axis sharded over
    ``mesh`` (the worker layout, for compiling without allocating)."""
    n = mesh.devices.size
    sharding = NamedSharding(mesh, P(worker_axes(mesh)))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n, *np.shape(x)), x.dtype, sharding=sharding), tree
    )


@dataclasses.dataclass(frozen=True)
class KindTraffic:
    """What one step kind communicates, per worker and per step."""

    name: str
    sent_bytes: float
    launches: int
    collectives: tuple[str, ...]
    per_axis: tuple[tuple[str, float], ...] = ()  # ("node", bytes), ("local", bytes), ...


def traffic_per_kind(
    spec: OptimizerSpec,
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: jax.sharding.Mesh,
    first_steps: dict[int, int],
    args: Sequence[Any],
    compiled: jax.stages.Compiled | None = None,
) -> dict[int, KindTraffic]:
    """What each step kind sends: the training step (:func:`worker_step`) compiled once per
    kind, for the kind of the first step ``k`` of that kind, through
    :func:`comm_stats_on_workers`.

    The accounting programs are compiled with :data:`FAST_COMPILE` (XLA's backend (LLVM)
    optimisation off): they are never run, and the collectives are fixed by the HLO passes,
    which run as usual (checked: the same collectives and bytes either way). An optimizer with
    a single step kind needs no program of its own: pass the training step's ``compiled``
    executable and its HLO is read (:func:`comm_stats_of_compiled`).

    Args:
      spec, loss_fn, mesh: as for :func:`make_step`.
      first_steps: ``{kind: k}``, a step of each kind to account for.
      args: example ``(params, state, batch)`` in the worker layout (only shapes are used).
      compiled: optionally, the compiled training step (used when ``spec.schedule`` is
        ``None``).

    Returns:
      ``{kind: KindTraffic}``. Raises if a program holds a collective inside a branch or a
      loop, whose bytes could not be attributed to one step.
    """
    axes = worker_axes(mesh)
    out = {}
    for kind, k in sorted(first_steps.items()):
        if spec.schedule is None and compiled is not None:
            stats = comm_stats_of_compiled(compiled)
        else:
            step = worker_step(spec, loss_fn, axes, spec.kind(k))
            stats = comm_stats_on_workers(step, mesh, *args, compiler_options=FAST_COMPILE)
        for c in stats.collectives:
            if c.conditional or c.executions != 1:
                raise RuntimeError(
                    f"{spec.name}, step kind {spec.kind_names[kind]}: a collective in a branch "
                    f"or loop, cannot attribute its bytes:\n{stats.table()}"
                )
        out[kind] = KindTraffic(
            spec.kind_names[kind],
            stats.sent_bytes_per_device,
            stats.launches,
            tuple(f"{c.kind}[{','.join(c.dtypes)}]" for c in stats.collectives),
            tuple(
                ("+".join(names), sent) for names, sent in stats.sent_bytes_by_axes(mesh).items()
            ),
        )
    return out


def first_step_of_each_kind(kinds: Sequence[int]) -> dict[int, int]:
    """``{kind: first 1-based step of that kind}`` of a run's sequence of step kinds."""
    first: dict[int, int] = {}
    for k, kind in enumerate(kinds, start=1):
        first.setdefault(int(kind), k)
    return first


def bytes_per_step(kinds: Sequence[int], traffic: dict[int, KindTraffic]) -> np.ndarray:
    """Bytes each worker sent at each step of a run (float64, one entry per step)."""
    return np.asarray([traffic[int(kind)].sent_bytes for kind in kinds], dtype=np.float64)


def update_comm_stats(
    spec: OptimizerSpec,
    params: Any,
    num_workers: int | tuple[int, int],
    step: int | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> CommStats:
    """Compiles one optimizer update on ``num_workers`` workers (compile only) and reads its
    collectives (:func:`comm_stats_on_workers`).

    Only the update is compiled, no model: each worker gets gradients shaped like ``params``
    (averaged with a float32 ``pmean`` first if ``spec.average_grads``). With ``step=k`` the
    update is compiled for the kind of step ``k`` (a static hint), so the program holds that
    kind alone. ``spec.tx`` must be able to ``init`` outside the mapped context (build it with
    ``num_workers=N``).

    Args:
      spec: the optimizer (see :func:`zero_one_spec`, :func:`onebit_spec`).
      params: one worker's parameters (arrays or ``jax.ShapeDtypeStruct``).
      num_workers: ``N``; the mesh is the first ``N`` devices. A pair ``(nodes, local)``
        makes it a :func:`node_mesh` (build ``spec.tx`` with ``fast_axis_name="local"``).
      step: the 1-based step whose kind to compile, or ``None`` for the unhinted update.
      compiler_options: XLA options for the compile, e.g. :data:`FAST_COMPILE`.

    Returns:
      The :class:`optax_zero_one.integration.comm_stats.CommStats` of the optimised program.
    """
    mesh = mesh_of(num_workers)
    axes = worker_axes(mesh)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    state = jax.eval_shape(spec.tx.init, shapes)

    kind = None if step is None else spec.kind(step)

    def update(grads: Any, state: Any, params: Any) -> Any:
        if spec.average_grads:
            grads = jax.lax.pmean(jax.tree.map(lambda g: g.astype(jnp.float32), grads), axes)
        return spec.tx.update(grads, state, params, step_kind=kind)

    args = (worker_specs(shapes, mesh), worker_specs(state, mesh), worker_specs(shapes, mesh))
    return comm_stats_on_workers(update, mesh, *args, compiler_options=compiler_options)


def mean_comm_stats(tree: Any, num_workers: int, collective: str | None) -> CommStats:
    """What one call of a mean of ``tree`` over ``num_workers`` workers sends (compile only,
    :func:`comm_stats_on_workers`).

    ``collective``: ``"two_phase"`` or ``"psum"`` for :func:`optax_zero_one.onebit_mean` with that
    backend (from zero error buffers), ``None`` for a float ``lax.pmean``. ``tree`` is one
    worker's tree (``jax.ShapeDtypeStruct`` leaves); the mesh is the first ``N`` devices.
    """
    mesh = ozo.worker_mesh(AXIS, num_workers)
    if collective is None:
        return comm_stats_on_workers(
            lambda t: jax.lax.pmean(t, AXIS), mesh, worker_specs(tree, mesh)
        )
    tx = ozo.onebit_mean(AXIS, num_workers=num_workers, collective=collective)
    state = jax.eval_shape(tx.init, tree)
    return comm_stats_on_workers(
        tx.update, mesh, worker_specs(tree, mesh), worker_specs(state, mesh)
    )


def write_results(
    path: str | os.PathLike,
    result: Any,
    markdown: str,
    plot: Callable[[Any, pathlib.Path], None],
) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """Writes a benchmark's results: ``path`` (JSON), and the ``.png`` and ``.md`` beside it.

    ``plot(result, png_path)`` draws the figure; ``markdown`` is the report's text.

    Returns:
      The JSON, PNG and Markdown paths.
    """
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png, md = out.with_suffix(".png"), out.with_suffix(".md")
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    plot(result, png)
    md.write_text(markdown.rstrip("\n") + "\n")
    return out, png, md


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only ``Agg`` backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 110) -> None:
    """Lays out ``fig``, saves it to ``path`` and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def workers_axis(ax: Any, workers: Sequence[int]) -> None:
    """A log-scale x axis of worker counts, labelled at ``workers`` only."""
    ax.set_xscale("log")
    ax.set_xticks(list(workers), [str(n) for n in workers])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("workers N")


def node_split(text: str) -> tuple[int, int] | None:
    """``"NODESxLOCAL"`` (e.g. ``"2x4"``, any case) as ``(nodes, local)``, two positive integers;
    ``None`` for anything else (the caller says what it expected)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def argument_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``python -m module``; ``--help`` prints the module's docstring (what
    it measures and what it writes) above the options."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
