"""Start a local multi-process JAX job: P processes on 127.0.0.1, D CPU devices each.

Usage::

    python -m optax_zero_one.integration.launch --processes 2 --devices-per-process 2 -- \
        my_project.train --steps 100

Every process runs ``python -m <module> <args>`` with the variables that
:func:`optax_zero_one.initialize_from_env` reads (coordinator ``127.0.0.1:PORT``, job size,
rank), ``JAX_NUM_CPU_DEVICES=D``, and ``PJRT_NPROC=2D`` and ``JAX_PLATFORMS=cpu`` unless
already set. Output is forwarded line by line with a ``[pI]`` prefix. If a process exits with an
error, the others are stopped, its last lines are printed again and the launcher exits with its
status; a port that is already taken, a timeout or Ctrl-C stop everything the same way.

This is for local experiments and tests. On real clusters use the cluster's own launcher
(SLURM, Kubernetes, ...): ``jax.distributed.initialize()`` then finds its arguments itself.

Each process is started as ``python -m optax_zero_one.integration.launch --child MODULE ARGS``
(:func:`run_module`), which runs the module as ``__main__`` and, if it fails, exits at once with
its status: a plain ``sys.exit(1)`` would first wait up to 5 minutes in ``jax.distributed``'s
shutdown barrier for processes that may be stuck in a collective with the one that failed.
Nothing in this module is imported by ``import optax_zero_one``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import TextIO

from optax_zero_one.core import _graph
from optax_zero_one.integration import distributed

HOST = "127.0.0.1"
TAIL_LINES = 30
CHILD = "--child"  # first argument of a process the launcher started (see run_module)


class LaunchError(RuntimeError):
    """The job could not be started (e.g. the coordinator port is taken)."""


def _probe_code(port: int) -> str:
    return (
        "import socket\n"
        "s = socket.socket()\n"
        f"s.bind(({HOST!r}, {port}))\n"
        "print(s.getsockname()[1])\n"
    )


def pick_port(port: int = 0, wrapper: Sequence[str] = ()) -> int:
    """Checks that ``port`` is free on 127.0.0.1 (``0``: finds a free one) and returns it.

    With a ``wrapper`` (e.g. ``ip netns exec NS``) the check runs inside it, since a network
    namespace has its own ports.

    Args:
      port: the port to check, or ``0`` for any free one.
      wrapper: a command prefix to run the check under, e.g. ``("ip", "netns", "exec", "ns")``.

    Returns:
      The port. Raises :class:`LaunchError` if it is taken or cannot be bound.

    Example:
      >>> port = pick_port()  # a free port on 127.0.0.1
    """
    if not wrapper:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError as err:
                raise LaunchError(f"port {port} on {HOST} is not available: {err}") from None
            return s.getsockname()[1]
    result = subprocess.run(
        [*wrapper, sys.executable, "-c", _probe_code(port)], capture_output=True, text=True
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        raise LaunchError(f"port {port} on {HOST} is not available: {last}")
    return int(result.stdout.strip())


def _stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM to every still-running process group, then SIGKILL after ``grace`` seconds."""
    for p in procs:  # the group may outlive its leader (a subprocess of the module)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(
    module: str,
    args: Sequence[str] = (),
    processes: int = 2,
    devices_per_process: int = 1,
    port: int = 0,
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
    timeout: float | None = None,
    out: TextIO | None = None,
) -> int:
    """Runs ``python -m module *args`` as a ``jax.distributed`` job and waits for it.

    Args:
      module: the module each process runs; it must call
        :func:`optax_zero_one.initialize_from_env` before any JAX computation.
      args: its command-line arguments.
      processes: number of processes ``P``.
      devices_per_process: simulated CPU devices in each process ``D``.
      port: coordinator port on 127.0.0.1 (``0``: a free one).
      env: extra environment variables for every process.
      wrapper: a command prefix for every process, e.g. ``("ip", "netns", "exec", "ns")``.
      timeout: seconds after which the whole job is stopped (exit status 124).
      out: where to forward the prefixed output (default ``sys.stdout``).

    Returns:
      0 if every process succeeded; else the first failing process's exit status (a signal
      ``s`` as ``128 + s``), 124 on timeout, 130 on Ctrl-C, 2 if the job could not start.

    Example:
      >>> from optax_zero_one.integration.launch import launch
      >>> # every process runs `python -m my_project.train --steps 100`
      >>> status = launch("my_project.train", ["--steps", "100"], processes=2,  # doctest: +SKIP
      ...                 devices_per_process=2, timeout=600)
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError("processes and devices_per_process must be >= 1")
    job = _Job(out or sys.stdout)
    try:
        port = pick_port(port, wrapper)
    except LaunchError as err:
        job.say(f"[launch] error: {err}")
        return 2
    with tempfile.TemporaryDirectory(prefix="ozo-launch-") as failure_dir, _caught_signals() as got:
        base = _job_env(env, processes, devices_per_process, port, failure_dir)
        job.say(f"[launch] {processes} x {devices_per_process} devices, coordinator {HOST}:{port}")
        try:
            for i in range(processes):
                job.start(i, [*wrapper, *_child_command(module, args)], base)
            status = job.wait(processes, timeout, got, failure_dir)
        finally:
            job.stop()
    return status


def _child_command(module: str, args: Sequence[str]) -> list[str]:
    """The command line of one process: this module's ``--child`` entry, then the module."""
    return [sys.executable, "-m", "optax_zero_one.integration.launch", CHILD, module, *args]


