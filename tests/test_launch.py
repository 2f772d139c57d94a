"""optax_zero_one.integration.launch stops the whole job and reports when a process fails or the
port is taken."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_failing_process_stops_the_job_and_its_error_is_shown():
    env = dict(os.environ, PJRT_NPROC="2", PYTHONPATH=str(ROOT / "tests"))
    cmd = [
        sys.executable,
        "-m",
        "optax_zero_one.integration.launch",
        "--processes",
        "2",
        "--timeout",
        "200",
    ]
    started = time.monotonic()
    result = subprocess.run(
        [*cmd, "--", "support.jobs.launch_failing_worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "[p0] first sum [3.]" in out and "[p1] first sum [3.]" in out, out[-3000:]
    assert "[launch] process 1 failed first, with status 1" in out, out[-3000:]
    summary = out[out.index("[launch] last lines of process 1") :]
    assert "RuntimeError: deliberate failure in process 1" in summary
    assert elapsed < 150, "the launcher waited for a timeout instead of stopping the job"


def test_a_module_that_never_joins_the_job_fails_it():
    """Each process of a module without ``initialize_from_env`` runs as a job of one and
    succeeds alone; the launcher reported success. Now each process fails at its end."""
    env = dict(os.environ, PJRT_NPROC="2", PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, "-m", "optax_zero_one.integration.launch", "--processes", "2"]
    result = subprocess.run(
        [*cmd, "--timeout", "100", "--", "support.jobs.launch_unjoined_worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
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
