"""Exact resume from Orbax checkpoints after SIGKILL, and restoring onto another worker count.

The kill test runs ``support/jobs/resume_worker.py`` (0/1 Adam, 4 workers, 42 steps, a checkpoint
every third step) three times in a row on one checkpoint directory, alternating ``pmap`` and
``shard_map``
(which compile the same per-device program): the first process (pmap) is killed with SIGKILL at
a random step before the variance freeze, the second (shard_map) resumes, crosses the freeze and
is killed at a random step in phase B, the third (pmap) resumes from a checkpoint taken in the
middle of a local-step interval, finishes, and then repeats the whole run uninterrupted
in-process. Every process prints a SHA-256 digest of all workers' params and optimizer state
after every step; all of them must equal the uninterrupted run's digests.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.jobs import resume_worker as rw
from support.mapping import AXIS

import optax_zero_one as ozo

TESTS = Path(__file__).parent  # the job runs as python -m support.jobs.resume_worker from here
FREEZE = rw.SCHEDULE["var_freeze_step"]
WORKERS = 4
TIMEOUT_S = 300


class Run:
    """One training subprocess; ``lines`` collects what it printed."""

    def __init__(self, mode, tmp_path, name, *extra):
        self.log = open(tmp_path / f"{name}.stderr", "w")  # noqa: SIM115 (closed in finish)
        cmd = [
            sys.executable,
            *("-m", "support.jobs.resume_worker"),
            *("--mode", mode, "--workers", str(WORKERS), "--ckpt", str(tmp_path / "ckpt")),
            *("--compile-cache", str(tmp_path / "compile_cache"), *extra),
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=TESTS, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.watchdog = threading.Timer(TIMEOUT_S, self.proc.kill)
        self.watchdog.start()
        self.restored, self.digests, self.name = None, {}, name

    def run(self, kill_at=None):
        """Reads progress lines; sends SIGKILL right after ``step kill_at`` is reported."""
        for line in self.proc.stdout:
            word, step, digest, *rest = line.split()
            if word == "restored":
                self.restored = (int(step), digest, rest[0], bool(int(rest[1])))
            elif word == "step":
                self.digests[int(step)] = digest
                if kill_at is not None and int(step) >= kill_at:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    break
        rc = self.proc.wait()
        self.watchdog.cancel()
        self.log.close()
        errors = Path(self.log.name).read_text()[-3000:]
        if kill_at is None:
            assert rc == 0, f"{self.name} failed (rc={rc}):\n{errors}"
        else:
            assert rc == -signal.SIGKILL, f"{self.name} was not killed (rc={rc}):\n{errors}"
        return self


def test_killed_runs_resume_bitwise_identically(tmp_path):
    seed = os.environ.get("OZO_KILL_SEED") or random.randrange(2**32)
    rng = random.Random(int(seed))
    kill_a = rng.randint(rw.SAVE_STEPS[0], FREEZE - 3)  # latest checkpoint before the freeze
    kill_b = rng.randint(28, 34)  # latest checkpoint 27, 30 or 33: mid local-step interval
    why = f"(OZO_KILL_SEED={seed}: kills after steps {kill_a} and {kill_b})"

    first = Run("pmap", tmp_path, "first", "--pace", "0.02").run(kill_at=kill_a)
    second = Run("shard_map", tmp_path, "second", "--pace", "0.02").run(kill_at=kill_b)
    ref_file = tmp_path / "reference.json"
    third = Run("pmap", tmp_path, "third", "--reference", str(ref_file)).run()

    result = json.loads(ref_file.read_text())
    reference = {int(k): v for k, v in result["reference"].items()}
    assert sorted(reference) == list(range(1, rw.STEPS + 1))

    # where each resumed process started: the latest committed checkpoint before its kill
    step1, digest1, kind1, _ = second.restored
    step2, digest2, _, moved2 = third.restored
    assert step1 in rw.SAVE_STEPS and kill_a - 2 <= step1 <= kill_a + 1 and step1 < FREEZE, why
    assert kind1 in ("variance", "compressed"), why
    assert step2 in (27, 30, 33) and moved2, why  # params away from the anchor: mid-interval
    assert digest1 == reference[step1] and digest2 == reference[step2], why

    # every step any process reported is bitwise the uninterrupted run's
    for run in (first, second, third):
        for k, d in run.digests.items():
            assert d == reference[k], f"{run.name} process, step {k} {why}"
    assert set(second.digests) >= set(range(step1 + 1, kill_b + 1)), why
    assert sorted(third.digests) == list(range(step2 + 1, rw.STEPS + 1)), why
    assert {int(k): v for k, v in result["resumed"].items()} == third.digests


def find_all(state, cls):
    nodes = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, cls))
    return [s for s in nodes if isinstance(s, cls)]


def find(state, cls):
    (node,) = find_all(state, cls)
    return node


def _loss(params):
    _, targets = rw.problem()
    return float(rw.loss_fn(params, targets))


def test_other_worker_count_fails_clearly_then_resets_and_converges(tmp_path):
    # a learning rate small enough for a smooth loss curve with F = 20 (no bias correction)
    tx = ozo.zero_one_adam(lambda count: 0.005 * 0.99**count, axis_name=AXIS, **rw.SCHEDULE)
    init4, step4 = rw.build("pmap", 4, tx)
    params, state = rw.initial(init4, 4)
    for k in range(1, 31):  # to step 30: phase B, in the middle of a local-step interval
        params, state = step4(params, state, rw.noise(k, 4))
        jax.block_until_ready(params)
    anchor = ozo.synchronized_params(params, state)
    away = jax.tree.map(lambda a, x: np.any(np.asarray(a) != np.asarray(x)), anchor, params)
    assert any(jax.tree.leaves(away))  # mid-interval: the params left the anchor
    mgr = rw.manager(str(tmp_path / "ckpt"))
    rw.save(mgr, 30, params, state)
    saved_loss = _loss(ozo.unreplicate(ozo.synchronized_params(params, state)))

    # by default: a clear error, before Orbax sees a mismatched shape
    init3, step3 = rw.build("pmap", 3, tx)
    fresh = rw.initial(init3, 3)
    with pytest.raises(ValueError, match="saved by 4 workers, but this run has 3") as err:
        rw.restore(mgr, 30, fresh, 3)
    assert "reset_compression" in str(err.value)

    # the opt-in: restore for 4 workers, move to 3 with fresh compression state
    restored = rw.restore(mgr, 30, rw.initial(init4, 4), 4)
    params3, state3 = ozo.reset_compression(*restored, fresh[1])
    ozo.check_worker_count((params3, state3), 3)
    assert jax.tree.structure((params3, state3)) == jax.tree.structure(fresh)
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert shapes((params3, state3)) == shapes(fresh)
    sync3 = find(state3, ozo.LocalStepSyncState)
    for errors in find_all(state3, ozo.OnebitMeanState):
        assert all(not np.any(np.asarray(e)) for e in jax.tree.leaves(errors))
    anchor3 = ozo.synchronized_params(params3, state3)
    for anchor, x in zip(jax.tree.leaves(anchor3), jax.tree.leaves(params3)):
        np.testing.assert_array_equal(np.asarray(anchor), np.asarray(x))
    assert np.all(np.asarray(sync3.count) == 30) and np.all(np.asarray(sync3.lr_sum) == 0)
    sync_point = ozo.unreplicate(ozo.synchronized_params(*restored))
    for got, want in zip(jax.tree.leaves(params3), jax.tree.leaves(sync_point)):
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, np.shape(got)))

    losses, baseline = [], []
    for k in range(31, 121):  # 3 workers from the reset state; 4 workers uninterrupted
        params3, state3 = step3(params3, state3, rw.noise(k, 3))
        params, state = step4(params, state, rw.noise(k, 4))
        jax.block_until_ready((params3, params))
        losses.append(_loss(ozo.unreplicate(ozo.synchronized_params(params3, state3))))
        baseline.append(_loss(ozo.unreplicate(ozo.synchronized_params(params, state))))
    # it keeps training: the loss falls block after block, to well below where it was saved,
    # and stays within a small factor of the uninterrupted 4-worker run (which has a larger mean
    # curvature, 1.25 against 1.0, and lost no local steps)
    blocks = np.asarray(losses).reshape(3, 30).mean(axis=1)
    assert blocks[0] > blocks[1] > blocks[2], (saved_loss, losses[::10])
    assert np.mean(losses[-10:]) < 0.4 * saved_loss, (saved_loss, losses[::10])
    assert np.mean(losses[-10:]) < 3 * np.mean(baseline[-10:]), (losses[::10], baseline[::10])
    # and the 3 workers agree after a sync (step 120: interval 4)
    x = jax.tree.leaves(params3)
    assert all(np.allclose(np.asarray(a)[0], np.asarray(a)[1:], atol=1e-6) for a in x)


def test_worker_count_and_reset_errors():
    params = {"w": jnp.zeros((10,))}
    tx = ozo.onebit_mean("w", num_workers=4)
    state = ozo.replicate(tx.init(params), 4)
    with pytest.raises(ValueError, match="saved by 4 workers, but this run has 2"):
        ozo.check_worker_count(state, 2)
    ozo.check_worker_count((ozo.replicate(params, 4), state), 4)
    ozo.check_worker_count(jax.eval_shape(lambda: state), 4)  # shapes alone
    ozo.check_worker_count({}, 3)  # nothing to check
    # the count itself, public as the docstrings say; NumPy integers as the optimizers take them
    assert ozo.worker_count(state) == 4
    hier = ozo.onebit_mean("n", fast_axis_name="l", num_workers=(np.int64(2), np.int64(4)))
    saved = ozo.replicate(hier.init(params), 8)
    ozo.check_worker_count(saved, (np.int64(2), np.int64(4)))
    # a flat run of 8 compresses over 8 "nodes": the buffers of 2 do not fit (it passed, and
    # the restore failed); (8, 1) is the same flat optimizer and is refused alike
    for flat in (8, (8, 1)):
        with pytest.raises(ValueError, match="in 2 nodes of 4, but this run has 8 nodes of 1"):
            ozo.check_worker_count(saved, flat)
    # dp.optimizer's layout puts a model-shard axis after the workers': (8, M, rows, C); the
    # rows were read from that axis, so a hierarchical dp checkpoint was refused for its own split
    sharded = jax.tree.map(lambda x: x[:, None], saved)
    ozo.check_worker_count(sharded, (2, 4))
    with pytest.raises(ValueError, match="in 2 nodes of 4"):
        ozo.check_worker_count(sharded, (4, 2))
    # 3 runs of 4 workers batched runs first, (3, 4, ...): the runs were read as 3 workers "in
    # 4 nodes of 0" (a batching trial); the buffers' 4 rows do not divide 3
    runs = jax.tree.map(lambda x: jnp.stack([x] * 3), state)
    for count in (3, 4):
        with pytest.raises(ValueError, match="leading axis is not the workers.*Batching"):
            ozo.check_worker_count(runs, count)


@pytest.mark.parametrize("workers", [1, 4])
def test_every_optimizer_s_state_round_trips_through_orbax(tmp_path, workers):
    """Orbax refuses zero-size arrays: a state must hold none, with one worker (no error
    buffers) and with the psum backend (no server stage) too. Saved, restored and compared."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones((5,))}
    axis = None if workers == 1 else AXIS
    builds = {
        f"{name}_{collective}": build(collective)
        for collective in ("two_phase", "psum")
        for name, build in {
            "zero_one_adam": lambda c: ozo.zero_one_adam(1e-3, axis_name=axis, collective=c),
            "onebit_adam": lambda c: ozo.onebit_adam(1e-3, axis_name=axis, collective=c),
            "diloco": lambda c: ozo.diloco(
                optax.adamw(1e-3), optax.sgd(0.7), 4, axis, collective=c
            ),  # fmt: skip
        }.items()
    }
    builds["diloco_float"] = ozo.diloco(optax.adamw(1e-3), optax.sgd(0.7), 4, axis)
    checkpointer = ocp.StandardCheckpointer()
    for name, tx in builds.items():
        if workers == 1:
            state = tx.init(params)
        else:
            state = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, workers))
        leaves = jax.tree.leaves(state)
        assert all(np.size(x) for x in leaves), name
        checkpointer.save(tmp_path / name, state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / name, state)
        assert jax.tree.structure(restored) == jax.tree.structure(state), name
        for a, b in zip(leaves, jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_flax_serialization_saves_and_restores_every_optimizer_s_state():
    """flax.serialization.to_bytes failed on the flat buffers ("can not serialize 'FlatTree'
    object"): a Linen TrainState holding 0/1 Adam's state could not be saved. Trained past
    each kind, saved with the params, restored bitwise, and the next step is the same; a
    state of another worker count is refused by name."""
    serialization = pytest.importorskip("flax.serialization")
    params = {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.ones((4,))}
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3))
    for name, tx in {
        "zero_one_adam": ozo.zero_one_adam(1e-2, var_freeze_step=2, axis_name=AXIS),
        "onebit_adam": ozo.onebit_adam(1e-2, freeze_step=2, axis_name=AXIS),
        "diloco": ozo.diloco(optax.adamw(1e-2), optax.sgd(0.7), 2, AXIS, collective="psum"),
    }.items():

        def step(p, s, x, tx=tx):
            g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        run = jax.jit(jax.vmap(step, axis_name=AXIS))
        init = jax.vmap(tx.init, axis_name=AXIS)
        p, s = ozo.replicate(params, 2), init(ozo.replicate(params, 2))
        for _ in range(7):
            p, s = run(p, s, x)
        saved = {"params": p, "opt_state": s}
        target = {"params": p, "opt_state": init(ozo.replicate(params, 2))}
        restored = serialization.from_bytes(target, serialization.to_bytes(saved))
        assert jax.tree.structure(restored) == jax.tree.structure(saved), name
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
        for a, b in zip(
            jax.tree.leaves(run(p, s, x)), jax.tree.leaves(run(p, restored["opt_state"], x))
        ):
            np.testing.assert_array_equal(a, b, err_msg=name)
        if name != "diloco":  # its float buffers are plain leaves, flax checks nothing there
            four = {"params": p, "opt_state": init(ozo.replicate(params, 4))}
            with pytest.raises(ValueError, match="another number of data workers"):
                serialization.from_bytes(four, serialization.to_bytes(saved))


