"""Step kinds: what each step of a run does, from the step number and the policies alone.

0/1 Adam's steps are of four kinds (``docs/algorithm.md``, "Step kinds"), 1-bit Adam's of two;
which kind a step is follows from the policies and the step number only, so the host knows it
before the step runs. A :class:`StepKind` is that knowledge as a static value: pass it to an
optimizer's ``update`` as ``step_kind=`` and the program traces that kind alone, with no
conditional in the graph (``docs/design.md``). A :class:`StepSchedule` lists the kinds of a run
(to count bytes and rounds, or to pick the program for each step:
:func:`~optax_zero_one.dispatch_by_kind`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_zero_one.core import _checks, _graph, policies


@dataclasses.dataclass(frozen=True)
class StepKind:
    """The static facts of one kind of step, as the transforms read them from ``step_kind=``.

    Attributes:
      name: the kind's name (``"variance"``, ``"compressed"``, ``"local"``, ``"sync"`` for 0/1
        Adam; ``"warmup"``, ``"compressed"`` for 1-bit Adam).
      phase_a: the step is at or before the freeze step (the variance may still move; the
        gradient is averaged across workers).
      variance: a phase-A step that updates the variance (a full-precision mean).
      sync: a phase-B step on which :func:`~optax_zero_one.local_step_sync` synchronises.

    Each transform reads the facts it is about: :func:`~optax_zero_one.scheduled_mean` and
    :func:`~optax_zero_one.scale_by_frozen_variance_adam` ``phase_a`` and ``variance``,
    :func:`~optax_zero_one.local_step_sync` ``phase_a`` (as ``step <= start_step``) and
    ``sync``. Every transform checks the hint against its counters (a scalar compare) and does
    not apply a step whose hint is wrong.
    """

    name: str
    phase_a: bool
    variance: bool = False
    sync: bool = False

    def __repr__(self) -> str:
        return f"StepKind({self.name!r})"


VARIANCE = StepKind("variance", phase_a=True, variance=True)
COMPRESSED = StepKind("compressed", phase_a=True)
LOCAL = StepKind("local", phase_a=False)
SYNC = StepKind("sync", phase_a=False, sync=True)
WARMUP = StepKind("warmup", phase_a=True, variance=True)
ONEBIT_COMPRESSED = StepKind("compressed", phase_a=False)

ZERO_ONE_KINDS = (VARIANCE, COMPRESSED, LOCAL, SYNC)
ONEBIT_KINDS = (WARMUP, ONEBIT_COMPRESSED)

STEP_KINDS = tuple(kind.name for kind in ZERO_ONE_KINDS)
"""0/1 Adam's step kinds, in the order of the indices :func:`step_kinds` returns."""

ONEBIT_STEP_KINDS = tuple(kind.name for kind in ONEBIT_KINDS)
"""1-bit Adam's step kinds: full-precision warm-up, then compressed momentum."""

# The extra argument with which local_step_sync tells the library's own inner transform that the
# gradients it passes are finite (it zeroes a worker's own non-finite gradient): no second check.
INPUTS_FINITE = "inputs_finite"


