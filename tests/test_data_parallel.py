"""ozo.data_parallel: 0/1 Adam on the data axis of a mesh whose other axes stay automatic.

Checked: on a 1-D mesh the helper's step is bitwise the explicit ``shard_map`` worker loop; on a
``("data"=4, "model"=2)`` mesh the 1-bit collectives run over ``data`` only, the ``model`` axis
carries only the model's own collectives, model-sharded leaves (and their state) stay sharded,
and training follows the 1-D run of the same model; clear errors for bad input.
"""

import contextlib
import functools
import gc
import os
import pathlib
import re
import subprocess
import sys
import threading
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.jobs import data_parallel_worker as job
from support.jobs.data_parallel_worker import (
    SCHEDULE,
    SPECS,
    STEPS,
    batches,
    host_params,
    loss_fn,
    make_tx,
)

import optax_zero_one as ozo

AUTO = jax.sharding.AxisType.Auto
EXPLICIT = jax.sharding.AxisType.Explicit
MANUAL = jax.sharding.AxisType.Manual
N = 4


def mesh_of(model):
    return job.job_mesh(model)


def train_with_helper(mesh, steps=STEPS):
    run = job.train(mesh, steps)
    return run["dp"], run["tx"], run["params_w"], run["state"], run["losses"], run["step"]