def _job_env(
    env: dict[str, str] | None, processes: int, devices: int, port: int, failure_dir: str
) -> dict[str, str]:
    """The environment every process starts with (its rank is added per process)."""
    base = dict(os.environ)
    base.update(env or {})
    base.setdefault("JAX_PLATFORMS", "cpu")
    # at least 2 threads per simulated device, or the devices' rendezvous can deadlock
    nproc = base.get("PJRT_NPROC", "")
    base["PJRT_NPROC"] = str(max(2 * devices, int(nproc) if nproc.isdigit() else 0))
    base["JAX_NUM_CPU_DEVICES"] = str(devices)
    base["PYTHONUNBUFFERED"] = "1"
    # jax's preemption notifier swallows SIGTERM: stopping the job would always wait for SIGKILL
    base.setdefault("JAX_ENABLE_PREEMPTION_SERVICE", "false")
    base[distributed.COORDINATOR] = f"{HOST}:{port}"
    base[distributed.NUM_PROCESSES] = str(processes)
    base[distributed.FAILURE_DIR] = failure_dir
    base[distributed.LAUNCHER_PID] = str(os.getpid())  # a process the launcher starts dies with it
    return base


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
    """Collects SIGINT and SIGTERM into the list it yields (main thread only), so that the job is
    stopped cleanly instead of the launcher dying with its processes left running."""
    got: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Job:
    """The processes of one launch: their output forwarded line by line with a ``[pI]`` prefix
    (the last lines kept), their exits recorded by watcher threads."""

    def __init__(self, out: TextIO):
        self.out, self.lock = out, threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.tails: list[collections.deque] = []
        self.ended: dict[int, tuple[float, int]] = {}  # process -> (exit time, status)

    def say(self, text: str) -> None:
        with self.lock, contextlib.suppress(BrokenPipeError, ValueError):
            self.out.write(text + "\n")
            self.out.flush()

    def start(self, i: int, command: list[str], base: dict[str, str]) -> None:
        p = subprocess.Popen(
            command,
            env=dict(base, **{distributed.PROCESS_ID: str(i)}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="backslashreplace",
            start_new_session=True,  # own process group: we stop it, Ctrl-C does not
        )
        self.procs.append(p)
        self.tails.append(collections.deque(maxlen=TAIL_LINES))
        reader = threading.Thread(target=self._forward, args=(i, p.stdout), daemon=True)
        reader.start()
        self.readers.append(reader)
        threading.Thread(target=self._watch, args=(i, p), daemon=True).start()

    def _forward(self, i: int, stream: TextIO) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self.tails[i].append(line)
            self.say(f"[p{i}] {line}")

    def _watch(self, i: int, p: subprocess.Popen) -> None:
        code = p.wait()
        self.ended[i] = (time.monotonic(), code)

    def wait(self, processes: int, timeout: float | None, got: list[int], failure_dir: str) -> int:
        """Polls until every process has ended, one has failed, a signal came or the time is
        up; returns the launcher's exit status (see :func:`launch`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if any(c != 0 for _, c in list(self.ended.values())):
                time.sleep(0.5)  # let exits that follow at once register, to name the first
                return self._report_failure(failure_dir)
            if len(self.ended) == processes:
                return 0
            if got:
                self.say("[launch] interrupted: stopping all processes")
                return 130
            if deadline is not None and time.monotonic() > deadline:
                running = [i for i in range(processes) if i not in self.ended]
                self.say(f"[launch] timeout after {timeout:.0f} s: processes {running} still "
                         "running; stopping all processes")  # fmt: skip
                self._name_finished(failure_dir)
                for i in running:
                    self._say_tail(i)
                return 124
            time.sleep(0.05)

    def _report_failure(self, failure_dir: str) -> int:
        failures = sorted(
            (_failed_at(failure_dir, i, t, c), i, c) for i, (t, c) in list(self.ended.items()) if c
        )
        _, first, code = failures[0]
        self.stop()
        after = "".join(f", then process {i} ({_status(c)})" for _, i, c in failures[1:])
        self.say(f"[launch] process {first} failed first, {_status(code)}{after}; "
                 "all processes stopped.")  # fmt: skip
        if not os.path.exists(os.path.join(failure_dir, str(first))):
            self._name_finished(failure_dir)  # it did not fail in its module: it may have waited
        self._say_tail(first)
        return _exit_status(code)

    def _name_finished(self, failure_dir: str) -> None:
        """Where a process ended its module cleanly while others ran on, says so: the others
        most likely waited for it in a collective, until JAX's shutdown barrier gave up (after
        300 s, with an abort that names no culprit)."""
        done = sorted(_finished(failure_dir))
        if done:
            self.say(f"[launch] processes {done} had finished their module cleanly while the "
                     "others still ran: those were most likely waiting for them in a "
                     "collective. Does every process run the same steps (a process that "
                     "leaves the loop early leaves the others waiting)?")  # fmt: skip

    def _say_tail(self, i: int) -> None:
        self.say(f"[launch] last lines of process {i}:")
        for line in list(self.tails[i]):  # a snapshot: its reader thread may still append
            self.say(f"[launch]   | {line}")

    def stop(self) -> None:
        """Stops every process still running and drains their output."""
        _stop(self.procs)
        for t in self.readers:
            t.join(timeout=2.0)


def _failed_at(directory: str, process: int, exited: float, status: int = 1) -> float:
    """When ``process`` failed: its own note (``run_module``), else when it exited.

    Once one process dies the others' collectives fail too, sometimes exiting before the first
    one's exit is seen; the note, written before the failing process closes its connections,
    tells which came first. A process killed by SIGKILL (the OOM killer, a user) writes none,
    and the others note their failed collectives within milliseconds of its death, before the
    thread that watches it may record the exit: it counts as failed up to a second earlier (a
    trial: the survivor was named first in 2 runs of 3).
    """
    try:
        with open(os.path.join(directory, str(process))) as f:
            return float(f.read())
    except (OSError, ValueError):
        return exited - (KILLED_LEAD_S if status == -signal.SIGKILL else 0.0)


KILLED_LEAD_S = 1.0  # how much earlier than its recorded exit a SIGKILLed process counts


def _exit_status(code: int) -> int:
    """A process's status as a shell gives it: ``128 + s`` for one ended by signal ``s``."""
    return code if code > 0 else 128 - code