def check_step_kind(step_kind: Any, where: str) -> StepKind | None:
    """``step_kind`` if it is ``None`` or a :class:`StepKind`; a clear ``ValueError`` otherwise."""
    if step_kind is None or isinstance(step_kind, StepKind):
        return step_kind
    if isinstance(step_kind, str):
        raise ValueError(
            f"{where}: step_kind must be an optax_zero_one.StepKind (or None), not the string "
            f"{step_kind!r}. Take it from the optimizer's schedule: schedule.kind(step), or "
            "ozo.step_kind(opt_state, schedule) (schedule = ozo.zero_one_schedule(...) with "
            "zero_one_adam's arguments, ozo.onebit_schedule(freeze_step) for onebit_adam). "
            "0/1 Adam's kinds are 'variance', 'compressed', 'local', 'sync'; 1-bit Adam's "
            "'warmup', 'compressed' (a phase-B kind, unlike 0/1 Adam's 'compressed'), so a "
            "name alone does not say which kind is meant."
        )
    raise ValueError(
        f"{where}: step_kind must be None (decide in the graph) or an optax_zero_one.StepKind, "
        f"e.g. schedule.kind(step) of an optax_zero_one.StepSchedule; got {step_kind!r}. A "
        "plain name is ambiguous ('compressed' is a phase-A step of 0/1 Adam but a phase-B "
        "step of 1-bit Adam)."
    )


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """The kind of every step of a run, on the host, from the optimizer's policies.

    ``StepSchedule(variance_policy, local_step_policy)`` for 0/1 Adam (kinds
    :data:`STEP_KINDS`); ``StepSchedule(FullPrecisionWarmup(T))`` for 1-bit Adam (kinds
    :data:`ONEBIT_STEP_KINDS`). :func:`zero_one_schedule` and :func:`onebit_schedule` build
    them from the optimizers' arguments.

    Args:
      variance_policy: the optimizer's variance policy (its ``freeze_step`` ends phase A).
      local_step_policy: 0/1 Adam's local-step policy; ``None`` for 1-bit Adam.

    Example:
      >>> schedule = ozo.StepSchedule(ozo.VarianceDoubling(4, 2), ozo.LocalStepDoubling(2, 2))
      >>> [schedule.kind(k).name for k in (1, 3, 5, 7)]
      ['variance', 'compressed', 'sync', 'local']
    """

    variance_policy: Any
    local_step_policy: Any = None
    # the walk :meth:`kind` resumes (not a field of the schedule's value: no eq, hash, repr)
    _walk: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _checks.check_variance_policy(self.variance_policy)
        if self.local_step_policy is not None:
            _checks.check_policy(
                "local_step_policy",
                self.local_step_policy,
                "is_sync_step",
                "ozo.LocalStepDoubling(scaler=32678, clipper=16) or ozo.SyncEvery(50)",
            )
            return
        # Without a local-step policy the kinds are 1-bit Adam's: every step up to the freeze
        # a full-precision warm-up, then "compressed" (phase B). A policy with other steps
        # before its freeze (VarianceDoubling's) would name them with phase B's kind, which a
        # phase-A transform refuses at every step (a NaN each time, never recovering: a trial
        # of scheduled_mean alone). Looked at over the first steps only (a host walk, ~1 ms),
        # for the library's own policies (a user's may walk in jnp, ~40 us a step).
        vp = self.variance_policy
        freeze = getattr(vp, "freeze_step", None)
        if not _checks.is_static_number(freeze) or type(vp).__module__ != policies.__name__:
            return  # a traced freeze, or a policy of the user's (its walk may be slow): unchecked
        walk = _Walk(self)
        for k in range(1, min(int(freeze), _CHECK_STEPS) + 1):
            if walk.kind(k) is not WARMUP:
                raise ValueError(
                    f"StepSchedule({type(vp).__name__}(...)) without a local_step_policy names "
                    "1-bit Adam's kinds (every step up to the freeze a full-precision warm-up), "
                    f"but this variance policy's step {k} before its freeze is not a variance "
                    "step. For scheduled_mean or a 0/1 Adam-like composition pass a local-step "
                    "policy: its steps after the freeze pass through, e.g. "
                    "ozo.StepSchedule(variance_policy, ozo.SyncEvery(1)); for 1-bit Adam, "
                    "ozo.onebit_schedule(freeze_step)."
                )

    @property
    def kinds(self) -> tuple[StepKind, ...]:
        """This optimizer's kinds, in the order of :meth:`indices`."""
        return ONEBIT_KINDS if self.local_step_policy is None else ZERO_ONE_KINDS

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    def kinds_from(self, step: int) -> tuple[StepKind, ...]:
        """The kinds steps ``step`` and later can have (what a run resumed at ``step`` still
        needs compiled): phase B's, and the phase-A kinds the policies give between ``step``
        and the variance freeze, walked on the host (at most :data:`_WALK_LIMIT` steps; past
        that, every phase-A kind). A warm-up of pass-through steps (``start_step`` of
        :func:`local_step_schedule`) or a freeze at step 1 has no ``"compressed"`` step, and
        a precompiled run no longer compiles one."""
        freeze = self.variance_policy.freeze_step
        ahead = {k for k in self.kinds if not k.phase_a}
        if step <= freeze:
            phase_a = {k for k in self.kinds if k.phase_a}
            if freeze - step >= _WALK_LIMIT:
                ahead |= phase_a
            else:
                walk = _Walk(self)
                for k in range(step, freeze + 1):
                    ahead.add(walk.kind(k))
                    if phase_a <= ahead:
                        break
        return tuple(k for k in self.kinds if k in ahead)

    def indices(self, num_steps: int, first: int = 1) -> np.ndarray:
        """The kind (an index into :attr:`kinds`) of each step ``first..num_steps``."""
        _check_step(first)
        if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer):
            raise ValueError(f"num_steps must be a Python or NumPy int, got {num_steps!r}.")
        if num_steps >= first:  # the last step within the counters (not walked up to first)
            _check_step(num_steps)
        out = np.empty(max(num_steps - first + 1, 0), dtype=np.int8)
        walk = _Walk(self)
        for k in range(first, num_steps + 1):
            out[k - first] = self.kinds.index(walk.kind(k))
        return out

    def kind(self, step: int) -> StepKind:
        """The kind of update ``step`` (1-based). Asked for growing steps, as a training loop
        asks, it resumes the walk of the policies where the last call left it (constant time
        per step); asked for an earlier step, it walks again from step 1, jumping over the
        steps in between where the policies have a closed form (the library's own: ~10 us for
        any step; a policy without ``jump`` ~0.6 us a step)."""
        with _WALK_LOCK:
            if self._walk is None:
                object.__setattr__(self, "_walk", _Walk(self))
            return self._walk.kind(_check_step(step))