@pytest.mark.parametrize("n", [N, 1])  # 1: one device (e.g. one GPU), where specs drop the axis
def test_one_d_mesh_is_bitwise_the_explicit_shard_map_loop(n):
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n])
    dp, tx, step, params = job.setup(mesh)
    assert not dp.model_sharded
    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    train = dp.jit(step)
    # today's explicit loop: ozo.on_workers over a 1-D worker mesh, batch split by hand
    ref_mesh = ozo.worker_mesh("data", n)
    ref_p = ozo.to_workers(ozo.replicate(host_params(), n), ref_mesh)
    ref_s = jax.jit(ozo.on_workers(make_tx().init, ref_mesh))(ref_p)
    ref_step = jax.jit(ozo.on_workers(step, ref_mesh))
    for x in batches(STEPS):
        params_w, state, loss = jax.block_until_ready(train(params_w, state, x))
        ref_p, ref_s, ref_loss = jax.block_until_ready(
            ref_step(ref_p, ref_s, ozo.to_workers(x.reshape(n, -1, 16), ref_mesh))
        )
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    for a, b in zip(jax.tree.leaves(params_w), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kinds = ozo.step_kinds(ozo.VarianceDoubling(6, 2), ozo.LocalStepDoubling(4, 2), STEPS)
    assert set(kinds.tolist()) == {0, 1, 2, 3}  # every kind was exercised


def test_one_program_per_kind_follows_the_in_graph_program():
    """dp.jit with the schedule (one program per kind, the step vmapped over the worker's
    one-entry block) against dp.jit deciding in the graph (the step on the block's entry).
    Whole steps (loss and gradients included) fuse differently in the two, so they round
    apart (measured over these 14 steps: up to 5e-6 relative, and 2e-6 before the vmap)."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    runs = {}
    for name, fn in (("in-graph", dp.jit(step)), ("dispatched", dp.jit(step, schedule=SCHEDULE))):
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        losses = []
        for x in batches(STEPS):
            p, s, loss = fn(p, s, x)
            losses.append(np.asarray(loss))
        runs[name] = (jax.tree.leaves(p), losses)
    assert len(runs["dispatched"][0]) == len(runs["in-graph"][0])
    for a, b in zip(*(runs[k][0] + runs[k][1] for k in runs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_step_that_does_not_forward_step_kind_runs_in_graph_with_a_warning():
    """dp.jit(step, schedule=...) runs the step under vmap over the worker's one-entry block,
    for programs of one kind. A step that takes step_kind but does not pass it to the update
    made the update decide in the graph under that vmap, which JAX could not batch (a trial:
    ``pvary is a invariant->variant collective`` from deep inside the compressor). It now runs
    on the block's entry, as dp.jit without a schedule does (the same steps, bitwise), and a
    warning says to forward step_kind; so does ``on_workers(..., batched=True)``."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)

    def forgets(p, s, x, step_kind=None):
        return step(p, s, x)  # the hint is dropped: the update decides in the graph

    def run(fn):
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        for x in batches(STEPS):
            p, s, _ = fn(p, s, x)
        return jax.tree.leaves((p, s))

    with pytest.warns(UserWarning, match="forward the step_kind"):
        dropped = run(dp.jit(forgets, schedule=SCHEDULE))
    for a, b in zip(dropped, run(dp.jit(step)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # the update inside the user's own jax.jit: traced on the row at the first kind, jit's
    # cache then served that trace to the next kind's vmap, where no switch ran to raise (a
    # review: the first sync step failed with the pvary error)
    apply = jax.jit(lambda g, s, p: tx.update(g, s, p))

    def cached(p, s, x, step_kind=None):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = apply(g, s, p)
        return optax.apply_updates(p, u), s, loss

    with pytest.warns(UserWarning, match="forward the step_kind"):
        run(dp.jit(cached, schedule=SCHEDULE))

    workers = ozo.worker_mesh("data", N)
    opt = make_tx()

    def worker_step(p, s, x):
        _, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def on_rows(batched):
        p = ozo.to_workers(ozo.replicate(host_params(), N), workers)
        s = jax.jit(ozo.on_workers(opt.init, workers))(p)
        fn = jax.jit(ozo.on_workers(worker_step, workers, batched=batched))
        for x in batches(STEPS):
            p, s = fn(p, s, x.reshape(N, -1, *x.shape[1:]))
        return jax.tree.leaves((p, s))

    with pytest.warns(UserWarning, match="no step_kind"):
        batched = on_rows(True)
    for a, b in zip(batched, on_rows(False), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _layout_checks(monkeypatch, dp):
    """A list that records the ``what`` of every ``dp.check_worker_layout`` call from now on."""
    checked = []
    real = type(dp).check_worker_layout
    monkeypatch.setattr(
        type(dp), "check_worker_layout", lambda self, *a: checked.append(a[1]) or real(self, *a)
    )
    return checked


def test_a_loop_passing_back_its_outputs_is_checked_once(monkeypatch):
    """The first call's arguments are checked in Python and compiled for; later calls run that
    executable, which checks shapes, dtypes and shardings itself: no Python check per step. An
    argument unlike the first's still gets the clear error."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    checked = _layout_checks(monkeypatch, dp)
    train = dp.jit(step)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    checked.clear()
    for x in batches(5):
        p, s, _ = train(p, s, x)
    assert checked == ["params", "opt_state"]  # the first call's only
    with pytest.raises(ValueError, match="params is not in the worker layout"):
        train(params, s, x)


def test_precompiled_kinds_run_the_same_steps():
    """dp.jit's dispatcher precompiled (every kind up front, from the arrays' shardings) runs
    the precompiled executables and gives the bits of the same programs compiled lazily."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    runs = {}
    for name in ("lazy", "precompiled", "in the background"):
        train = dp.jit(step, schedule=SCHEDULE)
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        xs = list(batches(STEPS))
        if name == "precompiled":
            assert sorted(train.precompile(p, s, xs[0])) == sorted(SCHEDULE.names)
        elif name == "in the background":
            done = train.precompile_in_background(p, s, xs[0])
        for x in xs:
            p, s, loss = train(p, s, x)
        runs[name] = jax.tree.leaves((p, s, loss))
        if name != "lazy":
            assert all(raw.compiled is not None for raw in train._raw.values())
    assert sorted(done.result()) == sorted(SCHEDULE.names)
    for run in ("precompiled", "in the background"):
        for a, b in zip(runs["lazy"], runs[run], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("helper", ["dp.jit", "ozo.on_workers"])
def test_a_kinds_program_writes_the_params_in_place(helper):
    """XLA:CPU copies a donated input that a kernel reads through a reshape: stepping on the
    worker block's entry, every kind's program copied every parameter leaf out; under vmap
    (dp.jit with a schedule, ``ozo.on_workers(..., batched=True)``) no program copies a
    parameter-sized buffer."""
    if helper == "dp.jit":
        mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
        dp, tx, _, params = job.setup(mesh)
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        lifted = dp._on_workers
    else:
        mesh = ozo.worker_mesh("data", N)
        tx = make_tx()
        p = ozo.to_workers(ozo.replicate(host_params(), N), mesh)
        s = jax.jit(ozo.on_workers(tx.init, mesh))(p)

        def lifted(fn, batched):
            return ozo.on_workers(fn, mesh, batched=batched)

    shares = jnp.zeros((N, 8, 16), jnp.float32)
    # a device's block of each leaf, as the compiled program's shapes print it
    sizes = {str([1, *np.shape(x)[1:]]).replace(" ", "") for x in jax.tree.leaves(p)}

    def copies(kind, batched):
        def step(p, s, x):
            _, g = jax.value_and_grad(loss_fn)(p, x)
            u, s = tx.update(g, s, p, step_kind=kind)
            return optax.apply_updates(p, u), s

        fn = jax.jit(lifted(step, batched), donate_argnums=(0, 1))
        hlo = fn.lower(p, s, shares).compile().as_text()
        entry = hlo[hlo.index("ENTRY") :]
        return [
            line
            for line in entry.splitlines()
            if " copy(" in line and any(f"f32{shape}" in line for shape in sizes)
        ]

    for kind in SCHEDULE.kinds:
        assert copies(kind, True) == [], kind.name
    local = SCHEDULE.kinds[SCHEDULE.names.index("local")]
    assert copies(local, False)  # what the vmap avoids


@pytest.fixture(scope="module")
def two_d():
    return train_with_helper(mesh_of(2))


def test_two_d_mesh_compresses_over_data_only_and_never_gathers_a_model_shard(two_d):
    dp, tx, params_w, state, losses, train = two_d
    mesh = dp.mesh
    x = batches(1)[0]
    stats = ozo.comm_stats(train, params_w, state, x)
    seen = {"data": [], "model": []}
    for c in stats.collectives:  # each collective's mesh axes, from its replica groups
        axes = c.mesh_axes(mesh)
        assert axes in (("data",), ("model",)), f"a collective over neither axis: {c}"
        seen[axes[0]].append((c.kind, c.dtypes))
    # the 1-bit collectives: over data only
    assert ("all-to-all", ("u8",)) in seen["data"] and ("all-gather", ("u8",)) in seen["data"]
    assert all("u8" not in dtypes for _, dtypes in seen["model"])
    # over model: only the model's own all-reduces (partial sums of h @ w2; the finite flag)
    assert {kind for kind, _ in seen["model"]} == {"all-reduce"}
    model = [c for c in stats.collectives if c.group_size == 2]
    assert sum(c.payload_bytes for c in model) <= 4 * 8 * 4 + 8  # activations (8 x 4) + flags
    # the float mean on variance steps carries this device's shards only: w1, w2 halved, b
    layout = ozo.core.flat.Layout.of(
        {"w1": np.zeros((16, 16)), "w2": np.zeros((16, 4)), "b": np.zeros(4)}, N
    )
    floats = [c for c in stats.collectives if c.group_size == N and c.dtypes == ("f32",)]
    assert [c.payload_bytes for c in floats] == [4 * N * layout.width]


def test_two_d_dispatched_programs_copy_the_counter_out_without_a_collective():
    """dp.jit with a schedule returns each step's counters from the step's own program (the
    dispatcher's check that the state took the step): computed where the counters live, it
    adds no collective to any kind's program, not even over the model axis the counter is
    sharded on; the dispatcher then learns every step was taken."""
    dp, tx, step, params = job.setup(mesh_of(2))
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    train = dp.jit(step, schedule=SCHEDULE)
    xs = batches(STEPS)
    for x in xs:
        p, s, _ = train(p, s, x)
    train.settle()
    assert (train.step, train.skipped, train.lost) == (STEPS + 1, 0, 0)
    in_graph = ozo.comm_stats(dp.jit(step), p, s, xs[0]).collectives
    assert len(train._raw) == 4  # the programs as the dispatcher calls them, counts included
    for name, program in train._raw.items():
        stats = ozo.comm_stats(program, p, s, xs[0])
        model = [c for c in stats.collectives if c.mesh_axes(dp.mesh) == ("model",)]
        assert {(c.kind, c.dtypes) for c in model} == {
            ("all-reduce", ("f32",)),
            ("all-reduce", ("pred",)),
        }, name
        assert len(model) == len([c for c in in_graph if c.mesh_axes(dp.mesh) == ("model",)])


@pytest.mark.parametrize("model", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_workers_that_start_apart_are_caught_once_local_steps_begin(model):
    """Params that are not the same on every worker (e.g. initialised with a key per worker)
    train apart for good while every step succeeds; the dispatcher compares the workers'
    synchronised points once, at its first check after local steps begin, and raises. The same
    run from replicated params is not stopped."""
    dp, tx, step, params = job.setup(mesh_of(model))
    rows = jnp.arange(N, dtype=jnp.float32)

    def run(params_w):
        state = dp.init(tx, params_w)
        train = dp.jit(step, schedule=SCHEDULE)
        for x in batches(STEPS):
            params_w, state, _ = train(params_w, state, x)
        train.settle()

    run(dp.to_workers(params))
    apart = jax.tree.map(
        lambda x: x + 1e-3 * rows.reshape(N, *[1] * (x.ndim - 1)), dp.to_workers(params)
    )
    first_b = next(k for k in range(1, STEPS + 1) if not SCHEDULE.kind(k).phase_a)
    apart_at = r"train apart: LocalStepSyncState.anchor.* worker 0 and worker 1 at step (\d+)"
    with pytest.raises(ValueError, match=apart_at) as caught:
        run(apart)
    at = int(re.search(apart_at, str(caught.value)).group(1))
    assert first_b <= at < first_b + 8  # at its first check in phase B


def _with_running_mean(tx, schedule):
    """A step that passes the optimizer ``params["net"]`` and keeps beside it a batch norm's
    running mean, each worker's own (not averaged): a run of 12 steps from given params, and
    the params in the worker layout (made anew at each call: a run donates them)."""
    rng = np.random.default_rng(0)
    net = {
        "w1": jnp.asarray(0.3 * rng.standard_normal((16, 32)), jnp.float32),
        "w2": jnp.asarray(0.3 * rng.standard_normal((32, 4)), jnp.float32),
    }
    dp = ozo.data_parallel(mesh_of(1), {"net": net, "bn_mean": jnp.zeros((32,))})
    tx = dp.optimizer(tx)

    def step(p, s, x, step_kind=None):
        def loss_fn(net):
            h = x @ net["w1"]
            mu = jnp.mean(h, axis=0)  # this worker's statistics, not averaged
            return jnp.mean((jnp.tanh(h - mu) @ net["w2"] - 1.0) ** 2), mu

        (loss, mu), g = jax.value_and_grad(loss_fn, has_aux=True)(p["net"])
        u, s = tx.update(g, s, p["net"], step_kind=step_kind)
        new = {"net": optax.apply_updates(p["net"], u), "bn_mean": 0.9 * p["bn_mean"] + 0.1 * mu}
        return new, s, loss

    def run(params_w):
        state = dp.init(tx, params_w["net"])
        train = dp.jit(step, schedule=schedule)
        for x in batches(12):
            params_w, state, _ = train(params_w, state, x)
        train.settle()
        return params_w

    return run, lambda: dp.to_workers({"net": net, "bn_mean": jnp.zeros((32,))})


def test_one_bit_adam_workers_apart_are_caught_and_their_own_statistics_are_not():
    """1-bit Adam averages every step, so its params are alike on every worker: the dispatcher
    compares them at its first check (there is no synchronised point to compare). Only the
    leaves the optimizer updates: a review found the first version refusing a batch norm's
    running mean that each worker keeps beside them, which is correct training."""
    onebit = ozo.onebit_adam(1e-2, axis_name="data", freeze_step=4)
    run, fresh = _with_running_mean(onebit, ozo.onebit_schedule(4))
    with pytest.warns(UserWarning, match=r"the params \['bn_mean'\] learn from each worker's"):
        stats = np.asarray(run(fresh())["bn_mean"])  # warned, as each worker's own: ignore it
    assert np.abs(stats - stats[:1]).max() > 0  # the workers' own statistics, apart
    rows = jnp.arange(N, dtype=jnp.float32).reshape(N, 1, 1)
    params_w = fresh()
    params_w["net"]["w2"] = params_w["net"]["w2"] + 1e-3 * rows
    with pytest.raises(ValueError, match=r"train apart: the params\['net'\]\['w2'\] .* at step 8"):
        run(params_w)


def test_zero_one_adams_params_check_names_a_leaf_the_optimizer_was_not_given():
    """0/1 Adam's check after a sync reads every float leaf of the params (it is there for a
    leaf optax.masked passes through, which is not the optimizer's either), so it stops the
    same step: its error now says that the leaf is not among the optimizer's and what to do
    if it holds each worker's own values (a review: it only listed wrappers and masks)."""
    built = dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=4, local_step_clipper=2)
    zero_one = ozo.zero_one_adam(1e-2, axis_name="data", **built)
    run, fresh = _with_running_mean(zero_one, ozo.zero_one_schedule(**built))
    with pytest.raises(ValueError, match="params differ") as caught:
        run(fresh())
    assert "['bn_mean'] is not among the leaves the optimizer was given" in str(caught.value)
    assert "running statistics" in str(caught.value)


def test_a_mismatch_found_by_one_process_stops_every_process(monkeypatch):
    """A process whose own workers hold different values raised alone; the other processes,
    whose first workers' digests agreed, went on and were killed by the coordination service
    (a review). The gather now carries each process's own finding, so every process raises.
    Two processes simulated: this one (workers alike) and one that found its own apart."""
    dp, tx, step, params = job.setup(mesh_of(1))
    state = dp.init(tx, dp.to_workers(params))
    counter = ozo.core._graph.step_counter(state)
    gathered = []

    def host_allgather(values):  # process 1: the same digests, its own workers apart
        theirs = np.array(values)
        theirs[..., -1] = 1
        gathered.append(values)
        return np.stack([values, theirs])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(ozo.integration.distributed, "host_allgather", host_allgather)
    agree = ozo.integration.dispatch.check_workers_agree
    with pytest.raises(
        ValueError, match=r"train apart: .* differs between the workers of process 1"
    ):
        agree(state, counter, 8, True, dp.to_workers(params))
    assert len(gathered) == 1


def test_the_first_leaf_that_differs_is_named_past_the_first_window(monkeypatch):
    """An argument's leaves are compared across processes in windows of 512 digests; the first
    version gathered one window only, and a model of 600 leaves whose last leaf differed by
    process was reported as "600 and 600 leaves" (a review). Two processes simulated."""
    mine = [f"['layer_{i:03d}']:(4, 8, 8):float32" for i in range(600)]
    theirs = [*mine[:-1], "['layer_599']:(4, 8, 9):float32"]
    calls = []

    def host_allgather(values):  # process 1 answers with the same calls on its own leaves
        if len(calls) == 0:
            other = np.asarray([len(theirs)], np.int32)
        else:
            start = 512 * (len(calls) - 1)
            digests = [ozo.integration.dispatch._digest(x.encode()) for x in theirs[start:][:512]]
            other = np.zeros(512, np.int32)
            other[: len(digests)] = digests
        calls.append(values)
        return np.stack([values, other])

    monkeypatch.setattr(ozo.integration.distributed, "host_allgather", host_allgather)
    found = ozo.integration.dispatch._first_leaf_apart(mine, 1)
    assert found == (
        " in structure, shapes or dtypes, first at leaf 599 (here ['layer_599']: (4, 8, 8) float32)"
    )
    assert len(calls) == 3  # the counts, then two windows


def test_tree_map_params_on_a_model_sharded_state(two_d):
    """optax.tree_map_params (how frameworks derive the state's shardings) on dp.optimizer's
    state of model-sharded params: it initialised with optax's placeholder for the params and
    said the DataParallel had been built from other params."""
    dp, tx, params_w, state, _, _ = two_d
    assert dp.model_sharded and ozo.core._graph.nodes_of(
        state, ozo.integration.workers.ShardLocalState
    )
    marked = optax.tree_map_params(
        tx, lambda p: "param", state, transform_non_params=lambda x: "other"
    )
    assert len(jax.tree.leaves(marked)) == len(jax.tree.leaves(state))
    jax.tree.map(lambda mark, x: None, marked, state)  # a prefix of the state, as shardings are


def test_reset_compression_without_the_helper_refuses_a_model_sharded_state_clearly(two_d):
    """Plain reset_compression cannot cut the params into dp.optimizer's model shards (it has
    no specs): it says which call can (it said the move was not supported, before
    dp.reset_compression existed)."""
    dp, tx, params_w, state, _, _ = two_d
    with pytest.raises(ValueError, match=r"model-sharded mesh .* dp.reset_compression\(params"):
        ozo.reset_compression(params_w, state, state)


def _mesh(data, model):
    auto = (AUTO, AUTO)
    devices = jax.devices()[: data * model]
    return jax.make_mesh((data, model), ("data", "model"), axis_types=auto, devices=devices)


def _shard_by_hand(tree, s, shards=2):
    """Model shard ``s``'s block of each leaf, as SPECS shard it (w1's columns, w2's rows, b
    whole), cut here by hand: the reference for the helper's own cutting."""
    w1, w2 = tree["w1"], tree["w2"]
    c, r = w1.shape[-1] // shards, w2.shape[-2] // shards
    return {
        "w1": w1[..., s * c : (s + 1) * c],
        "w2": w2[..., s * r : (s + 1) * r, :],
        "b": tree["b"],
    }


def test_dp_reset_compression_moves_a_model_sharded_state_to_fewer_data_workers(two_d, tmp_path):
    """An elastic restart of a model-sharded run: 0/1 Adam's state saved with Orbax on
    ("data"=4, "model"=2) in the middle of a local-step interval, restored as host arrays into
    dp.state_target's structure (built without the old mesh), moved onto (2, 2). Each model
    shard's state is moved exactly as reset_compression moves a state of its own (the
    reference, on blocks cut by hand); every new worker starts at the saved run's last
    synchronised point; the run goes on through the dispatcher, whose checks compare the
    workers' synchronised points."""
    ocp = pytest.importorskip("orbax.checkpoint")
    dp, tx, params_w, state, _, _ = two_d
    assert SCHEDULE.kind(STEPS + 1).name == "local"  # saved between two syncs
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "saved", (params_w, state))
    checkpointer.wait_until_finished()
    dp2, tx2, step2, params2 = job.setup(_mesh(2, 2))
    target = dp2.state_target(make_tx(num_workers=N), params2, N)
    host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target)
    host_params_w, host_state = checkpointer.restore(tmp_path / "saved", host)
    assert jax.tree.structure(host_state) == jax.tree.structure(state)
    fresh = dp2.init(tx2, dp2.to_workers(params2))
    moved_params, moved = dp2.reset_compression(host_params_w, host_state, fresh)

    point = jax.tree.map(np.asarray, dp.synchronized_params(params_w, state))
    for worker in range(2):
        row = jax.tree.map(lambda x, w=worker: x[w], moved_params)
        jax.tree.map(np.testing.assert_array_equal, row, point)
    for s in range(2):
        shard = lambda tree, s=s: jax.tree.map(lambda x: np.asarray(x)[:, s], tree)  # noqa: E731
        ref_params, ref_state = ozo.reset_compression(
            _shard_by_hand(host_params_w, s), shard(host_state.inner), shard(fresh.inner)
        )
        got = shard(moved.inner)
        assert jax.tree.structure(got) == jax.tree.structure(ref_state)
        jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, ref_state))
        jax.tree.map(
            np.testing.assert_array_equal,
            _shard_by_hand(jax.tree.map(np.asarray, moved_params), s),
            jax.tree.map(np.asarray, ref_params),
        )
    for x, f in zip(jax.tree.leaves(moved), jax.tree.leaves(fresh), strict=True):
        assert x.sharding == f.sharding and x.shape == f.shape

    train = dp2.jit(step2, schedule=SCHEDULE)
    for x in batches(8):
        moved_params, moved, loss = train(moved_params, moved, x)
        assert np.all(np.isfinite(np.asarray(loss)))
    counters = ozo.core._graph.step_counter(jax.tree.map(lambda x: x[0], moved))
    assert np.all(np.asarray(counters) == STEPS + 8)