def test_flax_serialization_works_when_flax_is_imported_after_the_library():
    """Flax is optional and imported lazily: the flat buffers are registered with it when
    flax.serialization is imported, also after this package (a fresh process, in that order)."""
    pytest.importorskip("flax")
    code = (
        "import sys, numpy as np, jax.numpy as jnp, optax_zero_one as ozo\n"
        "assert 'flax' not in sys.modules\n"
        "from flax import serialization\n"
        "tx = ozo.zero_one_adam(1e-3, num_workers=2, axis_name='w')\n"
        "s = tx.init({'w': jnp.ones((3, 4))})\n"
        "r = serialization.from_bytes(s, serialization.to_bytes(s))\n"
        "import jax; assert jax.tree.structure(r) == jax.tree.structure(s)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_one_worker_checkpoints_are_checked_and_moved_like_the_others(tmp_path):
    """A state of an optimizer built with axis_name=None (one worker: a Colab run) has no
    worker axis; check_worker_count and reset_compression take it as one worker's."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(5)}
    one = ozo.zero_one_adam(1e-2, var_freeze_step=2)
    state = one.init(params)
    for _ in range(4):  # into phase B
        updates, state = one.update(jax.tree.map(jnp.ones_like, params), state, params)
        params = optax.apply_updates(params, updates)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "one", {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()
    metadata = checkpointer.metadata(tmp_path / "one")
    ozo.check_worker_count(metadata, 1)
    with pytest.raises(ValueError, match="saved by 1 worker, but this run has 4"):
        ozo.check_worker_count(metadata, 4)
    # onto 4 workers and back onto one
    four = ozo.zero_one_adam(1e-2, var_freeze_step=2, axis_name=AXIS)
    fresh = jax.vmap(four.init, axis_name=AXIS)(ozo.replicate(params, 4))
    params_4, state_4 = ozo.reset_compression(params, state, fresh)
    assert ozo.integration.checkpoint.worker_count((params_4, state_4)) == 4
    assert jax.tree.structure(state_4) == jax.tree.structure(fresh)
    params_1, state_1 = ozo.reset_compression(params_4, state_4, one.init(params))
    assert jax.tree.structure(state_1) == jax.tree.structure(state)
    assert ozo.step_count(state_1) == ozo.step_count(state) == 4
    for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)  # the synchronised point, back as it was


def test_worker_count_reads_an_orbax_checkpoints_metadata(tmp_path):
    """What a user has before restoring: Orbax's metadata of the saved step (its tree is in
    ``item_metadata``; the other fields are scalars such as the save time)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.zeros((10,))}
    state = ozo.replicate(ozo.onebit_mean("w", num_workers=4).init(params), 4)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": ozo.replicate(params, 4), "opt_state": state})
    checkpointer.wait_until_finished()
    metadata = checkpointer.metadata(tmp_path / "ckpt")
    ozo.check_worker_count(metadata, 4)
    with pytest.raises(ValueError, match="saved by 4 workers, but this run has 8"):
        ozo.check_worker_count(metadata, 8)
    with pytest.raises(ValueError, match="disagree"):
        ozo.integration.checkpoint.worker_count({"a": jnp.zeros((4, 2)), "b": jnp.zeros((3,))})
    # a scalar leaf: one worker's tree (an optimizer built with axis_name=None), no worker axis
    assert ozo.integration.checkpoint.worker_count({"a": jnp.zeros(()), "b": jnp.zeros(5)}) == 1
    with pytest.raises(ValueError, match="no arrays"):
        ozo.integration.checkpoint.worker_count({"a": None})
    other = ozo.replicate(ozo.onebit_adam(0.1, axis_name="w", num_workers=2).init(params), 2)
    with pytest.raises(ValueError, match="same optimizer"):
        ozo.reset_compression(ozo.replicate(params, 4), state, other)
    # onebit_mean inside a chain: buffers zeroed and resized, the rest from worker 0
    chain = optax.chain(ozo.onebit_mean("w", num_workers=4), optax.sgd(0.1, momentum=0.9))
    old = ozo.replicate(chain.init(params), 4)
    old = jax.tree.map(lambda x: x + 1, old)  # nonzero everywhere
    fresh = ozo.replicate(
        optax.chain(ozo.onebit_mean("w", num_workers=2), optax.sgd(0.1, momentum=0.9)).init(params),
        2,
    )
    new_params, new = ozo.reset_compression(ozo.replicate(params, 4), old, fresh)
    assert ozo.integration.checkpoint.worker_count((new_params, new)) == 2
    buffer = new[0].worker_error.buffer  # laid out for 2 workers: (2 workers, 2 rows, 8)
    assert new[0].worker_error.layout.num_workers == 2
    assert buffer.shape == (2, 2, 8) and not np.any(buffer)
    np.testing.assert_array_equal(new[1][0].trace["w"], np.ones((2, 10)))