def _check_step(step: Any) -> int:
    """``step`` as an int, if it is a step number (>= 1: the first update is step 1)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise ValueError(
            f"a step number must be a Python or NumPy int, got {step!r} (a "
            f"{type(step).__name__}): pass int(step) (a device array is read back with int())."
        )
    if step > _checks.INT32_MAX:
        raise ValueError(
            f"step {step} is beyond the optimizers' int32 step counters (at most "
            f"{_checks.INT32_MAX})."
        )
    if step < 1:
        raise ValueError(
            f"steps are numbered from 1 (the first update is step 1), got {step!r}. In a loop "
            "over i = 0, 1, ... ask for schedule.kind(i + 1), or ask the state: "
            "ozo.step_kind(opt_state, schedule)."
        )
    return int(step)


_CHECK_STEPS = 1_024  # steps StepSchedule checks a 1-bit Adam variance policy over
_WALK_LIMIT = 1_000_000  # steps kinds_from walks (~1 us each) before assuming every kind
_WALK_LOCK = threading.Lock()  # StepSchedule.kind's walk is shared by the schedule's callers


class _Walk:
    """The policies advanced step by step on the host, as the optimizer advances them."""

    def __init__(self, schedule: StepSchedule):
        self.schedule = schedule
        self.variance = schedule.variance_policy.init()
        local = schedule.local_step_policy
        self.local = None if local is None else local.init()
        self.step = 0  # the last step walked past
        self.freeze = schedule.variance_policy.freeze_step

    def kind(self, step: int) -> StepKind:
        """The kind of ``step`` (>= every step asked before; restarts the walk otherwise)."""
        if step <= self.step:
            self.__init__(self.schedule)
        if step - 1 - self.step > 16:  # far ahead: jump (a loop's next step: one `next`)
            self._jump_to(step - 1)
        while self.step < step - 1:
            self._advance(self.step + 1)
        return self._kind(step)

    def _kind(self, k: int) -> StepKind:
        vp, lp = self.schedule.variance_policy, self.schedule.local_step_policy
        if k <= self.freeze:
            variance = bool(vp.is_update_step(self.variance, k))
            if lp is None:
                return WARMUP if variance else ONEBIT_COMPRESSED
            return VARIANCE if variance else COMPRESSED
        if lp is None:
            return ONEBIT_COMPRESSED
        return SYNC if bool(lp.is_sync_step(self.local, k)) else LOCAL

    def _advance(self, k: int) -> None:
        if k <= self.freeze:
            self.variance = self.schedule.variance_policy.next(self.variance, k)
        elif self.local is not None:
            self.local = self.schedule.local_step_policy.next(self.local, k)
        self.step = k

    def _jump_to(self, last: int) -> None:
        """The policies advanced through step ``last``: phase A's steps by the variance policy,
        phase B's by the local-step policy, each in one jump where the policy has one."""
        first, self.step = self.step + 1, last
        if first <= min(last, self.freeze):
            vp = self.schedule.variance_policy
            self.variance = _jump(vp, self.variance, first, min(last, self.freeze))
        if self.local is not None and max(first, self.freeze + 1) <= last:
            lp = self.schedule.local_step_policy
            self.local = _jump(lp, self.local, max(first, self.freeze + 1), last)