def test_dp_reset_compression_on_a_one_d_mesh_places_the_params_on_it():
    """Without model axes dp.reset_compression is reset_compression, with the params placed on
    the helper's mesh in its worker layout (reset_compression alone places them like the
    state's first leaf)."""
    one_d = (
        lambda n: jax.make_mesh(  # noqa: E731
            (n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n]
        )
    )
    run = job.train(one_d(4), 11)
    saved = jax.tree.map(np.asarray, (run["params_w"], run["state"]))
    dp2, tx2, step2, params2 = job.setup(one_d(2))
    fresh = dp2.init(tx2, dp2.to_workers(params2))
    target = dp2.state_target(make_tx(num_workers=4), params2, 4)  # what a restore reads into
    assert jax.tree.structure(target) == jax.tree.structure(saved)
    shapes = lambda tree: [(np.shape(x), x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert shapes(target) == shapes(saved)
    params_w, state = dp2.reset_compression(*saved, fresh)
    want_params, want_state = ozo.reset_compression(*saved, fresh)
    jax.tree.map(np.testing.assert_array_equal, (params_w, state), (want_params, want_state))
    for x in jax.tree.leaves(params_w):
        assert x.sharding.is_equivalent_to(NamedSharding(dp2.mesh, P("data")), x.ndim)
    point = run["dp"].synchronized_params(run["params_w"], run["state"])
    jax.tree.map(np.testing.assert_array_equal, dp2.synchronized_params(params_w, state), point)


def test_dp_reset_compression_moves_bfloat16_params_with_a_scalar_leaf():
    """A bfloat16 model with a scalar leaf (a learned scale) crashed the move: the shards'
    synchronised blocks were written into a 0-d bfloat16 host array as JAX arrays, which
    NumPy refuses ("expected number"; a review). Moved after 3 steps, every new worker starts
    at the saved run's synchronised point."""
    specs = {"w": P(None, "model"), "s": P()}
    host = {"w": np.linspace(-1, 1, 16 * 8).reshape(16, 8), "s": np.asarray(1.5)}
    host = jax.tree.map(lambda x: x.astype(jnp.bfloat16), host)

    def build(mesh):
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
        dp = ozo.data_parallel(mesh, params)
        tx = dp.optimizer(make_tx())

        def step(p, s, x, step_kind=None):
            loss = lambda p: jnp.mean((x @ p["w"].astype(jnp.float32) * p["s"]) ** 2)  # noqa: E731
            u, s = tx.update(jax.grad(loss)(p), s, p, step_kind=step_kind)
            return optax.apply_updates(p, u), s, None

        return dp, tx, step, params

    dp, tx, step, params = build(_mesh(4, 2))
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    train = dp.jit(step, schedule=SCHEDULE)
    for x in batches(3):
        p, s, _ = train(p, s, x)
    dp2, tx2, _, params2 = build(_mesh(2, 2))
    moved, state = dp2.reset_compression(
        *jax.tree.map(np.asarray, (p, s)), dp2.init(tx2, dp2.to_workers(params2))
    )
    point = jax.tree.map(np.asarray, dp.synchronized_params(p, s))
    jax.tree.map(np.testing.assert_array_equal, dp2.synchronized_params(moved, state), point)
    assert moved["s"].dtype == jnp.bfloat16 and moved["s"].shape == (2,)


def test_state_target_is_what_the_saved_run_wrote_and_checks_its_worker_count(two_d):
    """dp.state_target builds, without the saved run's mesh, the structure and shapes of its
    params and state: for dp.optimizer's state alone and for the optimizer as given to
    dp.init with a clip chained before dp.optimizer (a review: only the first was built); a
    tx built for another worker count than num_workers is refused (Orbax failed later, its
    hint the strict=False that the docs forbid); so are params in the worker layout."""
    dp, _, params_w, _, _, _ = two_d
    dp2, _, _, params2 = job.setup(_mesh(2, 2))

    def clipped(helper, **built):
        return optax.chain(optax.clip_by_global_norm(1.0), helper.optimizer(make_tx(**built)))

    shapes = lambda tree: [(np.shape(x), x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    for old_tx, new_tx in (
        (dp.optimizer(make_tx()), make_tx(num_workers=N)),
        (clipped(dp), clipped(dp2, num_workers=N)),
    ):
        saved = jax.eval_shape(lambda p, t=old_tx: (p, dp.init(t, p)), params_w)
        target = dp2.state_target(new_tx, params2, N)
        assert jax.tree.structure(target) == jax.tree.structure(saved)
        assert shapes(target) == shapes(saved)
    with pytest.raises(ValueError, match="tx was built for 4 workers, but num_workers=2"):
        dp2.state_target(make_tx(num_workers=N), params2, 2)
    with pytest.raises(ValueError, match="in the worker layout"):
        dp2.state_target(make_tx(num_workers=N), dp2.to_workers(params2), N)


def test_dp_reset_compression_refuses_model_axes_of_another_size(two_d):
    """The model shards' blocks and scales follow the model axes: a state of 2 model shards
    onto a mesh of 4 is refused, naming both counts, before anything is moved."""
    dp, tx, params_w, state, _, _ = two_d
    dp4, tx4, _, params4 = job.setup(_mesh(2, 4))
    fresh = dp4.init(tx4, dp4.to_workers(params4))
    with pytest.raises(
        ValueError,
        match=r"holds 2 model shards, this mesh 4 \(the product of \('model',\)\): the model",
    ):
        dp4.reset_compression(params_w, state, fresh)


def test_two_d_mesh_keeps_params_and_state_sharded(two_d):
    dp, tx, params_w, state, losses, train = two_d
    for name, spec in SPECS.items():
        want = NamedSharding(dp.mesh, P("data", *spec))
        assert params_w[name].sharding.is_equivalent_to(want, params_w[name].ndim), name

    def bytes_on_device0(tree):
        d0 = jax.devices()[0]
        return sum(
            s.data.nbytes
            for x in jax.tree.leaves(tree)
            for s in x.addressable_shards
            if s.device == d0
        )

    one_d = train_with_helper(mesh_of(1), steps=1)
    # model-sharded leaves hold half their params and state per device on the 2-D mesh
    numel = sum(x.size for x in host_params().values())
    local = 16 * 16 + 16 * 4 + 4
    assert bytes_on_device0(params_w) == 4 * local
    assert bytes_on_device0(one_d[2]) == 4 * numel
    state_2d, state_1d = bytes_on_device0(state), bytes_on_device0(one_d[3])
    assert state_2d < 0.6 * state_1d
    assert state_2d / (4 * local) < 6  # m, v, anchor, error buffers: a few words per element


def test_two_d_training_follows_the_one_d_run_and_eval_params_are_in_the_user_layout(two_d):
    dp, tx, params_w, state, losses, train = two_d
    one_d = train_with_helper(mesh_of(1))[4]
    assert losses[-1] < 0.5 * losses[0] and one_d[-1] < 0.5 * one_d[0]
    # the same until the first compressed update shows (the 2-D run scales each model shard
    # of a leaf on its own), then the same course
    np.testing.assert_allclose(losses[:3], one_d[:3], rtol=1e-5)
    assert np.mean(losses[-6:]) == pytest.approx(np.mean(one_d[-6:]), rel=0.15)
    evaluated = dp.synchronized_params(params_w, state)
    for name, spec in SPECS.items():
        assert evaluated[name].shape == host_params()[name].shape
        assert evaluated[name].sharding.is_equivalent_to(
            NamedSharding(dp.mesh, spec), evaluated[name].ndim
        )
    # after the last step, a sync, every data worker is on the anchor up to the rounding of
    # x + (anchor - x), and the anchor is what synchronized_params returns
    for name in SPECS:
        rows = np.asarray(params_w[name])
        ulp = np.finfo(np.float32).eps * np.abs(rows).max()
        assert np.abs(rows - rows[0]).max() <= 4 * ulp, name
        np.testing.assert_allclose(np.asarray(evaluated[name]), rows[0], rtol=0, atol=4 * ulp)
    back = dp.to_workers(dp.from_workers(params_w))  # worker 0's copy, on every worker
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params_w), strict=True):
        rows = np.asarray(a)
        assert all(np.array_equal(r, np.asarray(b)[0]) for r in rows)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_the_layout_helpers_compile_once(two_d):
    """dp.synchronized_params and dp.from_workers wrapped a fresh jax.jit at every call, so
    each evaluation of a loop compiled anew (~0.6 s on the example's model; a trial). Each is
    one program now, compiled once per shape; the results are the same. The programs kept do
    not hold the helper (a review: a cycle left a used helper to the cyclic GC), and dp.init,
    called once a run, keeps none (a review: a new optimizer per call was kept for good)."""
    dp, tx, params_w, state, losses, train = two_d
    first = dp.synchronized_params(params_w, state)
    for _ in range(3):
        again = dp.synchronized_params(params_w, state)
        dp.from_workers(params_w)
        dp.from_workers(params_w, worker=1)
        dp.init(tx, params_w)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    programs = dp._programs.values()
    assert len(programs) == 3  # synchronized_params, from_workers for 2 workers
    assert all(program._cache_size() == 1 for program in programs)
    fresh = ozo.data_parallel(dp.mesh, job.setup(dp.mesh)[3])
    fresh.synchronized_params(params_w, state)
    fresh.from_workers(params_w)
    alive = weakref.ref(fresh)
    gc.disable()
    try:
        del fresh
        assert alive() is None  # freed by reference counting
    finally:
        gc.enable()


def test_a_scan_over_steps_inside_the_step_on_a_model_sharded_mesh():
    """Several optimizer steps per call, a lax.scan carrying the state, in-graph: the state out
    of dp.optimizer was typed as not varying over the data axis (the nested per-shard program
    drops the type), and scan refused the carry (a new-user trial). The same steps as one call
    each."""
    mesh = mesh_of(2)
    dp, tx, step, params = job.setup(mesh)

    def steps(p, s, xs):  # xs: (rows, steps, features), the rows split over the workers
        def one(carry, x):
            p, s, _ = step(*carry, x)
            return (p, s), None

        (p, s), _ = jax.lax.scan(one, (p, s), jnp.swapaxes(xs, 0, 1))
        return p, s, None

    params_w = dp.to_workers(params)
    xs = np.stack(batches(), axis=1)
    params_w, state, _ = dp.jit(steps)(params_w, dp.init(tx, params_w), xs)
    assert ozo.step_count(state) == STEPS
    one_by_one = job.train(mesh)
    got = dp.synchronized_params(params_w, state)
    want = one_by_one["dp"].synchronized_params(one_by_one["params_w"], one_by_one["state"])
    for name in SPECS:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), atol=1e-6)


