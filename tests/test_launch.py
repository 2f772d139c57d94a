"""optax_zero_one.integration.launch stops the whole job and reports when a process fails or the
port is taken."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optax_zero_one.integration import distributed, launch

ROOT = Path(__file__).resolve().parents[1]


def _launch_two(module: str, timeout: int, wait: int, **env: str) -> subprocess.CompletedProcess:
    """``module`` (from tests/) on 2 processes through the launcher's command line, stopped by
    it after ``timeout`` s; this test waits ``wait`` s for the launcher itself."""
    cmd = [sys.executable, "-m", "optax_zero_one.integration.launch", "--processes", "2"]
    return subprocess.run(
        [*cmd, "--timeout", str(timeout), "--", module],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests"), **env),
        capture_output=True,
        text=True,
        timeout=wait,
    )


def test_a_failing_process_stops_the_job_and_its_error_is_shown():
    started = time.monotonic()
    result = _launch_two("support.jobs.launch_failing_worker", 200, 240, PJRT_NPROC="2")
    elapsed = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "[p0] first sum [3.]" in out and "[p1] first sum [3.]" in out, out[-3000:]
    assert "[launch] process 1 failed first, with status 1" in out, out[-3000:]
    summary = out[out.index("[launch] last lines of process 1") :]
    assert "RuntimeError: deliberate failure in process 1" in summary
    assert elapsed < 150, "the launcher waited for a timeout instead of stopping the job"


def test_a_process_killed_by_sigkill_is_named_first():
    """A SIGKILLed process writes no note; the survivor's failed collective noted its failure
    before the watcher thread recorded the kill, and the launcher named the survivor first
    (a trial: 2 runs of 3), with the signal as a negative status. Three runs here."""
    for _ in range(3):
        result = _launch_two(
            "support.jobs.launch_failing_worker", 200, 240, PJRT_NPROC="2", FAIL_BY_SIGKILL="1"
        )
        out = result.stdout
        assert result.returncode == 137, out[-3000:]
        assert "[launch] process 1 failed first, killed by SIGKILL (exit status 137)" in out, out[
            -3000:
        ]


def test_a_module_that_never_joins_the_job_fails_it():
    """Each process of a module without ``initialize_from_env`` runs as a job of one and
    succeeds alone; the launcher reported success. Now each process fails at its end."""
    result = _launch_two("support.jobs.launch_unjoined_worker", 100, 150, PJRT_NPROC="2")
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "[p0] processes 1" in out and "[p1] processes 1" in out, out[-3000:]
    assert "not of the 2 the launcher started: it never joined the job" in out, out[-3000:]
    assert "initialize_from_env()" in out


def test_a_taken_port_is_reported_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "optax_zero_one.integration.launch",
                "--processes",
                "2",
                "--port",
                str(port),
            ]
            + ["--", "no_such_module"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stdout
    assert f"port {port} on 127.0.0.1 is not available" in result.stdout


def test_output_that_is_not_utf8_from_a_module_without_jax_goes_through():
    """One byte that is not UTF-8 killed the thread that forwards a process's output; the
    pipe then filled and the job hung. And a module that never ran JAX was failed as one that
    never joined the job."""
    result = _launch_two("support.jobs.launch_plain_output", 60, 100)
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert "[p0] caf\\xe9" in out and "[p1] line 19999" in out, out[-3000:]


def test_the_environment_of_the_processes(monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "2")  # left from a 1-device run: too few for 8 devices
    env = launch._job_env(None, processes=2, devices=8, port=1234, failure_dir="/tmp/x")
    assert env["PJRT_NPROC"] == "16" and env["JAX_NUM_CPU_DEVICES"] == "8"
    assert env["JAX_ENABLE_PREEMPTION_SERVICE"] == "false"  # it swallows the launcher's SIGTERM
    assert env[distributed.LAUNCHER_PID] == str(os.getpid())
    monkeypatch.setenv("PJRT_NPROC", "64")  # more is kept
    assert launch._job_env(None, 2, 8, 1234, "/tmp/x")["PJRT_NPROC"] == "64"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--processes", "0"], "--processes and --devices-per-process must be >= 1"),
        (["--processes", "2", "--port", "70000"], "--port must be in 0..65535"),
        (["--processes", "2", "--timeout", "-3"], "--timeout must be > 0"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        launch.main([*args, "--", "no_such_module"])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_subprocess_of_a_launched_process_does_not_join_the_job():
    """It inherits the job's variables; it joined as its parent's rank and both died."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        **{
            distributed.COORDINATOR: "127.0.0.1:9",  # nothing listens: joining would fail
            distributed.NUM_PROCESSES: "2",
            distributed.PROCESS_ID: "0",
            distributed.LAUNCHED_PID: "1",  # the process the launcher started: not this one
        },
    )
    code = "import optax_zero_one as ozo; j = ozo.initialize_from_env(); print(j.num_processes)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.split() == ["1"], result.stderr[-2000:]


def test_a_wrapper_that_forks_its_command_runs_the_job():
    """Each process dies with the launcher; it checked that by its parent, which a wrapper that
    forks (coreutils timeout, sudo, strace -f) is not: every process exited at once."""
    import io

    out = io.StringIO()
    env = {"PYTHONPATH": str(ROOT / "tests")}
    status = launch.launch(
        "support.jobs.launch_plain_output",
        processes=2,
        wrapper=("timeout", "100"),
        timeout=90,
        out=out,
        env=env,
    )
    assert status == 0, out.getvalue()[-3000:]
    assert "[p1] line 19999" in out.getvalue()