def test_a_loop_s_own_scalars_beside_the_state_do_not_make_it_one_worker_s(tmp_path):
    """A checkpoint item {"step": 2, "params": ..., "opt_state": ...} of 4 workers was taken
    for one worker's (any scalar leaf counted): "saved by 1 worker, but this run has 4", and a
    check for 1 worker passed (an audit). The state's own counters decide now; num_workers is
    checked."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = ozo.replicate({"a": jnp.ones((3, 2)), "b": jnp.ones(5)}, 4)
    txs = (
        ozo.zero_one_adam(1e-2, axis_name=AXIS),
        ozo.diloco(optax.adamw(1e-2), optax.sgd(0.7), 2, AXIS),
    )
    for i, tx in enumerate(txs):
        item = {
            "step": np.asarray(2),
            "params": params,
            "opt_state": jax.vmap(tx.init, axis_name=AXIS)(params),
        }
        path = tmp_path / str(i)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, item)
        checkpointer.wait_until_finished()
        for tree in (item, checkpointer.metadata(path)):
            assert ozo.worker_count(tree) == 4
            ozo.check_worker_count(tree, 4)
            with pytest.raises(ValueError, match="saved by 4 workers, but this run has 1"):
                ozo.check_worker_count(tree, 1)
    one = ozo.zero_one_adam(1e-2).init({"a": jnp.ones((3, 2))})  # one worker's: scalar counters
    assert ozo.worker_count({"step": np.asarray(2), "opt_state": one}) == 1
    for bad in ("4", None, 0, 4.0, True):
        with pytest.raises(ValueError, match="num_workers must be"):
            ozo.check_worker_count(item, bad)
    ozo.check_worker_count(item, jnp.asarray(4))  # a 0-d int array, as replicate takes it


def _local_step_states(state):
    found = []
    jax.tree.map(
        lambda x: None,
        state,
        is_leaf=lambda x: isinstance(x, ozo.LocalStepSyncState) and not found.append(x),
    )
    return found


@pytest.mark.parametrize("case", ["zero_one_adam part", "diloco part", "diloco flat nesterov"])
def test_reset_compression_of_a_partial_or_flattened_local_step_state(case):
    """From a review: 0/1 Adam or DiLoCo on part of the tree (optax.multi_transform) took its
    new anchor from the first leaves of the whole tree (0/1 Adam then blew up; DiLoCo raised
    an AttributeError on optax's MaskedNode), and a flattened DiLoCo kept its Nesterov momentum
    laid out for the old worker count (a misleading 'not the same optimizer'). Moved 4 -> 2 in
    the middle of a local interval: the new anchor is the old synchronised point, the outer
    state is worker 0's (the same on every worker), and training goes on finite."""
    nesterov = optax.sgd(0.5, momentum=0.9, nesterov=True)
    labels = {"a": "other", "b": "ours"}

    def make(n):
        if case == "zero_one_adam part":
            ours = ozo.zero_one_adam(
                1e-2, var_freeze_step=2, local_step_scaler=100, local_step_clipper=4,
                axis_name=AXIS, num_workers=n,
            )  # fmt: skip
        elif case == "diloco part":
            ours = ozo.diloco(optax.adam(1e-2), nesterov, 4, AXIS, num_workers=n)
        else:
            return ozo.flatten(ozo.diloco(optax.adam(1e-2), nesterov, 4, AXIS), AXIS, n)
        return optax.multi_transform({"ours": ours, "other": optax.sgd(0.0)}, labels)

    rng = np.random.default_rng(0)
    params = {"a": jnp.full((3,), 100.0), "b": jnp.asarray(rng.standard_normal(8), jnp.float32)}

    def step_of(tx):
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(jax.vmap(step, axis_name=AXIS))

    tx = make(4)
    p = ozo.replicate(params, 4)
    s = jax.vmap(tx.init, axis_name=AXIS)(p)
    for _ in range(7):  # past a sync, into the next interval
        g = {
            key: jnp.asarray(rng.standard_normal((4, *x.shape)), jnp.float32)
            for key, x in params.items()
        }
        p, s = step_of(tx)(p, s, g)
    point = ozo.unreplicate(ozo.synchronized_params(p, s))
    old_outer = _local_step_states(s)[0].outer_state
    fresh = jax.vmap(make(2).init, axis_name=AXIS)(ozo.replicate(params, 2))
    p2, s2 = ozo.reset_compression(p, s, fresh)
    moved = _local_step_states(s2)[0]
    anchor = moved.anchor.to_tree() if hasattr(moved.anchor, "to_tree") else moved.anchor
    b = anchor["b"] if isinstance(anchor, dict) else anchor
    np.testing.assert_array_equal(np.asarray(b)[0], np.asarray(point["b"]))

    def worker_0(state):  # a flat buffer as its tree
        state = jax.tree.map(lambda x: x[0], state)
        flat = ozo.core.flat.FlatTree
        return jax.tree.map(
            lambda x: x.to_tree() if isinstance(x, flat) else x,
            state,
            is_leaf=lambda x: isinstance(x, flat),
        )

    pairs = zip(jax.tree.leaves(worker_0(moved.outer_state)), jax.tree.leaves(worker_0(old_outer)))
    for new, old in pairs:
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    for _ in range(6):
        g = {key: jnp.zeros((2, *x.shape), jnp.float32) for key, x in params.items()}
        p2, s2 = step_of(make(2))(p2, s2, g)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((p2, s2)))
    assert float(np.abs(np.asarray(p2["b"])).max()) < 50.0  # it blew up to ~2,700