def test_gradient_accumulation_over_micro_batches_with_a_varying_carry():
    """docs/jit.md: a scan accumulating micro-batch gradients from a carry of constants fails
    under dp.jit (shard_map's varying types; a trial), and the documented start, the carry
    made varying with lax.pcast, gives the whole batch's step: 4 micro-batches of a worker's
    8 rows, averaged, against one step on the 8."""
    mesh = mesh_of(2)
    dp, tx, step, params = job.setup(mesh)

    def accumulated(p, s, x, step_kind=None):
        def one(carry, xb):
            loss, g = jax.value_and_grad(loss_fn)(p, xb)
            return jax.tree.map(jnp.add, carry, (loss, g)), None

        zero = jax.lax.pcast(jnp.zeros(()), ("data",), to="varying")
        start = (zero, jax.tree.map(jnp.zeros_like, p))
        (loss, g), _ = jax.lax.scan(one, start, x.reshape(4, -1, x.shape[-1]))
        u, s = tx.update(jax.tree.map(lambda a: a / 4, g), s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s, loss / 4

    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    x = batches(1)[0]
    want = dp.jit(step, donate=False)(params_w, state, x)
    got = dp.jit(accumulated, donate=False)(params_w, state, x)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_flax_nnx_optimizer_in_the_step():
    mesh = mesh_of(2)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.w1 = nnx.Param(0.3 * jax.random.normal(rngs.params(), (16, 32)))
            self.w2 = nnx.Param(0.3 * jax.random.normal(rngs.params(), (32, 4)))

        def __call__(self, x):
            return jnp.tanh(x @ self.w1[...]) @ self.w2[...]

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, SPECS[path[0].key])), params
    )
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(make_tx())

    def new_optimizer(p):
        return nnx.state(nnx.Optimizer(nnx.merge(graphdef, p), tx, wrt=nnx.Param))

    def step(p, opt_state, x):
        model = nnx.merge(graphdef, p)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx.update(optimizer, opt_state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state(model, nnx.Param), nnx.state(optimizer), loss

    def functional_step(p, opt_state, x):  # the same with tx.update, as a reference
        model = nnx.merge(graphdef, p)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    def run(step, opt_state):
        params_w, losses = dp.to_workers(params), []
        train = dp.jit(step)
        for x in batches(STEPS):
            params_w, opt_state, loss = jax.block_until_ready(train(params_w, opt_state, x))
            losses.append(float(np.mean(np.asarray(loss))))
        return params_w, losses, opt_state

    params_w, losses, nnx_state = run(
        step, jax.jit(dp.on_workers(new_optimizer))(dp.to_workers(params))
    )
    _, reference, _ = run(functional_step, dp.init(tx, dp.to_workers(params)))
    # nnx.state keeps the optimizer's state as plain mappings: the helpers that read it refuse
    # it (they returned worker 0's unsynchronised params), pointing to the functional recipe
    with pytest.raises(ValueError, match="Flax NNX State .*optimizer.opt_state"):
        dp.synchronized_params(params_w, nnx_state)
    for helper in (ozo.step_count, ozo.check_hints):
        with pytest.raises(ValueError, match="Flax NNX State"):
            helper(nnx_state)
    np.testing.assert_allclose(losses, reference, rtol=1e-6)
    assert losses[-1] < 0.8 * losses[0]
    want = NamedSharding(mesh, P("data", None, "model"))
    assert params_w["w1"].sharding.is_equivalent_to(want, 3)


def test_bad_input_is_refused_with_the_fix():
    mesh = mesh_of(2)
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), host_params(), SPECS
    )
    with pytest.raises(ValueError, match="no data axis 'batch'.*data_axis="):
        ozo.data_parallel(mesh, params, data_axis="batch")
    with pytest.raises(ValueError, match=r"not \['gpu'\] of data_axis=\('data', 'gpu'\)"):
        ozo.data_parallel(mesh, params, data_axis=("data", "gpu"))
    with pytest.raises(ValueError, match=r"a tuple \(slow, fast\) of two"):
        ozo.data_parallel(mesh, params, data_axis=["data", "model"])
    for bad in (("data", "data"), ("data", "model", "data")):
        with pytest.raises(ValueError, match="one mesh axis, or on a pair of two different axes"):
            ozo.data_parallel(mesh, params, data_axis=bad)
    manual = jax.make_mesh((N, 2), ("data", "model"), axis_types=(MANUAL, AUTO))
    with pytest.raises(ValueError, match=r"axes \{'data': 'Manual'\} are neither Auto nor Expl"):
        ozo.data_parallel(manual, host_params())
    mixed = jax.make_mesh((N, 2), ("data", "model"), axis_types=(EXPLICIT, AUTO))
    with pytest.raises(ValueError, match=r"data axes \('data', 'model'\) are typed.*one type"):
        ozo.data_parallel(mixed, host_params(), data_axis=("data", "model"))
    with pytest.raises(ValueError, match="sharded over the data axis 'data'"):
        ozo.data_parallel(mesh, {**SPECS, "b": P("data")})
    dp = ozo.data_parallel(mesh, params)
    with pytest.raises(ValueError, match=r"wrap the optimizer with dp.optimizer\(tx\)"):
        dp.init(make_tx(), dp.to_workers(params))
    tx = dp.optimizer(make_tx())
    with pytest.raises(ValueError, match=r"not in the worker layout.*dp.to_workers\(params\)"):
        dp.init(tx, params)
    # the optax way to plan shardings, outside the helper's programs (JAX: "shard_map requires
    # a non-empty mesh")
    with pytest.raises(ValueError, match=r"jax.eval_shape\(lambda p: dp.init\(tx, p\), params_w"):
        jax.eval_shape(tx.init, dp.to_workers(params))
    assert jax.eval_shape(lambda p: dp.init(tx, p), dp.to_workers(params)) is not None

    def step(p, s, x):
        u, s = tx.update(jax.grad(loss_fn)(p, x), s, p)
        return optax.apply_updates(p, u), s, None

    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    train = dp.jit(step, donate=False)
    with pytest.raises(ValueError, match="split into 4 equal parts.*multiple of 4"):
        train(params_w, state, np.zeros((30, 16), np.float32))
    with pytest.raises(ValueError, match="params is not in the worker layout"):
        train(params, state, np.zeros((32, 16), np.float32))
    # after a good step (whose outputs are not checked again when passed back), a params tree
    # that is not those outputs is checked as before
    params_w2, state2, _ = train(params_w, state, np.zeros((32, 16), np.float32))
    train(params_w2, state2, np.zeros((32, 16), np.float32))
    with pytest.raises(ValueError, match="params is not in the worker layout"):
        train(params, state2, np.zeros((32, 16), np.float32))
    with pytest.raises(ValueError, match=r"use dp.synchronized_params"):
        ozo.synchronized_params(params_w, state)
    with pytest.raises(ValueError, match=r"step takes no step_kind argument.*step_kind=None"):
        dp.jit(step, schedule=SCHEDULE)  # at once, not at the first step
    # a schedule given by position was taken as `donate` and silently ignored (a docs audit)
    with pytest.raises(TypeError, match="positional argument"):
        dp.jit(step, SCHEDULE)
    with pytest.raises(TypeError, match="donate must be True or False, got 'no'"):
        dp.jit(step, donate="no")


@pytest.mark.parametrize("axis_name", ["model", None, "batch"])
def test_an_optimizer_built_for_another_axis_is_refused(axis_name):
    """On a ("data", "model") mesh an optimizer communicating over "model" (or nothing) runs
    without any error from JAX, and the data workers never average: refused, with the fix."""
    mesh = mesh_of(2)
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), host_params(), SPECS
    )
    dp = ozo.data_parallel(mesh, params)
    wrong = ozo.zero_one_adam(1e-2, axis_name=axis_name, var_freeze_step=6)
    problem = (
        "axis_name=None, so each data worker would train alone"
        if axis_name is None
        else (f"communicates over axis_name='{axis_name}', which is not where the data workers are")
    )
    with pytest.raises(ValueError, match=f"{problem}.*build the optimizer with axis_name='data'"):
        dp.init(dp.optimizer(wrong), dp.to_workers(params))
    one_d = ozo.data_parallel(mesh_of(1), host_params())  # no model sharding: tx unwrapped
    with pytest.raises(ValueError, match=problem):
        one_d.init(one_d.optimizer(wrong), one_d.to_workers(host_params()))


def test_a_whole_tree_transform_goes_outside_dp_optimizer():
    """dp.optimizer runs its transform on each model shard: a transform that reads the whole
    tree (clip_by_global_norm, Muon) would see one shard. Chained outside it, XLA computes the
    norm over the shards, and the 2-D run follows the 1-D one (docs/jit.md)."""

    def run(model, clip_inside):
        mesh = mesh_of(model)
        spec = (lambda k: SPECS[k]) if model > 1 else (lambda k: P())
        params = {
            k: jax.device_put(x, NamedSharding(mesh, spec(k))) for k, x in host_params().items()
        }
        dp = ozo.data_parallel(mesh, params)
        clip = optax.clip_by_global_norm(0.05)
        if clip_inside:
            tx = dp.optimizer(optax.chain(clip, make_tx()))
        else:
            tx = optax.chain(clip, dp.optimizer(make_tx()))

        def step(p, s, x):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step)
        for x in batches(2):  # two variance steps: exact means (1-bit scales are per shard)
            p, s, _ = train(p, s, x)
        return {k: np.asarray(v) for k, v in dp.synchronized_params(p, s).items()}

    one_d = run(1, clip_inside=False)
    outside, inside = run(2, clip_inside=False), run(2, clip_inside=True)
    for k in one_d:
        np.testing.assert_allclose(outside[k], one_d[k], atol=1e-6)
    assert max(np.max(np.abs(inside[k] - one_d[k])) for k in one_d) > 1e-3  # per-shard norms


