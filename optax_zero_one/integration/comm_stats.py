"""What a compiled program communicates: collectives and bytes, read from optimised HLO.

``comm_stats(fn, *args)`` compiles ``fn`` (``jax.jit(fn).lower(*args).compile()``; arguments may
be ``jax.ShapeDtypeStruct`` so nothing is allocated) and walks the optimised HLO text:

- every collective instruction (``all-reduce``, ``all-gather``, ``all-to-all``,
  ``reduce-scatter``, ``collective-permute``, ``collective-broadcast``; async ``-start``/``-done``
  pairs counted once), with its operand dtypes and bytes (operand shapes come from a table of
  instruction definitions, since HLO does not print them inline), its group size (from
  ``replica_groups``, explicit or iota form, or the module's partition count);
- how often it runs per call: inside a ``while`` body it runs ``known_trip_count`` times (unknown
  trip counts are reported as ``None``); inside a ``conditional`` branch it is flagged, since it
  runs only when that branch is taken.

Bytes *sent per device* follow the usual bandwidth-optimal algorithms, for a payload of ``S``
bytes per device and a group of ``N``: all-reduce ``2 S (N-1)/N`` (ring), all-gather
``S (N-1)`` (every device's shard reaches ``N-1`` others), all-to-all and reduce-scatter
``S (N-1)/N``, collective-permute ``S``.

JAX offers the optimised program only as text here (``compiled.as_text()``; jaxlib ships no
HLO protocol-buffer bindings), so this module is the one place that parses it, with regular
expressions written against the text of the jax versions in :data:`CHECKED_WITH_JAX`
(``tests/test_comm_stats.py`` compiles known programs on the installed jax and checks what is
read). Should XLA's text format move, :func:`parse_hlo` raises rather than miss a collective: it
counts every collective opcode in the text independently of the parse and compares.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_zero_one.integration import dispatch

_KINDS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "reduce-scatter",
    "collective-permute",
    "collective-broadcast",
)
_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
_NOT_DATA = {"token", "opaque"}  # HLO types that carry no bytes
CHECKED_WITH_JAX = ("0.10",)
"""The jax versions (major.minor) whose HLO text :func:`parse_hlo` was written and tested on."""

_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"all-to-all"``, ``"reduce-scatter"``,
        ``"collective-permute"`` or ``"collective-broadcast"``.
      dtypes: the operand element types, e.g. ``("u8",)``.
      payload_bytes: operand bytes on one device, all operands together.
      group_size: number of devices taking part.
      sent_bytes: bytes one device sends per execution (see the module docstring).
      executions: times it runs per call of the program (``None`` if inside a loop of unknown
        trip count).
      conditional: whether it sits in a ``conditional`` branch (runs only when taken).
      name: the instruction's name in the HLO.
      groups: the device groups (partition ids), when the HLO names them; ``None`` when the
        group is every device of the program.
    """

    kind: str
    dtypes: tuple[str, ...]
    payload_bytes: int
    group_size: int
    sent_bytes: float
    executions: int | None
    conditional: bool
    name: str
    groups: tuple[tuple[int, ...], ...] | None = None

    def mesh_axes(self, mesh: jax.sharding.Mesh) -> tuple[str, ...]:
        """The axes of ``mesh`` this collective runs over: those along which the members of a
        group differ (partition ``p`` is ``mesh.devices.flat[p]``; a permute's groups are its
        source-target pairs); every axis of size above one when the group is the whole
        program."""
        shape = mesh.devices.shape
        if not self.groups:
            return tuple(a for a, n in zip(mesh.axis_names, shape) if n > 1)
        varies = np.zeros(len(shape), bool)
        for group in self.groups:
            coords = np.array(np.unravel_index(np.asarray(group), shape))
            varies |= (coords != coords[:, :1]).any(axis=1)
        return tuple(a for a, v in zip(mesh.axis_names, varies) if v)


