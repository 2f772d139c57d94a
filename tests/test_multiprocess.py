"""0/1 Adam across processes (jax.distributed, gloo on CPU) against one process.

``support/jobs/multiprocess_train.py`` trains a small MLP for 40 steps through variance,
compressed, local and sync steps and saves params and optimizer state after every step. It runs
on 2 processes x 2 devices (through ``optax_zero_one.integration.launch``) and on 1 process x 4
devices (JAX's in-process collectives), at the same time, in subprocesses started from
``tests/``.

- ``exact`` mode (gradients on a grid where any float summation order is exact): every leaf of
  params and state, on every worker, after every step, is bitwise identical. The byte
  collectives (all-to-all, all-gather) move bits, and the servers sum in a fixed order.
- ``raw`` mode: the multi-process float all-reduce of variance steps sums in another order than
  the in-process one, so float leaves agree to rounding; counters and step kinds exactly.
- ``optax_zero_one.unreplicate`` of arrays that span both processes returns this process's first
  worker, and refuses a worker of the other process.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent  # the job runs as python -m support.jobs.NAME from here
STEPS = 40
KINDS = ("variance", "compressed", "local", "sync")


def _start(out: Path, processes: int, devices: int) -> subprocess.Popen:
    env = dict(os.environ, PJRT_NPROC=str(2 * devices), JAX_PLATFORMS="cpu")
    train = ["support.jobs.multiprocess_train", "--out", str(out), "--steps", str(STEPS)]
    if processes == 1:  # the plain single-process reference, no jax.distributed
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
        cmd = [sys.executable, "-m", *train]
    else:
        launch = ["optax_zero_one.integration.launch", "--processes", str(processes)]
        launch += ["--devices-per-process", str(devices), "--timeout", "280", "--"]
        cmd = [sys.executable, "-m", *launch, *train]
    return subprocess.Popen(
        cmd, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _load(out: Path, mode: str) -> tuple[dict[str, np.ndarray], list[str], np.ndarray]:
    """Merges the per-process files of one run: every step's leaves over all workers."""
    parts = [dict(np.load(f)) for f in sorted(out.glob(f"{mode}_p*.npz"))]
    assert parts, f"no {mode} results in {out}"
    workers = np.concatenate([p["workers"] for p in parts])
    order = np.argsort(workers)
    assert list(workers[order]) == list(range(4)), workers
    merged = {
        key: np.concatenate([p[key] for p in parts])[order]
        for key in parts[0]
        if key.startswith("step")
    }
    kinds = np.concatenate([p["kinds"] for p in parts])[order]
    return merged, [str(n) for n in parts[0]["names"]], kinds


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("multiprocess")
    layouts = {"2x2": (2, 2), "1x4": (1, 4)}
    procs = {name: _start(base / name, *layout) for name, layout in layouts.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} run failed:\n{output[-6000:]}"
    return {name: base / name for name in layouts}


def test_every_phase_ran(runs):
    _, _, kinds = _load(runs["2x2"], "exact")
    assert kinds.shape == (4, STEPS)
    assert (kinds == kinds[0]).all(), "workers disagree on the step kind"
    assert {KINDS[k] for k in kinds[0]} == set(KINDS)


def test_exact_sums_bitwise_identical_at_every_step(runs):
    a, names, kinds_a = _load(runs["2x2"], "exact")
    b, _, kinds_b = _load(runs["1x4"], "exact")
    np.testing.assert_array_equal(kinds_a, kinds_b)
    assert a.keys() == b.keys() and len(a) == STEPS * len(names)
    for key in sorted(a):
        step, leaf = int(key[4:7]), int(key[-3:])
        where = f"step {step} ({KINDS[kinds_a[0, step - 1]]}), {names[leaf]}"
        assert a[key].dtype == b[key].dtype, where
        np.testing.assert_array_equal(a[key], b[key], err_msg=where)
    # the comparison is not vacuous: training moved the params and local steps split workers
    first, last = f"step{1:03d}_leaf{0:03d}", f"step{STEPS:03d}_leaf{0:03d}"
    assert not np.array_equal(a[first], a[last])
    local = [k for k in range(1, STEPS + 1) if KINDS[kinds_a[0, k - 1]] == "local"]
    params = [i for i, n in enumerate(names) if n.startswith("[0]")]
    assert any(
        not np.array_equal(a[f"step{k:03d}_leaf{i:03d}"][0], a[f"step{k:03d}_leaf{i:03d}"][1])
        for k in local
        for i in params
    )