def test_two_d_precompiled_programs_keep_every_sharding():
    """Each kind's program returns params and state sharded as it got them. Left free, XLA gave
    the output of a replicated bias on the model-sharded hidden layer a "model" sharding (its
    gradient is computed sharded), so the next kind's precompiled program, compiled for the
    input's, fell back to compiling again."""
    mesh = mesh_of(2)
    specs = {"w1": P(None, "model"), "b1": P(), "w2": P("model", None)}
    rng = np.random.default_rng(0)
    shapes = {"w1": (16, 32), "b1": (32,), "w2": (32, 4)}
    params = {
        k: jax.device_put(
            0.3 * rng.standard_normal(shapes[k]).astype(np.float32), NamedSharding(mesh, spec)
        )
        for k, spec in specs.items()
    }
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(make_tx())

    def step(p, s, x, step_kind=None):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)
        )(p)
        u, s = tx.update(g, s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s, loss

    train = dp.jit(step, schedule=SCHEDULE)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    xs = batches(STEPS)
    before = [x.sharding for x in jax.tree.leaves((p, s))]
    train.precompile(p, s, xs[0])
    # memory_analysis reads the precompiled programs (nothing compiled again), per device: the
    # arguments are the bytes of one device's shards of params, state and batch
    memory = train.memory_analysis(p, s, xs[0])
    assert sorted(memory) == sorted(SCHEDULE.names)
    on_one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((p, s)))
    on_one += sum(x.nbytes for x in jax.tree.leaves(xs[0])) // dp.num_workers  # its rows
    assert {m.arguments for m in memory.values()} == {on_one}
    # another batch size ("which batch fits?"): compiled for it to be read, not the
    # precompiled programs' figures again (a trial got the first batch's), the run's kept
    twice = np.concatenate([xs[0], xs[0]])
    larger = train.memory_analysis(p, s, twice, kinds=SCHEDULE.kinds[:1])
    assert larger[SCHEDULE.names[0]].arguments == on_one + xs[0].nbytes // dp.num_workers
    assert train.memory_analysis(p, s, xs[0], kinds=SCHEDULE.kinds[0]) == {  # one kind, bare
        SCHEDULE.names[0]: memory[SCHEDULE.names[0]]
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        for x in xs:
            p, s, _ = train(p, s, x)
    for a, x in zip(before, jax.tree.leaves((p, s)), strict=True):
        assert x.sharding.is_equivalent_to(a, x.ndim), (a, x.sharding)
    assert all(raw.compiled is not None for raw in train._raw.values())


def test_one_kind_on_a_model_sharded_mesh_does_not_copy_the_state():
    """On a (data, model) mesh dp.optimizer runs each kind's update on every model shard's
    one-row stack of state under vmap, as dp.jit runs the workers: taken apart (``x[0]``) and
    stacked again, the state's buffers were copied at every step (a memory trial: a local
    step held 15 bytes per parameter of temporaries on a (4, 1) mesh, 4 on a (4,) one). Here
    a local step on (4, 2) holds 2.0 times one device's share of the params in temporaries
    (3.0 before); that it trains as before is the other two-d tests' business."""
    dp, tx, step, params = job.setup(mesh_of(2), width=65536)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    train = dp.jit(step, schedule=SCHEDULE)
    local = [kind for kind in SCHEDULE.kinds if kind.name == "local"]
    memory = train.memory_analysis(p, s, batches(1)[0], kinds=local)["local"]
    share = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(p))
    assert memory.temporaries < 2.5 * share, memory.temporaries / share