@dataclasses.dataclass(frozen=True)
class CommStats:
    """The collectives of one compiled program and the bytes each device sends per call."""

    collectives: tuple[Collective, ...]

    def _runs(self, collective: Collective) -> int:
        """How often ``collective`` runs per call; a clear error where that is not known (a
        total that counted it as 0 would be silently short)."""
        if collective.executions is None:
            raise ValueError(
                f"The {collective.kind} {collective.name} runs inside a loop whose trip count "
                "the compiled program does not state, so totals over this program are not "
                "known (.collectives lists it, executions=None). An optimizer's update decides "
                "its step kind in the graph without a hint: pass step_kind= (one kind's "
                "program holds no loop), e.g. ozo.comm_stats(functools.partial(step, "
                "step_kind=schedule.kind(k)), *args)."
            )
        return collective.executions

    def count(self, kind: str | None = None) -> int:
        """Number of collective instructions (of ``kind``, if given), each counted once."""
        return sum(1 for c in self.collectives if kind is None or c.kind == kind)

    @property
    def launches(self) -> int:
        """Collective executions per call (instructions times trip counts; branches included)."""
        return sum(self._runs(c) for c in self.collectives)

    @property
    def sent_bytes_per_device(self) -> float:
        """Bytes one device sends per call, all collectives together (branches included)."""
        return sum(c.sent_bytes * self._runs(c) for c in self.collectives)

    @property
    def payload_bytes(self) -> int:
        """Operand bytes of all collectives per call on one device."""
        return sum(c.payload_bytes * self._runs(c) for c in self.collectives)

    def sent_bytes_by_axes(self, mesh: jax.sharding.Mesh) -> dict[tuple[str, ...], float]:
        """Bytes one device sends per call, per tuple of mesh axes the collectives run over
        (e.g. ``{("node",): ..., ("local",): ...}`` for a hierarchical mean)."""
        out: dict[tuple[str, ...], float] = {}
        for c in self.collectives:
            axes = c.mesh_axes(mesh)
            out[axes] = out.get(axes, 0.0) + c.sent_bytes * self._runs(c)
        return out

    def table(self) -> str:
        """A readable one-line-per-collective table."""
        rows = [f"{'kind':<20} {'dtypes':<12} {'N':>4} {'payload B':>12} {'sent B':>12} runs"]
        for c in self.collectives:
            runs = "?" if c.executions is None else str(c.executions)
            runs += " (in branch)" if c.conditional else ""
            rows.append(
                f"{c.kind:<20} {','.join(c.dtypes):<12} {c.group_size:>4} "
                f"{c.payload_bytes:>12,} {c.sent_bytes:>12,.0f} {runs}"
            )
        if any(c.executions is None for c in self.collectives):
            rows.append("total sent per device: not known (a loop of unknown trip count)")
        else:
            rows.append(f"total sent per device: {self.sent_bytes_per_device:,.0f} B")
        return "\n".join(rows)


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type string (a tuple type sums its elements)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _NOT_DATA:
            continue
        if dtype not in _BITS:
            raise ValueError(
                f"array_bytes: HLO element type {dtype!r} (in {type_text!r}) has no known "
                "width, so its bytes cannot be counted (counting them as 0 would understate "
                "the traffic). Please report it with the jax version."
            )
        numel = 1
        for d in filter(None, dims.split(",")):
            numel *= int(d)
        total += numel * _BITS[dtype] // 8
    return total


def _split_type(rhs: str) -> tuple[str, str]:
    """Splits ``TYPE opcode(...)...`` into the type and the rest."""
    rhs = rhs.strip()
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].strip()
    head, _, rest = rhs.partition(" ")
    return head, rest.strip()


def _operands(rest: str) -> tuple[str, list[str], str]:
    """Opcode, operand names and attribute text of ``opcode(operands), attrs``."""
    opcode, _, tail = rest.partition("(")
    depth, i = 1, 0
    while i < len(tail) and depth:
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        i += 1
    inside, attrs = tail[: i - 1], tail[i:]
    names, depth, current = [], 0, ""
    for ch in inside + ",":
        if ch == "," and depth == 0:
            token = current.strip().split(" ")[-1].lstrip("%")
            if token:
                names.append(token)
            current = ""
            continue
        depth += ch in "({["
        depth -= ch in ")}]"
        current += ch
    return opcode.strip(), names, attrs


