"""A link of fixed bandwidth on one machine: a private network namespace with a shaped loopback.

Processes started inside the namespace (``ip netns exec NAME ...``) see only its loopback
interface, so all their traffic, on 127.0.0.1, crosses one token-bucket-shaped link::

    ip netns add NAME
    ip -n NAME link set lo mtu 9000 up
    ip netns exec NAME tc qdisc replace dev lo root tbf rate 100mbit burst 32kb latency 400ms

The MTU is set to 9000 (jumbo frames, as in a data centre) so that a small bucket (``burst``,
about 3.5 frames) suffices: with the default 64 KiB loopback MTU the bucket would have to be
larger than a frame, and a large bucket lets bursts through above the rate. ``latency`` only
bounds the queue (``rate x latency``), it adds no delay. Every process's traffic shares the one
link: it is a bus, not a switch with one port per process.

Needs root and iproute2 (``ip``, ``tc``). :func:`unavailable` says why it cannot run;
:func:`shaped_namespace` creates the namespace and always removes it, also on Ctrl-C, SIGTERM
or SIGHUP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator

PREFIX = "ozo-net-"
BURST = "32kb"
QUEUE_LATENCY = "400ms"
MTU = 9000
STATS = "/sys/class/net/lo/statistics/tx_bytes"


def unavailable() -> str | None:
    """Why a shaped namespace cannot be made here, or ``None`` if it (probably) can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (it creates a network namespace and shapes its loopback with tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found: install iproute2 "
            "(e.g. `apt-get install -y iproute2`)"
        )
    return None


def _run(*cmd: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {result.stderr.strip() or result.stdout}")
    return result.stdout


@dataclasses.dataclass(frozen=True)
class Namespace:
    """A network namespace; ``exec_prefix`` runs a command inside it."""

    name: str

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``100mbit`` or ``1gbit`` (``nan`` if not of that
    form)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return float("nan")


def set_rate(rate: str, namespace: Namespace | None = None) -> None:
    """Shapes the loopback to ``rate`` (tc syntax, e.g. ``100mbit``, ``1gbit``).

    ``namespace=None``: the loopback of the namespace this process runs in.
    """
    prefix = namespace.exec_prefix if namespace else ()
    _run(*prefix, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
         "burst", BURST, "latency", QUEUE_LATENCY)  # fmt: skip


def qdisc_drops(namespace: Namespace | None = None) -> int:
    """Packets the shaper has dropped so far (a full queue; TCP then retransmits)."""
    prefix = namespace.exec_prefix if namespace else ()
    text = _run(*prefix, "tc", "-s", "qdisc", "show", "dev", "lo")
    return sum(int(n) for n in re.findall(r"dropped (\d+)", text))


def tx_bytes(namespace: Namespace | None = None) -> int:
    """Bytes sent on the loopback so far (each packet once; headers included)."""
    if namespace is None:
        with open(STATS) as f:
            return int(f.read())
    return int(_run(*namespace.exec_prefix, "cat", STATS))


def remove_stale() -> list[str]:
    """Deletes namespaces left by earlier runs that were killed (their process is gone)."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(PREFIX + r"(\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived; unwinds like Ctrl-C so that cleanup runs."""


@contextlib.contextmanager
def shaped_namespace(rate: str) -> Iterator[Namespace]:
    """A fresh namespace, loopback up and shaped to ``rate``; deleted on exit, whatever happens.

    SIGTERM and SIGHUP are turned into an exception while inside, so that the namespace is
    removed on them too (Ctrl-C already raises ``KeyboardInterrupt``).
    """
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    ns = Namespace(f"{PREFIX}{os.getpid()}")

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _run("ip", "netns", "add", ns.name)
        try:
            _run("ip", "-n", ns.name, "link", "set", "lo", "mtu", str(MTU), "up")
            set_rate(rate, ns)
            yield ns
        finally:
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
    except _Interrupted as err:
        raise KeyboardInterrupt(f"signal {err.args[0]}") from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