def _two_processes(out: pathlib.Path, *extra: str) -> subprocess.Popen:
    """support.jobs.data_parallel_worker on 2 processes x 4 devices, started from tests/."""
    launch = ["-m", "optax_zero_one.integration.launch", "--processes", "2"]
    launch += ["--devices-per-process", "4", "--timeout", "250", "--"]
    return subprocess.Popen(
        [sys.executable, *launch, "support.jobs.data_parallel_worker", "--out", str(out), *extra],
        cwd=pathlib.Path(__file__).resolve().parent,
        env=dict(os.environ, PJRT_NPROC="8", JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_processes_that_build_their_params_apart_are_caught(tmp_path):
    """Each process seeds its params with its own index (a multi-host user's mistake): every
    step runs, and the workers of each process agree among themselves, so only a comparison
    across processes sees it. The dispatcher's once-per-run check now makes one (a digest per
    leaf, gathered) and stops both processes with the error."""
    output, _ = _two_processes(tmp_path, "--seed-per-process").communicate(timeout=300)
    assert "the workers of process 0 and those of process 1" in output, output[-5000:]
    assert "not from its process index" in output
    assert not list(tmp_path.glob("p*.npz"))  # neither process finished training


def test_processes_whose_one_bit_adam_params_start_apart_are_caught(tmp_path):
    """1-bit Adam has no local steps, so no synchronised point to compare: each process
    seeding its params with its own index trained 200 steps with the workers' params apart by
    their first difference, and the evaluation params were worker 0's alone (a multi-host
    trial). Every 1-bit Adam step averages, so the params themselves must agree: the
    dispatcher compares them once, at its first check, across processes too."""
    cmd = ("--seed-per-process", "--onebit")
    output, _ = _two_processes(tmp_path, *cmd).communicate(timeout=300)
    assert "The workers train apart: the params[" in output, output[-5000:]
    assert "the workers of process 0 and those of process 1 at step 8" in output
    assert not list(tmp_path.glob("p*.npz"))


@pytest.mark.parametrize(
    "differ, in_graph, found",
    [
        ("schedule", False, "the schedule differs between process 0 and process 1"),
        ("batch", False, "argument 2 of the step differs between process 0 and process 1"),
        ("width", False, "the params differ between process 0 and process 1 in structure, "),
        ("schedule", True, "the step's program differs between process 0 and process 1"),
        ("batch", True, "argument 2 of the step differs between process 0 and process 1"),
    ],
    ids=["schedule", "batch", "width", "schedule-in-graph", "batch-in-graph"],
)
def test_processes_that_run_different_steps_stop_at_the_first_call(
    tmp_path, differ, in_graph, found
):
    """Each process dispatches on its own: with another schedule (a trial: var_freeze_step
    set by process) the processes ran other kinds from the freeze on and hung at the next
    collective, without a word; with a batch of another size per process they trained on
    other rows, silently. The dispatcher's first call now compares the schedule, the step and
    the arguments' shapes across processes (naming the first leaf that differs), and every
    process stops with the error. Without a schedule, dp.jit's program decides the kinds:
    with var_freeze_step 7 on one process, its sync's collectives met the other's
    full-precision mean and used its bytes as data (losses 1e4 times the run's), then the job
    hung; a batch of another size trained to the end (a multi-host trial). Its first call now
    compares the programs' text and the arguments' shapes the same way."""
    cmd = ("--differ", differ, *(("--in-graph",) if in_graph else ()))
    output, _ = _two_processes(tmp_path, *cmd).communicate(timeout=300)
    assert found in output, output[-5000:]
    assert output.count("The processes of this job do not run the same step") >= 2, output[-5000:]
    if differ == "width":  # the leaf, as each process holds it
        assert "first at leaf 1 (here ['w1']: (4, 16, 34) float32)" in output, output[-5000:]


def test_two_processes_train_as_one(tmp_path):
    """The same training on 2 processes x 4 devices (the data axis spans both; params placed
    and converted per process) and on this process's 8 devices: the same losses and
    evaluation params up to the float all-reduce's summation order, identical on both
    processes."""
    proc = _two_processes(tmp_path)
    reference = job.train(job.job_mesh())  # meanwhile, the single-process reference
    losses, evaluated = np.asarray(reference["losses"]), job.evaluation(reference)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-5000:]
    parts = [dict(np.load(tmp_path / f"p{r}.npz")) for r in range(2)]
    for key in parts[0]:
        np.testing.assert_array_equal(parts[0][key], parts[1][key], err_msg=key)
    np.testing.assert_allclose(parts[0]["losses"], losses, rtol=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    for key, want in evaluated.items():
        np.testing.assert_allclose(parts[0][key], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_two_processes_move_a_model_sharded_state_to_fewer_data_workers(tmp_path):
    """dp.reset_compression in a job of 2 processes x 4 devices: the ("data"=4, "model"=2)
    run's state, spanning both processes, moved onto ("data"=2, "model"=2) over two devices of
    each. Each process gets the move of host copies (the fresh state's rows, which span the
    model devices of other processes, are gathered), the new workers start at the saved run's
    synchronised point, and 4 dispatched steps follow (the dispatcher compares the workers
    across processes)."""
    output, _ = _two_processes(tmp_path, "--reset").communicate(timeout=300)
    assert "Traceback" not in output, output[-5000:]
    parts = [dict(np.load(tmp_path / f"reset_p{r}.npz")) for r in range(2)]
    for part in parts:
        assert bool(part["same_as_from_host"])
        assert np.all(np.isfinite(part["losses"]))
        for key in ("w1", "w2", "b"):
            np.testing.assert_array_equal(part[f"after_{key}"], part[f"before_{key}"])
    np.testing.assert_array_equal(parts[0]["losses"], parts[1]["losses"])


def test_two_models_on_steps_of_their_own_are_not_refused_for_each_other():
    """A GAN's documented shape: a step per model, each dp.jit with its optimizer's schedule,
    each taking the whole params (it needs the other model) and returning the other's as given.
    The dispatcher's params check read the other model's leaves right after this model's sync,
    where they are mid-interval of their own, and raised "The workers' params differ" (a trial,
    at step 10). A leaf the step leaves as it was is not its optimizer's: the run now goes on,
    and follows the same alternation deciding in the graph."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    params = {"a": host_params(0), "b": host_params(1)}  # the same leaf names in both
    dp = ozo.data_parallel(mesh, params)
    tx = {"a": make_tx(), "b": make_tx()}

    def step_of(name, other):
        def step(p, s, x, step_kind=None):
            kw = {} if step_kind is None else {"step_kind": step_kind}
            loss, g = jax.value_and_grad(lambda q: loss_fn(q, x) + 0.1 * loss_fn(p[other], x))(
                p[name]
            )
            u, s = tx[name].update(g, s, p[name], **kw)
            return {name: optax.apply_updates(p[name], u), other: p[other]}, s, loss

        return step

    def run(schedule):
        p = dp.to_workers(params)
        s = {name: dp.init(tx[name], p[name]) for name in tx}
        train = {name: dp.jit(step_of(name, other), schedule=schedule) for name, other in
                 (("a", "b"), ("b", "a"))}  # fmt: skip
        for x in batches(STEPS):
            for name in ("a", "b"):
                p, s[name], _ = train[name](p, s[name], x)
        return p

    dispatched, in_graph = run(SCHEDULE), run(None)
    for got, want in zip(jax.tree.leaves(dispatched), jax.tree.leaves(in_graph), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["in-graph", "dispatched", "precompiled", "skip_not_finite"])
def test_a_plain_optimizer_beside_ours_is_warned_about_at_the_first_compile(how):
    """optax.adamw on the bias beside 0/1 Adam in an optax.multi_transform (a trial: "no
    decay on the biases") got each worker's own gradient, and the workers' biases parted
    silently: without a schedule for good, dispatched until the first sync after local steps
    (never, with 1-bit Adam). dp.jit now warns at a program's first compile (once for all
    kinds), naming the leaves that learn from the batch through no collective where the others
    are averaged, and when precompiled too, and inside ozo.skip_not_finite, whose flag (a
    scalar made from the averaged leaves) read as averaging every leaf it selects (a review
    found both silent). A leaf frozen by optax.set_to_zero and the optimizer's own leaves are
    not warned about."""
    dispatched = how in ("dispatched", "precompiled")
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    params = host_params()
    labels = {"w1": "ours", "w2": "ours", "b": "other"}

    def first_step(other):
        dp = ozo.data_parallel(mesh, params)
        tx = optax.multi_transform({"ours": make_tx(), "other": other}, labels)
        if how == "skip_not_finite":
            tx = ozo.skip_not_finite(tx)

        def step(p, s, x, step_kind=None):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            u, s = tx.update(g, s, p, **({"step_kind": step_kind} if dispatched else {}))
            return optax.apply_updates(p, u), s, loss

        p = dp.to_workers(params)
        train = dp.jit(step, schedule=SCHEDULE if dispatched else None)
        s = dp.init(tx, p)
        if how == "precompiled":
            train.precompile(p, s, batches(1)[0])
        return train(p, s, batches(1)[0])

    with pytest.warns(
        UserWarning, match=r"the params \['b'\] learn from each worker's share"
    ) as got:
        first_step(optax.adamw(1e-2))
    # once, not once per step kind compiled (a trial read it three times in one run)
    assert sum("learn from each worker" in str(w.message) for w in got) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first_step(optax.set_to_zero())


@pytest.mark.parametrize("schedule", [None, SCHEDULE])
def test_a_step_called_with_other_arguments_says_how_to_call_it(schedule):
    """A trial passed the batch as two arguments and read "program() takes 3 positional
    arguments but 4 were given", naming an inner function of dp.jit: the error now says how
    the step is called."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    x = batches(1)[0]
    train = dp.jit(step, schedule=schedule)
    with pytest.raises(TypeError, match=r"called as train\(params_w, opt_state, batch\), .* got 4"):
        train(p, s, x, x)
    with jax.disable_jit(), pytest.raises(ValueError, match="do not run under jax.disable_jit"):
        train(p, s, x)  # a trial: JAX said "not supported in the AOT path ... jit(whole)"
    if schedule is not None:  # a review: the first two still named inner functions
        with pytest.raises(TypeError, match="chooses each step's kind itself: call it without"):
            train(p, s, x, step_kind=SCHEDULE.kinds[0])
        with pytest.raises(TypeError, match=r"called as train.precompile\(params_w, .* got 2"):
            train.precompile(p, s)


def test_trees_that_are_not_the_params_and_traced_calls_say_what_to_do():
    """From an Equinox trial and a several-models trial, each failing inside JAX before: a
    model with a function among its leaves ("not a valid JAX type", at to_workers), another
    tree given to to_workers / from_workers / synchronized_params without its specs (one
    model of a GAN's two: "pytree structure error ... pjit out_shardings"), and a dp.jit
    step or dispatcher called inside jax.jit ("is_deleted() ... called on traced array")."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match=r"param \['act'\] is a function, not an array"):
        ozo.data_parallel(mesh, {"w": np.ones(3, np.float32), "act": lambda x: x})
    params = {"g": host_params(0), "d": host_params(1)}
    dp = ozo.data_parallel(mesh, params)
    with pytest.raises(ValueError, match="pass its specs .* a helper per model"):
        dp.to_workers(params["g"])
    p = dp.to_workers(params)
    s = dp.init(make_tx(), p["g"])
    with pytest.raises(ValueError, match="a helper per model"):
        dp.from_workers(p["g"])
    with pytest.raises(ValueError, match="a helper per model"):
        dp.synchronized_params(p["g"], s)
    assert dp.from_workers(p["g"], jax.tree.map(lambda _: P(), params["g"])).keys() == {
        "b", "w1", "w2"
    }  # fmt: skip

    def step(p, s, x, step_kind=None):
        return p, s, x.sum()

    # a clip first: its EmptyState hid the state's arrays from the check (a review)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), make_tx())
    for schedule, state in ((None, s), (SCHEDULE, s), (SCHEDULE, dp.init(clipped, p["g"]))):
        train = dp.jit(step, schedule=schedule)
        with pytest.raises(TypeError, match="called from Python with arrays"):
            jax.jit(train)(p, state, batches(1)[0])


def test_a_context_mesh_changes_nothing():
    """Under ``jax.set_mesh(mesh)`` (JAX's way to name the mesh of a block of code) the
    helpers' host-side programs run on one device's arrays, which a context mesh refuses
    ("incompatible devices"): they leave it (a seventh new-user trial). The dispatched run,
    through dp.jit and through dispatch_by_kind over ozo.on_workers, gives the bits of the
    same run outside the context."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)

    def with_dp():
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step, schedule=SCHEDULE)
        for x in batches(STEPS):
            p, s, _ = train(p, s, x)
        train.settle()
        return jax.tree.leaves((p, s))

    def with_dispatch():
        own = make_tx()

        def one_worker(p, s, x, kind):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            u, s = own.update(g, s, p, step_kind=kind)
            return optax.apply_updates(p, u), s, loss

        p = ozo.to_workers(ozo.replicate(host_params(), N), mesh)
        s = jax.jit(ozo.on_workers(own.init, mesh))(p)
        train = ozo.dispatch_by_kind(
            lambda kind: jax.jit(ozo.on_workers(lambda *a: one_worker(*a, kind), mesh)),
            SCHEDULE,
            params_index=0,
        )
        for x in batches(STEPS):
            p, s, _ = train(p, s, ozo.to_workers(x.reshape(N, -1, 16), mesh))
        train.settle()
        return jax.tree.leaves((p, s))

    for run in (with_dp, with_dispatch):
        outside = run()
        with jax.set_mesh(mesh):
            inside = run()
        for a, b in zip(outside, inside, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_an_explicit_mesh_trains_as_an_auto_one(model):
    """``jax.make_mesh`` types its axes ``Explicit`` by default in JAX 0.10, and the helper
    refused such a mesh (a new-user's first line). On one, dispatched and in the graph, inside
    ``jax.set_mesh`` and outside, a run gives the bits of the same run on the ``Auto`` mesh
    (the step runs with the model axes ``Auto``, and takes the user's ``out_sharding=``), and
    what the user reads back (the losses' mean, from_workers, synchronized_params) is on the
    user's mesh, usable in the user's own explicit code."""

    def explicit_loss(p, x):  # the user's code, typed: a sum over model shards says its output
        h = jnp.tanh(x @ p["w1"])
        out = jnp.matmul(h, p["w2"], out_sharding=P())
        return jnp.mean((out + p["b"] - jnp.sin(x[:, :4])) ** 2)

    auto = job.train(mesh_of(model), schedule=SCHEDULE)
    mesh = job.job_mesh(model, "Explicit")
    for schedule, context in ((SCHEDULE, False), (SCHEDULE, True), (None, True)):
        with jax.set_mesh(mesh) if context else contextlib.nullcontext():
            run = job.train(mesh, schedule=schedule, loss=explicit_loss)
            dp = run["dp"]
            evaluated = dp.synchronized_params(run["params_w"], run["state"])
            worker = dp.from_workers(run["params_w"], worker=-1)
        with jax.set_mesh(mesh):  # the user's own code, typed on the user's mesh
            x = jax.device_put(batches(1)[0], NamedSharding(mesh, P()))
            loss = jax.jit(explicit_loss)(evaluated, x)
        # dispatched: the Auto run's bits; in the graph (a program of its own, the workers not
        # under vmap): the dispatched run's values to rounding
        same = (
            np.testing.assert_array_equal
            if schedule
            else functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
        )
        same(run["losses"], auto["losses"])
        expected = auto["dp"].synchronized_params(auto["params_w"], auto["state"])
        for name, spec in (SPECS if model > 1 else {k: P() for k in SPECS}).items():
            assert evaluated[name].sharding.mesh == mesh
            assert evaluated[name].sharding.is_equivalent_to(
                NamedSharding(mesh, spec), evaluated[name].ndim
            )
            assert worker[name].sharding.mesh == mesh
            same(np.asarray(evaluated[name]), np.asarray(expected[name]))
        assert np.isfinite(float(loss))
    # nothing model-sharded is gathered over the model axis (JAX 0.10.2's shard_map on an
    # Explicit mesh did, at every step: ~190x the bytes; a trial): each kind's program sends
    # over model only the model's own partial sums, and the state stays sharded as on Auto
    dp, _, step, _ = job.setup(mesh, loss=explicit_loss)
    for kind in SCHEDULE.kinds_from(1):
        one_kind = dp.jit(functools.partial(step, step_kind=kind), donate=False)
        stats = ozo.comm_stats(one_kind, run["params_w"], run["state"], batches(1)[0])
        over_model = [c for c in stats.collectives if c.mesh_axes(mesh) == ("model",)]
        assert {c.kind for c in over_model} <= {"all-reduce"}, kind
        assert sum(c.payload_bytes for c in over_model) <= 4 * 8 * 4 + 8, kind
    for a, b in zip(jax.tree.leaves(run["state"]), jax.tree.leaves(auto["state"]), strict=True):
        assert a.sharding.shard_shape(a.shape) == b.sharding.shard_shape(b.shape)
    bad = jax.tree.map(lambda x: np.asarray(x)[0], auto["state"])  # another error still comes
    with pytest.raises(ValueError, match="not in the worker layout"):
        run["step"](run["params_w"], bad, batches(1)[0])


def test_onebit_adam_on_an_explicit_model_sharded_mesh_trains_as_on_an_auto_one():
    """1-bit Adam's state reads nothing of the params, so ``dp.init``'s program lost them as
    inputs, and on an ``Explicit`` (data, model) mesh it then had no devices to place the
    model shards' state on ("Length of device assignment 1 ...", a trial): it trains there as
    on the ``Auto`` mesh, to the bit, dispatched through warm-up and compressed steps."""
    onebit = dict(onebit=True, freeze=4, schedule=ozo.onebit_schedule(4), steps=8)
    auto = job.train(mesh_of(2), **onebit)
    run = job.train(job.job_mesh(2, "Explicit"), **onebit)
    np.testing.assert_array_equal(run["losses"], auto["losses"])
    for a, b in zip(jax.tree.leaves(run["state"]), jax.tree.leaves(auto["state"]), strict=True):
        assert a.sharding.shard_shape(a.shape) == b.sharding.shard_shape(b.shape)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_helper_for_another_mesh_works_inside_the_old_meshs_context():
    """An elastic restart written in a ``jax.set_mesh`` codebase builds the new helper while
    the old mesh's context is still open: dp.init failed there with JAX's "the context mesh
    ... should match the mesh passed to shard_map" (a trial). The helper's programs now run
    under its own mesh: the same bits as the run outside the context."""
    old = mesh_of(2)
    new = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(AUTO,) * 2, devices=old.devices[:2].ravel()
    )

    def run():
        dp, tx, step, params = job.setup(new)
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step, schedule=SCHEDULE)
        for x in batches(8, rows=16):
            p, s, _ = train(p, s, x)
        train.settle()
        return jax.tree.leaves((dp.synchronized_params(p, s), dp.from_workers(p), s))

    outside = run()
    with jax.set_mesh(old):
        inside = run()
    for a, b in zip(outside, inside, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_graph_kinds_of_a_bare_scheduled_mean_on_a_model_sharded_mesh():
    """DiLoCo's documented warm-up (a bare ``ozo.scheduled_mean`` in its inner chain) through
    ``dp.jit`` without a schedule on the 2-D mesh: the kinds decided in the graph, inside
    ``dp.optimizer``'s per-model-shard program. It failed to trace ("switch branches must have
    equal output types": the float mean's branch typed as replicated over data, the others as
    varying; an eighth new-user trial); now it follows the dispatched run."""
    mesh = mesh_of(2)
    params = {k: jax.device_put(x, NamedSharding(mesh, SPECS[k])) for k, x in host_params().items()}
    dp = ozo.data_parallel(mesh, params, data_axis="data")
    warm_up = ozo.scheduled_mean("data", ozo.FullPrecisionWarmup(3), compressed_steps=False)
    tx = dp.optimizer(
        ozo.diloco(
            optax.chain(warm_up, optax.adamw(1e-2)),
            optax.sgd(0.7, momentum=0.9, nesterov=True),
            3,
            "data",
            start_step=3,
        )
    )

    def step(p, s, x, step_kind=None):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s, loss

    runs = []
    for schedule in (None, ozo.diloco_schedule(3, 3)):
        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step, schedule=schedule)
        for x in batches(10):
            p, s, _ = train(p, s, x)
        runs.append(jax.tree.leaves(dp.synchronized_params(p, s)))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_restored_host_copy_is_placed_as_the_error_says_and_resumes_bitwise():
    """A worker-layout checkpoint read back as numpy arrays (np.savez, pickle) passed to a fresh
    step: the error names a host array and the placement (not dp.to_workers, which would add a
    second worker axis); placed as it says, the run goes on bitwise as the uninterrupted one."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    xs = batches(12)
    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    train = dp.jit(step, schedule=SCHEDULE, donate=False)
    for x in xs[:9]:  # into the local steps
        params_w, state, _ = train(params_w, state, x)
    host = jax.device_get((params_w, state))
    for x in xs[9:]:
        params_w, state, _ = train(params_w, state, x)

    resumed = dp.jit(step, schedule=SCHEDULE)  # as in a new process
    with pytest.raises(ValueError, match=r"(?s)host array.*jax.device_put\(restored.*dp.to_work"):
        resumed(*host, xs[9])
    template = (dp.to_workers(params), dp.init(tx, dp.to_workers(params)))
    p, s = jax.device_put(host, jax.tree.map(lambda x: x.sharding, template))
    for x in xs[9:]:
        p, s, _ = resumed(p, s, x)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((params_w, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # a value set by hand in the state as a Python scalar: keep the leaf's layout
    leaves, treedef = jax.tree.flatten(state)
    by_hand = jax.tree.unflatten(treedef, [1e-3] + leaves[1:])
    with pytest.raises(ValueError, match=r"set by hand.*jnp.full_like\(old_leaf, value\)"):
        dp.check_worker_layout(by_hand, "opt_state")


@pytest.mark.parametrize("schedule", [None, SCHEDULE], ids=["in-graph", "dispatched"])
def test_a_state_restored_for_a_renamed_tree_is_refused_at_the_first_call(schedule):
    """dp.jit without a schedule (one program deciding in the graph) checks its first call's
    arguments in Python: a restart restoring a state into the target of a renamed tree (the
    checkpointer fills its flat buffers by position) is refused there, as a dispatcher's
    first call refuses it (a trial: it trained on silently with another leaf's moments)."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    params_w = dp.to_workers(params)
    state = dp.init(tx, params_w)
    for x in batches(3):
        params_w, state, _ = dp.jit(step, donate=False)(params_w, state, x)
    renamed = {"a": params_w["w2"], "b": params_w["b"], "w1": params_w["w1"]}  # "a" sorts first
    target = dp.init(tx, renamed)
    wrong = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(state))
    with pytest.raises(ValueError, match=r"saved for another parameter tree.*\['a'\] \(32, 4\)"):
        dp.jit(step, schedule=schedule)(renamed, wrong, batches(1)[0])
    dp.jit(step, schedule=schedule)(params_w, state, batches(1)[0])  # the same tree goes on


@pytest.mark.parametrize("schedule", [None, SCHEDULE], ids=["in-graph", "dispatched"])
def test_arrays_a_donating_step_consumed_raise_instead_of_crashing(schedule):
    """Launching a program with donated (deleted) buffers crashes XLA:CPU's process (jax
    0.10); the step raises first, naming the argument and the fix."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    train = dp.jit(step, schedule=schedule)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    xs = batches(3)
    p_old, s_old = p, s
    p, s, _ = train(p, s, xs[0])
    p1, s1 = p, s
    p, s, _ = train(p, s, xs[1])  # both programs compiled: the executables' own path
    with pytest.raises(RuntimeError, match="given params that an earlier call consumed"):
        train(p1, s, xs[2])
    with pytest.raises(RuntimeError, match="given opt_state that an earlier call consumed"):
        train(p, s_old, xs[2])
    del p_old, s1
    train(p, s, xs[2])  # the run itself goes on


def test_the_consumed_check_finds_an_array_in_any_tree():
    """One leaf is looked at, found without a flatten (host time each step), through dicts,
    tuples and other nodes (Flax NNX's State of Variables)."""
    from optax_zero_one.core._graph import first_leaf as _first_leaf

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 2)))

    _, state = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    assert _first_leaf(state) is jax.tree.leaves(state)[0]
    tree = {"a": (jnp.ones(2), None), "b": 1.0}
    assert _first_leaf(tree) is tree["a"][0]
    assert _first_leaf({"a": None}) is None and _first_leaf(()) is None