def _jump(policy: Any, state: Any, first: int, last: int) -> Any:
    """``policy``'s state after steps ``first..last``: its closed-form ``jump`` if it has one
    that belongs with its ``next`` (the library's policies), else ``next`` step by step."""
    if _jump_belongs(type(policy)):
        return policy.jump(state, first, last)
    for k in range(first, last + 1):
        state = policy.next(state, k)
    return state


def _jump_belongs(cls: type) -> bool:
    """Whether ``cls``'s ``jump`` was written for the policy ``cls`` is: ``cls`` defines it, or
    inherits it from a class none of whose methods a class in between overrides (a subclass
    of a library policy that changes ``next``, or a helper of it such as ``_due``, inherits a
    ``jump`` that is not its closed form: a trial's resume then refused the optimizer's own
    state). A wrapper forwarding attributes defines none, and a ``jump`` that is not a method
    (a field of that name) is no jump."""
    owner = next((c for c in cls.__mro__ if "jump" in vars(c)), None)
    if owner is None or not callable(vars(owner)["jump"]):
        return False
    for between in cls.__mro__[: cls.__mro__.index(owner)]:
        for name, value in vars(between).items():
            method = callable(value) or isinstance(value, staticmethod | classmethod)
            if method and not name.startswith("__") and hasattr(owner, name):
                return False  # overrides a method the jump was written against
    return True


def zero_one_schedule(
    var_freeze_step: int = 100_000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32_678,
    local_step_clipper: int = 16,
) -> StepSchedule:
    """The :class:`StepSchedule` of :func:`~optax_zero_one.zero_one_adam` with these arguments
    (same names, same defaults)."""
    _checks.check_variance_measured(var_freeze_step, "var_freeze_step")
    return StepSchedule(
        policies.VarianceDoubling(var_freeze_step, var_update_scaler),
        policies.LocalStepDoubling(local_step_scaler, local_step_clipper),
    )


def local_step_schedule(local_step_policy: Any, start_step: int = 0) -> StepSchedule:
    """The :class:`StepSchedule` of :func:`~optax_zero_one.local_step_sync` around an inner
    transform without phases of its own (e.g. local SGD, :func:`~optax_zero_one.diloco`):
    ``"variance"`` (pass through) up to ``start_step``, then ``"local"`` and ``"sync"``.

    Example:
      >>> schedule = ozo.local_step_schedule(ozo.SyncEvery(3))
      >>> [schedule.kind(k).name for k in (1, 2, 3, 4)]
      ['local', 'local', 'sync', 'local']
    """
    _checks.check_int("start_step", start_step, 0)
    return StepSchedule(policies.FullPrecisionWarmup(start_step), local_step_policy)