def _groups(attrs: str) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups of a collective's attributes (explicit or iota form), or ``None``."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(count, size))
    explicit = re.search(r"replica_groups=\{(\{[\d,{}\s]*\})\}", attrs)
    if explicit:
        found = re.findall(r"\{([\d,\s]+)\}", explicit.group(1))
        return tuple(tuple(int(i) for i in g.split(",")) for g in found) or None
    pairs = _pairs(attrs)
    if pairs is not None:  # a collective-permute: each (source, target) pair is a group
        return pairs or None
    return _mesh_groups(attrs)


def _pairs(attrs: str) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's ``source_target_pairs``, or ``None`` without them."""
    found = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not found:
        return None
    return tuple((int(a), int(b)) for a, b in re.findall(r"(\d+)\s*,\s*(\d+)", found.group(1)))


def _mesh_groups(attrs: str) -> tuple[tuple[int, ...], ...] | None:
    """The groups of the mesh form, ``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``:
    the devices numbered row-major over the named dimensions, one group per position on the
    dimensions not listed, running over those listed (here 4 groups of 2)."""
    form = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if not form:
        return None
    dims = re.findall(r"'([^']+)'=(\d+)", form.group(1))
    inside = set(re.findall(r"'([^']+)'", form.group(2)))
    sizes = [int(size) for _, size in dims]
    keep = [i for i, (name, _) in enumerate(dims) if name in inside]
    rest = [i for i, (name, _) in enumerate(dims) if name not in inside]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(rest + keep)
    size = int(np.prod([sizes[i] for i in keep]))
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, size))


def _group_size(attrs: str, default: int) -> int:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    groups = _mesh_groups(attrs)
    if groups:
        return len(groups[0])
    explicit = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if explicit and explicit.group(1).strip():
        return len(explicit.group(1).split(","))
    pairs = _pairs(attrs)
    if pairs is not None:
        return len({device for pair in pairs for device in pair})
    return default


def _sent_bytes(kind: str, payload: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * payload * (n - 1) / n
    if kind == "all-gather":
        return float(payload * (n - 1))
    if kind in ("all-to-all", "reduce-scatter"):
        return payload * (n - 1) / n
    return float(payload)  # collective-permute / broadcast: the operand once


def parse_hlo(text: str) -> CommStats:
    """Collectives and bytes of an optimised HLO module given as text (see module docstring)."""
    text = _COMMENT.sub("", text)
    header = text.splitlines()[0] if text else ""
    parts = re.search(r"num_partitions=(\d+)", header)
    reps = re.search(r"replica_count=(\d+)", header)
    default_group = max(int(parts.group(1)) if parts else 1, int(reps.group(1)) if reps else 1)

    computations: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
    shapes: dict[str, str] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head and "=" not in line.split("(")[0]:
            current = head.group(2)
            computations[current] = []
            if head.group(1):
                entry = current
            continue
        define = _DEF.match(line)
        if current is None or not define:
            continue
        name, rhs = define.groups()
        type_text, rest = _split_type(rhs)
        opcode, operands, attrs = _operands(rest)
        shapes[name] = type_text
        computations[current].append((name, type_text, opcode, operands, attrs))

    found: list[Collective] = []

    def walk(comp: str, runs: int | None, in_branch: bool) -> None:
        for name, _type, opcode, operands, attrs in computations.get(comp, []):
            base = opcode.removesuffix("-start")
            if base in _KINDS and not opcode.endswith("-done"):
                payload = sum(array_bytes(shapes.get(op, "")) for op in operands)
                dtypes = sorted(
                    {d for op in operands for d, _ in _ARRAY.findall(shapes.get(op, ""))}
                )
                n = _group_size(attrs, default_group)
                found.append(
                    Collective(
                        base,
                        tuple(dtypes),
                        payload,
                        n,
                        _sent_bytes(base, payload, n),
                        runs,
                        in_branch,
                        name,
                        _groups(attrs),
                    )
                )
            if opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
                inner = None if runs is None or not trip else runs * int(trip.group(1))
                for key in ("body", "condition"):
                    called = re.search(key + r"=%?([\w.\-]+)", attrs)
                    if called:
                        walk(called.group(1), inner, in_branch)
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                    if branches
                    else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", attrs)
                )
                for branch in names:
                    walk(branch, runs, True)
            else:
                for called in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", attrs):
                    walk(called, runs, in_branch)

    if entry is not None:
        walk(entry, 1, False)
    _check_all_parsed(text, entry, computations)
    return CommStats(tuple(found))