def test_a_schedule_with_a_state_of_another_optimizer_says_to_drop_it():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, _, _, params = job.setup(mesh)
    adam = optax.adam(1e-3)

    def step(p, s, x, step_kind=None):
        u, s = adam.update(jax.grad(loss_fn)(p, x), s, p)
        return optax.apply_updates(p, u), s, None

    p = dp.to_workers(params)
    train = dp.jit(step, schedule=SCHEDULE)
    with pytest.raises(ValueError, match=r"drop the schedule; else the step's second argument"):
        train(p, dp.init(adam, p), batches(1)[0])


def test_a_zero_size_leaf_keeps_its_sharding_and_every_kind_compiles_once():
    """XLA gives a zero-size output a replicated sharding whatever a constraint inside the
    program says; the step's outputs then differed from its inputs and every precompiled
    kind was compiled again (with a warning) at its second use."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    params = {"w": jnp.ones((16, 4)), "z": jnp.zeros((0, 4))}
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(make_tx())

    def step(p, s, x, step_kind=None):
        g = jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2) + jnp.sum(q["z"]))(p)
        u, s = tx.update(g, s, p, step_kind=step_kind)
        return optax.apply_updates(p, u), s, None

    p = dp.to_workers(params)
    s = dp.init(tx, p)
    train = dp.jit(step, schedule=SCHEDULE)
    train.precompile(p, s, batches(1)[0])
    before = p["z"].sharding
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no precompiled program refused
        for x in batches(14):  # every kind, each more than once
            p, s, _ = train(p, s, x)
    assert p["z"].sharding.is_equivalent_to(before, 3)


def test_an_odd_batch_leaves_the_precompiled_programs_in_use(monkeypatch):
    """An epoch's shorter last batch gets a program of its own; the precompiled programs stay
    for the batches after it. (Dropped, every later step went through the Python argument
    checks.) Only arguments that stay different for STALE_AFTER calls drop them."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:N])
    dp, tx, step, params = job.setup(mesh)
    checked = _layout_checks(monkeypatch, dp)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    train = dp.jit(step, schedule=SCHEDULE)
    xs = batches(14)
    train.precompile(p, s, xs[0])
    for x in xs[:10]:
        p, s, _ = train(p, s, x)
    checked.clear()
    with pytest.warns(UserWarning, match=r"calls like precompile's keep the precompiled one"):
        p, s, _ = train(p, s, xs[10][:20])  # 20 rows: 5 per worker
    assert checked == ["params", "opt_state"]
    checked.clear()
    for x in xs[11:]:
        p, s, _ = train(p, s, x)
    assert checked == []  # the precompiled executables, no Python checks
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))


def test_an_array_extra_argument_reaches_the_optimizer_on_every_model_shard():
    """An extra argument that is an array (value=loss, as optax.contrib.reduce_on_plateau takes)
    entered the per-model-shard program as a closure and failed there (a mesh type error); it
    is an input now: a transform scaling the gradient by it gives the run that scales the
    gradient in the step (a review of this module)."""

    def scale_by_value():
        def update(u, s, p=None, *, value, **extra):
            return jax.tree.map(lambda x: x * value, u), s

        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    mesh = mesh_of(2)
    losses = {}
    for by_extra in (True, False):
        dp, _, _, params = job.setup(mesh)
        assert dp.model_sharded
        inner = optax.chain(scale_by_value(), make_tx()) if by_extra else make_tx()
        tx = dp.optimizer(inner)

        def step(p, s, x, step_kind=None, tx=tx, by_extra=by_extra):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            value = 1.0 / (1.0 + jax.lax.pmean(loss, "data"))  # the same on every worker
            if by_extra:
                u, s = tx.update(g, s, p, value=value, step_kind=step_kind)
            else:
                g = jax.tree.map(lambda x: x * value, g)
                u, s = tx.update(g, s, p, step_kind=step_kind)
            return optax.apply_updates(p, u), s, loss

        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step, schedule=SCHEDULE)
        losses[by_extra] = []
        for x in batches(STEPS):
            p, s, loss = train(p, s, x)
            losses[by_extra].append(np.asarray(loss))
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def test_layout_and_argument_checks_of_a_review():
    """From a review of this module: from_workers refuses a worker past the end (an index
    inside jit is clamped: another worker's copy came back); params placed over the data axis
    but not the model axes (a restored checkpoint put on P('data')) are refused, where the run
    kept them replicated over 'model'; a scalar batch leaf and a spec that does not divide its
    dimension are named."""
    mesh = mesh_of(2)
    dp, tx, step, params = job.setup(mesh)
    p = dp.to_workers(params)
    for bad in (N, -N - 1):
        with pytest.raises(ValueError, match=rf"worker={bad}, but there are {N} data workers"):
            dp.from_workers(p, worker=bad)
    np.testing.assert_array_equal(dp.from_workers(p, worker=-1)["w1"], params["w1"])
    flat = jax.device_put(jax.device_get(p), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"leaf \['w1'\] is sharded as P\('data',\), where the"):
        dp.check_worker_layout(flat, "params")
    dp.check_worker_layout(flat, "the tree")  # a tree of other specs: the data axis only
    train = dp.jit(step)
    s = dp.init(tx, p)
    # dp.jit takes no static arguments: the message named one (a trial)
    with pytest.raises(ValueError, match=r"batch leaf \['lr'\] is a scalar.*fold_in"):
        train(p, s, {"x": batches(1)[0], "lr": np.float32(0.1)})
    with pytest.raises(ValueError, match=r"\['key'\] has shape \(2,\).*A random key\?"):
        train(p, s, {"x": batches(1)[0], "key": jax.random.PRNGKey(0)})  # a raw key: (2,)
    uneven = ozo.data_parallel(mesh, {**SPECS, "b": P("model")})
    with pytest.raises(ValueError, match=r"\['b'\] of shape \(3,\) .*dimension 0 \(3\) does"):
        uneven.to_workers({**host_params(), "b": np.zeros(3, np.float32)})


