"""When to update the variance and when to synchronise: policies as data plus pure functions.

0/1 Adam has two schedules (``docs/algorithm.md``, "Step kinds"):

- a *variance policy* decides, for steps ``k <= freeze_step``, which steps are variance steps
  (full-precision all-reduce, ``v`` updated) and which are compressed steps;
- a *local-step policy* decides, for steps ``k > freeze_step``, which steps are sync steps
  (compressed all-reduce of the accumulated update) and which are local steps (no traffic).

A policy is a small immutable object with three pure functions of its state and the step
number ``k`` (1-based):

- ``init() -> state``: the initial state, a pytree of Python ints (the optimizer stores it as
  ``int32`` arrays);
- ``is_update_step(state, k)`` (variance) / ``is_sync_step(state, k)`` (local steps): a boolean;
- ``next(state, k) -> state``: the state after step ``k`` (called for every step of the phase the
  policy governs).

Optionally, ``jump(state, first, last) -> state``: what ``next`` gives after steps ``first..last``
one by one, on Python ints, in closed form. The host's walk of a schedule
(:class:`~optax_zero_one.StepSchedule`) uses it to find the kind of a far step (a run resumed at
step 10^7) in microseconds; without it the walk calls ``next`` for every step (~0.6 us each).
A subclass that overrides any method of a policy with a ``jump`` is walked step by step unless
it defines its own ``jump``.

They use only arithmetic that works on Python ints *and* traced ``jax.Array``s, so the same
code runs inside the optimizer's compiled step and in a plain Python loop that lists the
schedule of a 100k-step run in a fraction of a second (:func:`variance_steps`,
:func:`sync_steps`). Any object with the same methods can be passed to the
optimizers instead (e.g. sync intervals tied to the learning-rate schedule, as in the paper).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from optax_zero_one.core import _checks


class IntervalState(NamedTuple):
    """State of the doubling policies: the current interval and a counter towards doubling."""

    interval: Any
    counter: Any


@runtime_checkable
class VariancePolicy(Protocol):
    """What 0/1 Adam needs of a variance policy (read-only ``freeze_step``; the methods' own
    parameter names are free)."""

    @property
    def freeze_step(self) -> int: ...

    def init(self) -> Any: ...

    def is_update_step(self, state: Any, step: Any, /) -> Any: ...

    def next(self, state: Any, step: Any, /) -> Any: ...


@runtime_checkable
class LocalStepPolicy(Protocol):
    """What 0/1 Adam needs of a local-step policy (the methods' parameter names are free)."""

    def init(self) -> Any: ...

    def is_sync_step(self, state: Any, step: Any, /) -> Any: ...

    def next(self, state: Any, step: Any, /) -> Any: ...


def _minimum(a: Any, b: int) -> Any:
    """``min(a, b)`` for a Python int or an array ``a`` (no jnp import needed)."""
    return a - (a > b) * (a - b)


class _IntervalDoubling:
    """What the two doubling policies share: the state starts at interval 1; a step is due when
    it is a multiple of the interval; counted steps double the interval every ``limit``."""

    def init(self) -> IntervalState:
        """Interval 1, counter 0."""
        return IntervalState(1, 0)

    @staticmethod
    def _due(state: IntervalState, step: Any) -> Any:
        return step % state.interval == 0

    @staticmethod
    def _counted(state: IntervalState, count: Any, limit: int, clip: int | None) -> IntervalState:
        counter = state.counter + count
        full = counter >= limit
        interval = state.interval + full * _IntervalDoubling._growth(state.interval, clip)
        return IntervalState(interval, counter * (1 - full))

    @staticmethod
    def _doubled(interval: int, times: int, clip: int | None) -> int:
        """``interval`` doubled ``times`` times as :meth:`_counted` doubles it (host ints)."""
        for _ in range(min(times, 64)):  # at the cap within 31 doublings
            interval += _IntervalDoubling._growth(interval, clip)
        return interval

    @staticmethod
    def _growth(interval: Any, clip: int | None) -> Any:
        """What one doubling adds to ``interval`` (a Python int or an int32 array): ``min(i,
        cap - i)``, so that it stops at the clip (or int32's largest value) and never leaves
        int32 on the device, where ``i * 2`` wrapped past 2**30 (to -2**31, then 0) and the
        host's Python ints did not."""
        cap = _checks.INT32_MAX if clip is None else clip
        return _minimum(interval, cap - interval)


@dataclasses.dataclass(frozen=True)
class VarianceDoubling(_IntervalDoubling):
    """0/1 Adam's variance policy: variance steps at doubling gaps until the freeze.

    Step ``k`` is a variance step if ``k % interval == 0``. Each variance step adds one to a
    counter; when it reaches ``update_scaler`` the counter resets and the interval doubles. With
    ``update_scaler = 2``: steps 1, 2, 4, 6, 8, 12, 16, 24, 32, ... After ``freeze_step`` the
    variance is frozen for good.

    Args:
      freeze_step: ``F``, the last step of phase A (variance still adapting); ``>= 0``.
      update_scaler: ``kappa``, variance steps per interval before it doubles; ``>= 1``.

    Example:
      >>> variance_steps(VarianceDoubling(freeze_step=41, update_scaler=2), num_steps=100)
      array([ 1,  2,  4,  6,  8, 12, 16, 24, 32])

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1, the variance-update schedule).
    """

    freeze_step: int = 100_000
    update_scaler: int = 16

    def __post_init__(self) -> None:
        _checks.check_int("var_freeze_step", self.freeze_step, 0, "VarianceDoubling.freeze_step")
        _checks.check_int(
            "var_update_scaler", self.update_scaler, 1, "VarianceDoubling.update_scaler"
        )

    def is_update_step(self, state: IntervalState, step: Any) -> Any:
        """Whether step ``k`` (``<= freeze_step``) updates the variance."""
        return self._due(state, step)

    def next(self, state: IntervalState, step: Any) -> IntervalState:
        """State after step ``k``: count variance steps, double the interval every ``kappa``."""
        return self._counted(state, self._due(state, step), self.update_scaler, None)

    def jump(self, state: IntervalState, first: int, last: int) -> IntervalState:
        """The state :meth:`next` gives after steps ``first..last`` (host ints, closed form:
        one loop turn per doubling of the interval)."""
        interval, counter, done = int(state.interval), int(state.counter), first - 1
        while True:
            # the variance steps after `done` are the multiples of the interval; the
            # (kappa - counter)-th of them doubles it
            doubling = (done // interval + self.update_scaler - counter) * interval
            if doubling > last:
                return IntervalState(interval, counter + last // interval - done // interval)
            interval, counter, done = self._doubled(interval, 1, None), 0, doubling


@dataclasses.dataclass(frozen=True)
class LocalStepDoubling(_IntervalDoubling):
    """0/1 Adam's local-step policy: sync intervals doubling up to a clip.

    In phase B, step ``k`` is a sync step if ``k % interval == 0`` (the absolute step, so after
    the interval grows the next sync is the next multiple). Every phase-B step adds one to a
    counter; when it reaches ``scaler`` the counter resets and the interval becomes
    ``min(clipper, 2 * interval)``.

    Args:
      scaler: ``alpha`` (``local_step_scaler``), steps per interval before it doubles; ``>= 1``.
      clipper: ``H`` (``local_step_clipper``), the largest interval; ``>= 1``.

    Example:
      >>> sync_steps(LocalStepDoubling(scaler=10, clipper=4), freeze_step=41, num_steps=68)[-7:]
      array([52, 54, 56, 58, 60, 64, 68])

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1, the local-step schedule).
    """

    scaler: int = 32_678  # sic: DeepSpeed's default (not 2**15 = 32,768)
    clipper: int = 16

    def __post_init__(self) -> None:
        _checks.check_int("local_step_scaler", self.scaler, 1, "LocalStepDoubling.scaler")
        _checks.check_int("local_step_clipper", self.clipper, 1, "LocalStepDoubling.clipper")

    def is_sync_step(self, state: IntervalState, step: Any) -> Any:
        """Whether step ``k`` (in phase B) ends a local interval with a sync."""
        return self._due(state, step)

    def next(self, state: IntervalState, step: Any) -> IntervalState:
        """State after phase-B step ``k``: count it; every ``alpha`` steps double the interval."""
        del step
        return self._counted(state, 1, self.scaler, self.clipper)

    def jump(self, state: IntervalState, first: int, last: int) -> IntervalState:
        """The state :meth:`next` gives after steps ``first..last`` (host ints, closed form)."""
        counted = int(state.counter) + max(last - first + 1, 0)
        doublings, counter = divmod(counted, self.scaler)
        return IntervalState(self._doubled(int(state.interval), doublings, self.clipper), counter)


class _NoCounters:
    """What the policies without counters share: the state is ``()`` and never changes."""

    def init(self) -> tuple:
        """No counters."""
        return ()

    def next(self, state: tuple, step: Any) -> tuple:
        """Nothing to count."""
        del step
        return state

    def jump(self, state: tuple, first: int, last: int) -> tuple:
        """Nothing to count."""
        del first, last
        return state


@dataclasses.dataclass(frozen=True)
class SyncEvery(_NoCounters):
    """A local-step policy with a fixed gap: step ``k`` is a sync step if ``k % every == 0``.

    DiLoCo's schedule (``every = H`` inner steps between outer steps). The test is on the
    absolute step, as :class:`LocalStepDoubling`'s: with ``start_step`` a multiple of
    ``every`` the first sync comes ``every`` steps after it.

    Args:
      every: ``H``, the steps between syncs; ``>= 1`` (1: a sync every step).

    Example:
      >>> sync_steps(SyncEvery(50), freeze_step=0, num_steps=200)
      array([ 50, 100, 150, 200])

    References:
      Douillard et al., DiLoCo, arXiv:2311.08105 (Algorithm 1, ``H`` inner steps per round).
    """

    every: int = 50

    def __post_init__(self) -> None:
        _checks.check_int("sync_every", self.every, 1, "SyncEvery.every")

    def is_sync_step(self, state: tuple, step: Any) -> Any:
        """Whether step ``k`` is a multiple of ``every``."""
        del state
        return step % self.every == 0


@dataclasses.dataclass(frozen=True)
class FullPrecisionWarmup(_NoCounters):
    """1-bit Adam's variance policy: every step up to ``freeze_step`` updates the variance.

    Args:
      freeze_step: ``T``, the number of full-precision warm-up steps; ``>= 0``.

    Example:
      >>> variance_steps(FullPrecisionWarmup(freeze_step=3), num_steps=10)
      array([1, 2, 3])

    References:
      Tang et al., 1-bit Adam, arXiv:2102.02888 (the warm-up stage).
    """

    freeze_step: int = 100_000

    def __post_init__(self) -> None:
        _checks.check_int("freeze_step", self.freeze_step, 0)

    def is_update_step(self, state: tuple, step: Any) -> Any:
        """Every step (up to the freeze)."""
        del state
        return step == step


def variance_walked(walked: Any) -> tuple[tuple[str, Any], ...]:
    """The variance policy's counters a host's walk of the schedule predicts for a state at
    its step count (``walked``: a :class:`~optax_zero_one.core.kinds.Walked`), as the
    ``walked`` hook of the states that keep them: a state restored under another
    ``var_update_scaler`` carries other counters (compared by a dispatcher before it runs).
    After the freeze they no longer act, and nothing is compared (the local-step policy's
    counters and ``anchored`` say where phase B is)."""
    return () if walked.begun else (("variance_policy", walked.variance),)


def advance(policy: Any, state: Any, step: Any, active: Any) -> Any:
    """``policy.next(state, step)`` where ``active``, else ``state``, in ``state``'s dtypes
    (the state of a policy that governs only some steps, e.g. phase A or phase B)."""
    if isinstance(active, bool | np.bool_):
        new = policy.next(state, step) if active else state
        return jax.tree.map(lambda n, o: jnp.asarray(n, jnp.result_type(o)), new, state)
    return jax.tree.map(
        lambda new, old: jnp.where(active, jnp.asarray(new, jnp.result_type(old)), old),
        policy.next(state, step),
        state,
    )


def _fires(policy: Any, predicate: Any, first: int, last: int) -> list[int]:
    state, steps = policy.init(), []
    for k in range(first, last + 1):
        if predicate(state, k):
            steps.append(k)
        state = policy.next(state, k)
    return steps


def variance_steps(policy: VariancePolicy, num_steps: int) -> np.ndarray:
    """Variance steps of any variance policy among ``1..min(num_steps, freeze_step)``."""
    return np.asarray(
        _fires(policy, policy.is_update_step, 1, min(num_steps, policy.freeze_step)), dtype=int
    )


def sync_steps(policy: LocalStepPolicy, freeze_step: int, num_steps: int) -> np.ndarray:
    """Sync steps of any local-step policy among ``freeze_step+1..num_steps``."""
    return np.asarray(_fires(policy, policy.is_sync_step, freeze_step + 1, num_steps), dtype=int)