def _status(code: int) -> str:
    """How the report names an exit status (a negative one is the signal that ended it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name} (exit status {_exit_status(code)})"
    return f"with status {code}"


def _finished(directory: str) -> dict[int, float]:
    """The processes that ended their module cleanly (``run_module``), and when."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".done"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, name)) as f:
                out[int(name[:-5])] = float(f.read())
    return out


def run_module(module: str, args: Sequence[str]) -> None:
    """Runs ``python -m module *args`` in this process; on failure exits at once (``os._exit``).

    A clean exit (``None``/``0``) returns normally, so ``jax.distributed``'s shutdown barrier
    runs as usual. Any exception or non-zero ``sys.exit`` prints what it would have printed and
    ends the process immediately with its status, skipping the barrier (which could otherwise
    wait minutes for processes stuck in a collective with this one). The launcher starts every
    process through it (``python -m optax_zero_one.integration.launch --child MODULE ARGS``).

    Args:
      module: the module to run as ``__main__``.
      args: its command-line arguments (``sys.argv[1:]``).

    Returns:
      ``None`` when the module ends cleanly; otherwise the process ends here.

    Example:
      >>> run_module("my_project.train", ["--steps", "100"])  # doctest: +SKIP
    """
    sys.argv = [module, *args]
    os.environ[distributed.LAUNCHED_PID] = str(os.getpid())
    _die_with_parent()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        if code is None or code == 0:
            _end_cleanly(module)
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
    else:
        _end_cleanly(module)