def test_a_state_restored_for_a_renamed_or_reshaped_tree_is_refused(tmp_path):
    """A flat state's buffers restore by position, with no names: restored into the state of a
    tree whose leaf was renamed (sorting before another) or reshaped, Orbax succeeded and each
    leaf trained on with another leaf's moments and anchor (a new-user trial). The state keeps
    a fingerprint of each leaf's name and shape; ``check_restored``, a dispatcher's first
    call and ``reset_compression`` compare it with the tree the state was restored for."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = ozo.zero_one_adam(1e-2, var_freeze_step=2, axis_name=AXIS)
    schedule = ozo.zero_one_schedule(var_freeze_step=2)

    def programs(kind):
        def step(p, s, g):
            u, s = tx.update(g, s, p, step_kind=kind)
            return optax.apply_updates(p, u), s

        return jax.jit(jax.vmap(step, axis_name=AXIS))

    def tree(w, b):  # "w" is (3, 4) and sorts after "b"
        return ozo.replicate({w: jnp.arange(12.0).reshape(3, 4), b: jnp.ones(5)}, 4)

    params = tree("w", "b")
    state = jax.vmap(tx.init, axis_name=AXIS)(params)
    run = ozo.dispatch_by_kind(programs, schedule)
    for k in range(6):  # into phase B
        grads = jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 1)), params)
        params, state = run(params, state, grads)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()

    def restored_for(p):
        target = jax.vmap(tx.init, axis_name=AXIS)(p)
        return checkpointer.restore(tmp_path / "ckpt", target)

    same = restored_for(params)
    ozo.check_restored(same, schedule)
    renamed = {"a": params["w"], "b": params["b"]}  # "a" now sorts first
    reshaped = {"w": params["w"].reshape(4, 4, 3), "b": params["b"]}
    for p, names in (
        (renamed, r"\['a'\] \(3, 4\), \['b'\] \(5,\)"),
        (reshaped, r"\['w'\] \(4, 3\)"),
    ):
        wrong = restored_for(p)  # the checkpointer does not mind: the buffers' shapes agree
        with pytest.raises(ValueError, match="saved for another parameter tree.*" + names):
            ozo.check_restored(wrong)
        before = jax.tree.map(np.asarray, wrong)
        fresh_run = ozo.dispatch_by_kind(programs, schedule)
        with pytest.raises(ValueError, match="saved for another parameter tree"):
            fresh_run(p, wrong, p)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(wrong), strict=True):
            np.testing.assert_array_equal(a, b)  # nothing ran
        fresh = jax.vmap(tx.init, axis_name=AXIS)(jax.tree.map(lambda x: x[:2], p))
        with pytest.raises(ValueError, match="saved for another parameter tree"):
            ozo.reset_compression(p, wrong, fresh)
        # moved to 2 workers with a fresh state of the renamed tree: refused, not misplaced
        # (a trial: the leaves then took the fresh state's fingerprints and passed every check)
        half = jax.tree.map(lambda x: x[:2], p)
        with pytest.raises(ValueError, match="fresh_state was made for another parameter tree"):
            ozo.reset_compression(params, same, jax.vmap(tx.init, axis_name=AXIS)(half))
    # an NNX State or a plain copy hides the state classes: refused, not passed
    with pytest.raises(ValueError, match="check_restored got an optimizer state as plain"):
        ozo.check_restored(_as_mappings(same))
    # a checkpoint from before leaf_keys, restored with partial_restore=True: the fix is named
    fresh = jax.vmap(tx.init, axis_name=AXIS)(params)
    old = _with_leaf_keys(same, lambda k: jax.ShapeDtypeStruct(k.shape, k.dtype))
    with pytest.raises(ValueError, match=r"leaf_keys hold no values.*jax.tree.map\(lambda r, f"):
        ozo.check_restored(old)
    fixed = jax.tree.map(
        lambda r, f: f if isinstance(r, jax.ShapeDtypeStruct) else r, old, fresh
    )  # the recipe the error gives
    ozo.check_restored(fixed, schedule)
    # the same tree goes on where it was
    params, resumed = run(params, same, params)
    assert ozo.step_count(resumed) == 7


def _as_mappings(x):
    """``x`` as a checkpoint restored without a target gives it: states as plain dicts."""
    if hasattr(x, "_asdict"):
        return {key: _as_mappings(value) for key, value in x._asdict().items()}
    if isinstance(x, tuple | list):
        return {str(i): _as_mappings(value) for i, value in enumerate(x)}
    return np.asarray(x)


def _with_leaf_keys(state, change):
    """``state`` with each FlattenState's leaf_keys replaced by ``change(leaf_keys)``."""
    flat = ozo.core.wrappers.FlattenState
    return jax.tree.map(
        lambda n: n._replace(leaf_keys=change(n.leaf_keys)) if isinstance(n, flat) else n,
        state,
        is_leaf=lambda x: isinstance(x, flat),
    )