def test_two_threads_first_calls_compile_the_program_once(monkeypatch):
    """Two threads making a step's first call at once both compiled its program (a review);
    the second now waits for the first's."""
    mesh = mesh_of(1)
    params = host_params()
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(make_tx())

    def step(p, s, x):
        g = jax.grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, None

    compiles = []
    real = jax.stages.Lowered.compile

    def counted(self, *a, **k):
        compiles.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    p = dp.to_workers(params)
    s = dp.init(tx, p)
    x = next(iter(batches(1)))
    train = dp.jit(step, donate=False)
    start = threading.Barrier(2)
    results = []

    def first_call():
        start.wait()
        results.append(train(p, s, x))

    _at_once(first_call, [(), ()])
    assert len(results) == 2 and len(compiles) == 1
    for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # first calls of other shapes at once (a train and an eval batch): the second waited for
    # the first's program, then ran it on its own shapes and failed (a review)
    monkeypatch.undo()
    train = dp.jit(step, donate=False)
    start = threading.Barrier(2)
    shaped = {}

    def call(rows):
        start.wait()
        shaped[rows] = train(p, s, np.concatenate([x] * (rows // len(x))))

    _at_once(call, [(len(x),), (2 * len(x),)])
    assert sorted(shaped) == [len(x), 2 * len(x)]


def _at_once(target, args):
    """Runs ``target(*a)`` for each ``a`` of ``args`` on a thread of its own; waits for all."""
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_raw_key_split_evenly_over_two_workers_is_named():
    """A raw ``jax.random.PRNGKey`` in the batch is ``(2,)`` ``uint32``: over 2 workers it
    splits evenly, one word each, and JAX then fails on a ``(1,)`` key without naming the fix
    (a review). The first call warns, naming it."""
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("data",), axis_types=auto, devices=jax.devices()[:2])
    params = {"w": np.ones((3,), np.float32)}
    dp = ozo.data_parallel(mesh, params)
    tx = dp.optimizer(optax.sgd(0.1))

    def step(p, s, batch):
        g = jax.lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * batch["x"]))(p), "data")
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, None

    p = dp.to_workers(params)
    train = dp.jit(step)
    batch = {"x": np.ones((2, 3), np.float32), "key": jax.random.PRNGKey(0)}
    with pytest.warns(UserWarning, match=r"leaf \['key'\] has shape \(2,\).*PRNGKey.*fold_in"):
        p, s, _ = train(p, dp.init(tx, p), batch)
    # typed keys, one per worker (the fix), pass: NumPy cannot read a key dtype (a review)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(p, s, {**batch, "key": jax.random.split(jax.random.key(0), 2)})


@pytest.mark.parametrize("model", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_step_that_never_exchanges_over_the_data_axis_warns_at_its_first_call(model):
    """``optax.adamw`` inside ``dp.optimizer`` with no ``pmean`` of the gradients ran silently,
    each worker training its own copy (a trial). The first compile of a step without a
    schedule reads its program, and warns once if the params it returns depend on no
    collective over the data axis: a warm-up from a rate of 0 too (a read of the params after
    the first steps missed it: they had not moved), and a step whose only mean is the loss's.
    The same steps with the mean, 0/1 Adam deciding in the graph, a kind's program dispatched
    by hand, and evaluation steps (under jax.jit too) warn nothing."""
    mesh = mesh_of(model)
    spec = (lambda k: SPECS[k]) if model > 1 else (lambda k: P())
    params = {k: jax.device_put(x, NamedSharding(mesh, spec(k))) for k, x in host_params().items()}
    dp = ozo.data_parallel(mesh, params)

    def caught(inner, average, calls=2, log_mean=False):
        tx = dp.optimizer(inner)

        def step(p, s, x):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            if average:
                g = jax.lax.pmean(g, "data")
            if log_mean:  # a mean of the loss, for logging: it updates nothing
                loss = jax.lax.pmean(loss, "data")
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        p = dp.to_workers(params)
        s = dp.init(tx, p)
        train = dp.jit(step)
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            for x in batches(calls):
                p, s, _ = train(p, s, x)
        return [str(w.message) for w in found if "depend on no collective" in str(w.message)]

    found = caught(optax.adamw(1e-2), average=False)
    assert len(found) == 1, found
    assert "jax.lax.pmean(grads, 'data')" in found[0] and "axis_name='data'" in found[0]
    warm_up = optax.adamw(optax.linear_schedule(0.0, 1e-2, 10))
    assert len(caught(warm_up, average=False, calls=1)) == 1
    assert len(caught(optax.adamw(1e-2), average=False, log_mean=True)) == 1  # a review
    assert not caught(optax.adamw(1e-2), average=True)

    def delayed():  # the mean kept in the state, applied at the next step (a review)
        update = lambda g, s, p=None: (s, jax.lax.pmean(g, "data"))  # noqa: E731
        return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)

    assert not caught(optax.chain(delayed(), optax.sgd(0.1)), average=False)
    assert not caught(make_tx(), average=False)  # 0/1 Adam, in the graph: it communicates

    # a kind's program a user dispatches by hand (examples/jit_sharded.py): a local step
    # exchanges nothing by design
    tx = dp.optimizer(make_tx())

    @jax.jit  # a cached trace, the second time: the hint is read from the program (a review)
    def local(p, s, x):
        u, s = tx.update(jax.grad(loss_fn)(p, x), s, p, step_kind=SCHEDULE.kinds[2])
        return optax.apply_updates(p, u), s, None

    assert SCHEDULE.kinds[2].name == "local"
    p = dp.to_workers(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            dp.jit(local, donate=False)(p, dp.init(tx, p), batches(1)[0])

    tx = dp.optimizer(optax.adamw(1e-2))
    p = dp.to_workers(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for evaluate in (
            lambda p, s, x: (p, s, loss_fn(p, x)),
            jax.jit(lambda p, s, x: (p, s, loss_fn(p, x))),
        ):
            dp.jit(evaluate, donate=False)(p, dp.init(tx, p), batches(1)[0])


def test_a_wrapper_that_skips_per_worker_is_refused_at_the_first_call():
    """A Flax trial: optax.apply_if_finite (or MultiSteps with skip_not_finite) around the
    optimizer under dp.jit hung the job at one worker's NaN (that worker skipped the
    collectives the others waited in; XLA:CPU aborted after 40 s, status 134). The first call
    refuses it, before anything runs, with a schedule and without."""
    mesh = mesh_of(1)
    params = {k: jax.device_put(x, NamedSharding(mesh, P())) for k, x in host_params().items()}
    dp = ozo.data_parallel(mesh, params)
    inner = ozo.zero_one_adam(1e-2, axis_name="data", var_freeze_step=8)

    def first_call(tx, schedule=None):
        tx = dp.optimizer(tx)

        def step(p, s, x, step_kind=None):
            g = jax.grad(loss_fn)(p, x)
            kind = {} if step_kind is None else {"step_kind": step_kind}
            u, s = tx.update(g, s, p, **kind)
            return optax.apply_updates(p, u), s, None

        p = dp.to_workers(params)
        return dp.jit(step, schedule=schedule)(p, dp.init(tx, p), next(iter(batches(1))))

    refused = r"inside optax\.(apply_if_finite|MultiSteps with a should_skip_update_fn)"
    with pytest.raises(ValueError, match=refused):
        first_call(optax.apply_if_finite(inner, 10))
    with pytest.raises(ValueError, match=refused):
        first_call(optax.apply_if_finite(inner, 10), ozo.zero_one_schedule(8))
    with pytest.raises(ValueError, match=refused):
        first_call(optax.MultiSteps(inner, 2, should_skip_update_fn=optax.skip_not_finite))
    first_call(inner, ozo.zero_one_schedule(8))  # the optimizer alone


@contextlib.contextmanager
def counted_compiles():
    """A list whose length is the number of XLA compiles while the context is open."""
    seen = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_to_workers_and_the_workers_check_compile_per_device_not_per_leaf():
    """A trial of restart costs: dp.to_workers and the dispatcher's comparison of the workers'
    params ran op by op on each device's shard, so every leaf shape compiled programs of its own
    on every device: 800 and 1,360 at 100 leaves of distinct shapes on 8 devices (~37 s in a
    fresh process without a compilation cache). Now one program per device for all leaves;
    values as before."""
    from optax_zero_one.integration import dispatch

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(5)
    shapes = [(i + 3, 2 * i + 61) for i in range(12)]  # shapes no other test uses
    params = {
        f"l{i}": jnp.asarray(rng.standard_normal(s), jnp.float32) for i, s in enumerate(shapes)
    }
    dp = ozo.data_parallel(mesh, params, "data")
    with counted_compiles() as compiles:
        placed = dp.to_workers(params)
    assert len(compiles) <= 8, len(compiles)
    for k, x in params.items():
        np.testing.assert_array_equal(np.asarray(placed[k]), np.broadcast_to(x, (8, *x.shape)))
        assert placed[k].sharding.spec == P("data")
    apart = {k: x + jnp.arange(8.0).reshape(8, 1, 1) for k, x in placed.items()}  # worker w: +w
    with counted_compiles() as compiles:
        samples = dispatch._samples_of(list(apart.values()))
    assert len(compiles) <= 8, len(compiles)
    for k, found in zip(apart, samples, strict=True):
        ((where, rows),) = found.items()
        want = np.asarray(params[k]).reshape(-1)[:: max(1, params[k].size // 64)][:64]
        assert [w for w, _ in rows] == list(range(8))
        for w, row in rows:
            np.testing.assert_array_equal(row, want + w)
    state = dp.init(ozo.zero_one_adam(1e-2, axis_name="data"), placed)
    with pytest.raises(ValueError, match=r"worker 0 and worker 1"):
        counter = ozo.core._graph.step_counter(state)
        dispatch.check_workers_agree(state, counter, params=apart, worker_axis=True)