def _end_cleanly(module: str) -> None:
    """A module that ended without error: checked that it joined the job, then noted as done
    (the launcher names it if the others then wait for it)."""
    _check_joined(module)
    _note_failure(".done")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher dies (SIGKILL, SIGHUP), not run on as an
    orphan in its own session."""
    launcher = os.environ.get(distributed.LAUNCHER_PID)
    if sys.platform == "linux" and launcher:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if str(os.getppid()) != launcher:  # gone, or a wrapper that forks (timeout, sudo)
            try:
                os.kill(int(launcher), 0)
            except ProcessLookupError:
                print("[launch] the launcher exited before this process started", file=sys.stderr)
                _exit_now(1)
            except PermissionError:
                pass  # alive, another user's


def _check_joined(module: str) -> None:
    """After a clean run: fails the process if the module used JAX without joining the job
    (each process then trained alone, as a job of one, and the launcher would report success)."""
    expected = int(os.environ.get(distributed.NUM_PROCESSES, "1"))
    jax_module = sys.modules.get("jax")
    if expected < 2 or jax_module is None or not _ran_jax():
        return  # the module never ran JAX (jax is imported here anyway, by `distributed`)
    if jax_module.process_count() == expected:
        return
    _note_failure()
    print(
        f"[launch] {module} ran as a job of {jax_module.process_count()} process, not of the "
        f"{expected} the launcher started: it never joined the job, so each process trained "
        "alone. Call optax_zero_one.initialize_from_env() first thing in the module, before "
        "any JAX computation.",
        file=sys.stderr,
    )
    _exit_now(1)


def _ran_jax() -> bool:
    """Whether this process started a JAX backend (``process_count`` would start one); with
    another jax, assume it ran."""
    return _graph.backends_started(default=True)


def _note_failure(suffix: str = "") -> None:
    """Tells the launcher when this process failed (before the others notice and fail too), or
    (``suffix=".done"``) when it finished its module cleanly."""
    directory = os.environ.get(distributed.FAILURE_DIR)
    if directory:
        name = os.environ.get(distributed.PROCESS_ID, "0") + suffix
        with open(os.path.join(directory, name), "w") as f:
            f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: comparable across processes


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``--processes P --devices-per-process D [options] -- MODULE ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [CHILD]:  # one process of a job this launcher started
        if len(argv) < 2:
            sys.exit(f"usage: python -m optax_zero_one.integration.launch {CHILD} MODULE [ARGS...]")
        run_module(argv[1], argv[2:])
        return 0
    if "--" not in argv:
        argv_own, rest = argv, []
    else:
        cut = argv.index("--")
        argv_own, rest = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m optax_zero_one.integration.launch",
        description="Run `python -m MODULE ARGS` as a local jax.distributed job on 127.0.0.1.",
        usage="%(prog)s --processes P --devices-per-process D [options] -- MODULE [ARGS...]",
    )
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after S s")
    parser.add_argument(
        "--netns", default=None, help="run every process inside this network namespace (root)"
    )
    opts = parser.parse_args(argv_own)
    if opts.processes < 1 or opts.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    if not 0 <= opts.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {opts.port}")
    if opts.timeout is not None and opts.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {opts.timeout}")
    if not rest:
        parser.error("give the module to run after `--`")
    wrapper = ("ip", "netns", "exec", opts.netns) if opts.netns else ()
    return launch(
        rest[0],
        rest[1:],
        processes=opts.processes,
        devices_per_process=opts.devices_per_process,
        port=opts.port,
        wrapper=wrapper,
        timeout=opts.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