def onebit_schedule(freeze_step: int = 100_000) -> StepSchedule:
    """The :class:`StepSchedule` of :func:`~optax_zero_one.onebit_adam` with ``freeze_step``."""
    _checks.check_variance_measured(freeze_step, "freeze_step")
    return StepSchedule(policies.FullPrecisionWarmup(freeze_step))


def step_kinds(
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy,
    num_steps: int,
) -> np.ndarray:
    """0/1 Adam's kind (an index into :data:`STEP_KINDS`) of each step ``1..num_steps``.

    Example:
      >>> ozo.step_kinds(ozo.VarianceDoubling(4, 2), ozo.LocalStepDoubling(2, 2), 8)
      array([0, 0, 1, 0, 3, 3, 2, 3], dtype=int8)
    """
    return StepSchedule(variance_policy, local_step_policy).indices(num_steps)


def step_count(state: Any) -> int:
    """The number of updates an optimizer state has taken, read on the host (one device read).

    Found through the state classes' ``STEP_COUNTER`` hook; in the worker layout the counters
    are equal on every worker (checked over the entries this process holds: ``ValueError``
    where they differ, a batch of independent runs of which one skipped a step). ``ValueError``
    for a state without a counter.
    """
    return _count(state, "step_count")


def _count(state: Any, who: str) -> int:
    """:func:`step_count`, its errors naming ``who``, the public function the user called."""
    counter = _graph.step_counter(state)
    if counter is None:
        _graph.check_not_nnx_state(state, who)
        raise ValueError(
            f"{who}: this state holds no step counter of optax_zero_one's transforms; pass the "
            "optimizer state that init of zero_one_adam, onebit_adam or one of their blocks "
            "made (the whole state, or the part of it that holds theirs)."
        )
    return _graph.check_counters_agree(counter, who)


def check_hints(state: Any) -> None:
    """Raises ``ValueError`` if ``state`` refused a hinted step (``step_kind=`` that was not the
    kind its counters expected); does nothing otherwise. One small device read.

    A refused step is not applied, and nothing else says so on the device: a loop that passes
    ``step_kind`` itself (rather than through :func:`~optax_zero_one.dispatch_by_kind` or
    ``DataParallel.jit(schedule=...)``, which check it) should call this now and then, e.g.
    every few hundred steps and before a checkpoint.
    """
    _graph.check_not_nnx_state(state, "check_hints")
    _graph.check_holds_own_state(state, "check_hints")
    problems = []
    for cls, record in _graph.refusals(state):
        # every entry this process holds (a batch of runs may refuse in one of them only)
        rows = _graph.readable_values(record).reshape(-1, 2)
        refused, expected = (int(v) for v in rows[int(np.argmax(rows[:, 0]))])
        if refused:
            problems.append(
                f"{cls.__name__} refused {refused} (its counters asked for "
                f"{cls.BRANCHES[expected - 1]} at the last refusal)"
            )
    if problems:
        raise ValueError(
            "The optimizer state refused hinted steps: " + "; ".join(problems) + ". A refused "
            "step is not applied. Pass the kind the state is due: "
            "step_kind=ozo.step_kind(opt_state, schedule), or schedule.kind(k) for update k "
            "(numbered from 1), with the schedule built from the optimizer's own arguments; or "
            "let ozo.dispatch_by_kind run the loop."
        )


class Walked(NamedTuple):
    """What a host's walk of a schedule predicts of a state at its step count, as a state
    class's ``walked(walked)`` hook reads it (:func:`check_schedule`): the variance policy's
    counters, the local-step policy's (``None`` for a schedule without one), and whether
    phase B (local steps) has begun."""

    variance: Any
    local: Any
    begun: bool