def test_raw_gradients_agree_to_float_rounding(runs):
    a, names, kinds_a = _load(runs["2x2"], "raw")
    b, _, kinds_b = _load(runs["1x4"], "raw")
    np.testing.assert_array_equal(kinds_a, kinds_b)
    for key in sorted(a):
        step, leaf = int(key[4:7]), int(key[-3:])
        where = f"step {step} ({KINDS[kinds_a[0, step - 1]]}), {names[leaf]}"
        if not np.issubdtype(a[key].dtype, np.floating):
            np.testing.assert_array_equal(a[key], b[key], err_msg=where)
            continue
        scale = float(np.max(np.abs(b[key]), initial=0.0))
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-4 * scale, err_msg=where)


def test_unreplicate_reads_this_processs_rows(runs):
    for name in ("2x2", "1x4"):
        for path in sorted(runs[name].glob("exact_p*.npz")):
            part = dict(np.load(path))
            worker = int(part["unreplicated_worker"])
            assert worker == part["workers"][0], (name, path.name)  # p1 of 2x2: worker 2
            row = list(part["workers"]).index(worker)
            keys = sorted(k for k in part if k.startswith("unreplicated_leaf"))
            assert len(keys) == len(part["names"])
            for j, key in enumerate(keys):
                final = part[f"step{STEPS:03d}_leaf{j:03d}"][row]
                np.testing.assert_array_equal(part[key], final, err_msg=f"{name} {path.name}")
    refusals = [str(np.load(p)["unreplicate_refusal"]) for p in runs["2x2"].glob("exact_p*.npz")]
    assert len(refusals) == 2
    assert all("is not on a device of this process" in r for r in refusals), refusals


def _launched(module: str, devices: int, *args: str) -> subprocess.CompletedProcess:
    """``module`` (from tests/) on 2 processes of ``devices`` devices through the launcher;
    asserts that it succeeded."""
    launch = ["optax_zero_one.integration.launch", "--processes", "2"]
    launch += ["--devices-per-process", str(devices), "--timeout", "200", "--"]
    out = subprocess.run(
        [sys.executable, "-m", *launch, module, *args],
        cwd=TESTS,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=260,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def test_reset_compression_moves_a_state_that_spans_processes():
    """``reset_compression`` read its arguments with ``np.asarray``, which refuses an array that
    spans other processes' devices: the documented way to move a checkpoint to another worker
    count crashed in every multi-process job (a trial). The job moves a 4-worker state placed
    over both processes' devices to its 2 workers and checks its rows against the same reset
    done on host copies (``support/jobs/reset_worker.py``)."""
    out = _launched("support.jobs.reset_worker", 1)
    assert sorted(
        line.split("reset ok: ")[1][:9] for line in out.stdout.splitlines() if "reset ok" in line
    ) == ["process 0", "process 1"], out.stdout[-2000:]


def test_the_host_all_gather_works_with_unequal_devices_per_process():
    """The dispatcher's cross-process checks gather a digest from every process. Through
    ``multihost_utils.process_allgather`` they failed with a reshape error when one process
    held 1 device and the other 2 (a trial, at the first check hours into a run); the gather
    now goes over one device of each process."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid, devices in ((0, 1), (1, 2)):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            OZO_COORDINATOR=f"127.0.0.1:{port}",
            OZO_NUM_PROCESSES="2",
            OZO_PROCESS_ID=str(pid),
            JAX_NUM_CPU_DEVICES=str(devices),
            PJRT_NPROC="2",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "support.jobs.allgather_worker"],
                cwd=TESTS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for pid, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, output[-4000:]
        assert f"gathered {pid} [[0, 7], [1, 7]]" in output, output[-4000:]