_ANY_COLLECTIVE = re.compile(r"=[^=\n]*?\b(" + "|".join(_KINDS) + r")(-start)?\(")


def _check_all_parsed(text: str, entry: str | None, computations: dict[str, list]) -> None:
    """Raises if the text holds collectives (counted by their opcodes alone) that the parse did
    not see as instructions: the sign of a text format this parser does not know."""
    in_text = len(_ANY_COLLECTIVE.findall(text))
    parsed = sum(
        1
        for instructions in computations.values()
        for _, _, opcode, _, _ in instructions
        if opcode.removesuffix("-start") in _KINDS
    )
    if (in_text and entry is None) or parsed != in_text:
        raise RuntimeError(
            f"parse_hlo read {parsed} collective instructions where the text has {in_text} "
            f"(entry computation {'not ' if entry is None else ''}found): XLA's HLO text format "
            f"seems to have changed (jax {jax.__version__}; parse_hlo was checked with jax "
            f"{', '.join(CHECKED_WITH_JAX)}). The byte counts would be wrong; please report it."
        )


def comm_stats(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommStats:
    """Compiles ``fn(*args, **kwargs)`` and reports the collectives it contains.

    Args:
      fn: a function, jitted or not (it is wrapped in ``jax.jit``); typically a
        ``jax.shard_map``/``jax.pmap`` program over the worker axis.
      *args: its arguments, arrays or ``jax.ShapeDtypeStruct`` (compile only, no allocation).
      **kwargs: keyword arguments: those holding arrays (or ``jax.ShapeDtypeStruct``) are
        traced like ``args``; any other (``step_kind=``, a flag, a string) is bound to ``fn``
        as a constant of the compiled program.

    Returns:
      A :class:`CommStats`: one :class:`Collective` per collective instruction, with bytes
      sent per device, and totals (``sent_bytes_per_device``, ``launches``, ``count(kind)``).

    Example:
      >>> x = jnp.ones((2, 1024))  # 2 devices, 4 KiB each
      >>> mean = jax.pmap(lambda x: jax.lax.pmean(x, "i"), "i", devices=jax.devices()[:2])
      >>> stats = comm_stats(mean, x)
      >>> stats.count("all-reduce"), stats.sent_bytes_per_device
      (1, 4096.0)
    """
    if isinstance(fn, dispatch.KindDispatcher):
        names = ", ".join(repr(k.name) for k in fn.schedule.kinds_from(1))
        raise ValueError(
            "comm_stats reports one compiled program, and a step dispatched by kind runs one "
            f"per kind ({names}). Pass the program of one kind, e.g. "
            "ozo.comm_stats(dp.jit(functools.partial(step, step_kind=kind)), *args) with kind "
            "from schedule.kinds_from(1), the kinds a run meets (or your compile_kind(kind) "
            "for ozo.dispatch_by_kind)."
        )
    arrays = (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic)
    static = {
        k: v
        for k, v in kwargs.items()
        if not any(isinstance(leaf, arrays) for leaf in jax.tree.leaves(v))
    }
    traced = {k: v for k, v in kwargs.items() if k not in static}
    lowered = jax.jit(functools.partial(fn, **static) if static else fn).lower(*args, **traced)
    return parse_hlo(lowered.compile().as_text())