def check_schedule(
    state: Any, schedule: StepSchedule, count: int | None = None, walk: _Walk | None = None
) -> None:
    """Raises ``ValueError`` if ``state`` is not where ``schedule`` puts it; one small read.

    A state carries its policies' history: the variance and local-step policies' counters and
    whether local steps have begun. A state saved by a run with other schedule arguments (another
    ``var_freeze_step``, scaler, clipper or ``start_step``) and restored into an optimizer
    built with new ones is not where the new policies put it; in the graph it trains on (0/1
    Adam resumed in phase B with a later freeze diverged some 20 steps later). Call this once
    after a restore, with the schedule of the optimizer as built now; a dispatcher
    (:func:`~optax_zero_one.dispatch_by_kind`, ``dp.jit(..., schedule=)``) does it itself. A
    policy without counters (:class:`~optax_zero_one.SyncEvery`) shows only a moved start.

    Args:
      state: the restored optimizer state (any layout).
      schedule: the :class:`StepSchedule` of the optimizer as built now.
      count: the state's step count, if already read (else read here).
      walk: the host's walk of ``schedule`` to advance (a dispatcher's own), if any.
    """
    _check_schedule_argument("check_schedule", state, schedule)
    count = step_count(state) if count is None else count  # raises for a tree without one
    nodes = _graph.walked_states(state)
    if not nodes:
        return
    walk = _Walk(schedule) if walk is None else walk
    walk.kind(count + 1)  # the policies advanced through step `count`, as the optimizer did
    walked = Walked(walk.variance, walk.local, count > walk.freeze)
    for node in nodes:
        for field, want in type(node).walked(walked):
            if want is None:
                raise ValueError(
                    f"The optimizer state keeps {type(node).__name__}.{field}, which this "
                    "schedule has no policy for (the state has local steps and the schedule 1-bit "
                    "Adam's kinds): it is not this optimizer's schedule. Build it from the "
                    "optimizer's own arguments (ozo.zero_one_schedule(...), "
                    "ozo.diloco_schedule(...), ozo.local_step_schedule(...))."
                )
            got, want = jax.tree.leaves(getattr(node, field)), jax.tree.leaves(want)
            if len(got) != len(want) or any(np.size(w) != 1 for w in want):
                continue  # a policy of another shape: nothing to compare
            got = [_graph.first_value(g) for g in got]
            if all(g == w for g, w in zip(got, want, strict=True)):
                continue
            raise ValueError(
                f"The optimizer state at step {count} is not where this schedule puts it: its "
                f"{type(node).__name__}.{field} is {[np.asarray(g).item() for g in got]}, the "
                f"schedule's policies give {[np.asarray(w).item() for w in want]} (local steps "
                f"begin after step {walk.freeze}). The state was saved by a run with other "
                "schedule arguments (var_freeze_step, var_update_scaler, local_step_scaler, "
                "local_step_clipper; sync_every, start_step), or the schedule is not the "
                "optimizer's. A state "
                "carries its policies' history, which other arguments do not replay (in the "
                "graph such a state trains on and may diverge): resume with the arguments it "
                "was trained with (docs/reliability.md)."
            )


def _check_schedule_argument(name: str, state: Any, schedule: Any) -> None:
    if not isinstance(schedule, StepSchedule):
        swapped = " (the arguments swapped?)" if isinstance(state, StepSchedule) else ""
        raise TypeError(
            f"{name}(opt_state, schedule) takes the optimizer's StepSchedule second, e.g. "
            f"ozo.zero_one_schedule(...), got a {type(schedule).__name__}{swapped}."
        )


def step_kind(state: Any, schedule: StepSchedule) -> StepKind:
    """The kind of the next update of ``state`` (host side: reads the counter once)."""
    _check_schedule_argument("step_kind", state, schedule)
    return schedule.kind(_count(state, "step_kind") + 1)
