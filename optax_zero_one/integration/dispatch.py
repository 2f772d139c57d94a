"""One compiled program per step kind, chosen on the host: the loop the library owns.

A step's kind follows from its number (:class:`~optax_zero_one.StepSchedule`), so the host can
pick a program compiled for that kind alone, and the device runs no conditional
(``docs/design.md``, "Step kinds"). :func:`dispatch_by_kind` does it for any step function:
``jax.jit``, ``jax.pmap``, ``jax.shard_map`` or ``jax.vmap`` steps alike;
:meth:`~optax_zero_one.DataParallel.jit` uses it.

The step number lives on the host. It is read from the state once, at the first call and
whenever the state passed in is not the one this dispatcher returned last (a restore), never
per step. The counters stay traced arrays in every program, so no program is ever compiled
twice. What the host cannot know is a step the state did not take (a non-finite step skipped
by every worker keeps the counters): it learns that a few steps later from a counter copied to
the host in the background, and moves its step number back. A step whose hint does not match
the state is not applied by the optimizer (each transform checks its hint); if that happens
while the host's step number was right, the schedule given here is not the optimizer's, and
the next call raises an error naming the kind the state expected.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_zero_one.core import _graph, kinds
from optax_zero_one.core.kinds import StepKind, StepSchedule


@dataclasses.dataclass
class _Pending:
    step: int  # the step number the host assumed
    kind: StepKind
    snapshot: Any  # [count, refused hints of each state...] after the call, on its way to host
    stale: bool = False  # expected to be refused: dispatched before the host learnt of a skip


@jax.jit
def _snapshot(leaves: list) -> jax.Array:
    """The counter and the refused-hint counts of one worker, one small int32 array (a copy:
    the state itself is donated to the next step)."""
    counter, *refused = leaves
    parts = [jnp.reshape(counter, -1)[:1].astype(jnp.int32)]
    parts += [jnp.reshape(r, -1)[:2].astype(jnp.int32) for r in refused]
    return jnp.concatenate(parts)


def _first_shard(x: Any) -> Any:
    shards = getattr(x, "addressable_shards", None)
    return shards[0].data if shards else x


class KindDispatcher:
    """A step function that runs, at each call, the program compiled for the step's kind.

    Build it with :func:`dispatch_by_kind`. Attributes (read-only): ``programs``, the compiled
    programs by kind name; ``step``, the step number the next call is for; ``skipped``, the
    steps the state did not take (non-finite, skipped by every worker); ``lost``, steps not
    applied because they were dispatched before the host learnt of a skip and the kind had
    changed (at most ``lag`` per skip; their batch is dropped, as for a skipped step).
    """

    def __init__(
        self,
        compile_kind: Callable[[StepKind], Callable[..., Any]],
        schedule: StepSchedule,
        state_index: int = 1,
        lag: int = 2,
    ):
        if not isinstance(schedule, StepSchedule):
            raise ValueError(
                f"dispatch_by_kind needs an optax_zero_one.StepSchedule (e.g. "
                f"ozo.zero_one_schedule(...)), got {schedule!r}."
            )
        if not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an int >= 1, got {lag!r}.")
        self._compile = compile_kind
        self.schedule = schedule
        self._state_index = state_index
        self._lag = lag
        self.programs: dict[str, Callable[..., Any]] = {}
        self._walk = kinds._Walk(schedule)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._last_counter: Any = None
        self._confirmed: np.ndarray | None = None  # the last settled snapshot
        self._types: list[type] = []  # the states whose refused hints a snapshot holds
        self._layout: tuple[Any, list[int], list[type]] | None = None  # see _probe
        self.step: int | None = None
        self.skipped = 0
        self.lost = 0

    def next_kind(self, state: Any) -> StepKind:
        """The kind the next call with ``state`` will run (reads the counter if ``state`` is
        not the one this dispatcher returned last, as the call would)."""
        self._sync_with(state)
        return self._walk.kind(self.step)

    def program(self, kind: StepKind) -> Callable[..., Any]:
        """The program for ``kind`` (compiled at its first use)."""
        if kind.name not in self.programs:
            self.programs[kind.name] = self._compile(kind)
        return self.programs[kind.name]

    def __call__(self, *args: Any) -> Any:
        self._sync_with(args[self._state_index])
        kind = self._walk.kind(self.step)
        out = self.program(kind)(*args)
        counter, refused = self._probe(out[self._state_index])
        snapshot = self._snapshot(counter, refused)
        snapshot.copy_to_host_async()
        self._pending.append(_Pending(self.step, kind, snapshot))
        self._last_counter = counter
        self.step += 1
        while len(self._pending) > self._lag:
            self._settle(self._pending.popleft())
        return out

    def settle(self) -> None:
        """Checks every step still in flight (waits for them); raises as a call would."""
        while self._pending:
            self._settle(self._pending.popleft())

    def _probe(self, state: Any) -> tuple[Any, list]:
        """The state's step counter and its refused-hint arrays, found through the hooks once
        per tree structure and then by position (one flatten per step, not a walk per hook)."""
        leaves, treedef = jax.tree.flatten(state)
        if self._layout is None or self._layout[0] != treedef:
            counter = _graph.step_counter(state)
            refused = _graph.refusals(state)
            at = {id(x): i for i, x in enumerate(leaves)}
            wanted = [counter] + [r for _, r in refused]
            if counter is None or any(id(x) not in at for x in wanted):
                return counter, refused  # not arrays of this tree: no shortcut
            self._layout = (treedef, [at[id(x)] for x in wanted], [cls for cls, _ in refused])
        _, where, types = self._layout
        return leaves[where[0]], [(cls, leaves[i]) for cls, i in zip(types, where[1:])]

    def _snapshot(self, counter: Any, refused: list) -> jax.Array:
        self._types = [cls for cls, _ in refused]
        return _snapshot([_first_shard(counter)] + [_first_shard(r) for _, r in refused])

    def _sync_with(self, state: Any) -> None:
        counter, refused = self._probe(state)
        if counter is None:
            raise ValueError(
                f"argument {self._state_index} of the step holds no optimizer state of "
                "optax_zero_one (no step counter); pass state_index= the position of opt_state."
            )
        if counter is not self._last_counter:  # first call, or a state from elsewhere
            self._pending.clear()
            self._confirmed = np.asarray(self._snapshot(counter, refused))
            self.step = int(self._confirmed[0]) + 1
            self._last_counter = counter

    def _settle(self, done: _Pending) -> None:
        now = np.asarray(done.snapshot)
        before, self._confirmed = self._confirmed, now
        if now[0] == before[0] + 1:
            return
        # The state did not take this step: a hint it refused, or a non-finite step skipped.
        refused = [
            (cls, int(now[2 + 2 * i]))
            for i, cls in enumerate(self._types)
            if now[1 + 2 * i] > before[1 + 2 * i]
        ]
        if refused and not done.stale:
            asked = "; ".join(
                f"{cls.__name__} asked for {cls.BRANCHES[b - 1]}" for cls, b in refused
            )
            raise ValueError(
                f"step {int(before[0]) + 1} was run with the program for the "
                f"{done.kind.name!r} kind (from the schedule given to dispatch_by_kind), but "
                f"the optimizer state's counters expected another kind: {asked}. The step was "
                "not applied. The schedule is not the optimizer's: build it from the same "
                "policies (e.g. ozo.zero_one_schedule(var_freeze_step=..., ...) with "
                "zero_one_adam's arguments)."
            )
        if refused:
            self.lost += 1
        else:
            self.skipped += 1
        self._predict()

    def _predict(self) -> None:
        """The step number of the next call, from the last count the host knows and the kinds
        of the calls still in flight: each will be taken if its kind is the one due at the
        state's step then, refused otherwise (a refusal the host then expects: ``stale``)."""
        count = int(self._confirmed[0])
        walk = kinds._Walk(self.schedule)
        for later in self._pending:
            taken = later.kind == walk.kind(count + 1)
            later.stale = not taken
            count += taken
        self.step = count + 1


def dispatch_by_kind(
    compile_kind: Callable[[StepKind], Callable[..., Any]],
    schedule: StepSchedule,
    *,
    state_index: int = 1,
    lag: int = 2,
) -> KindDispatcher:
    """A step function that calls, at every step, a program compiled for that step's kind.

    ``compile_kind(kind)`` returns the program for one kind, typically your step with
    ``step_kind=kind`` passed on to the optimizer's ``update``, jitted or mapped as you run it.
    It is called once per kind, the first time the kind comes up (four programs at most for
    0/1 Adam, two for 1-bit Adam); the counters stay arrays, so no program recompiles as the
    steps go by.

    Args:
      compile_kind: maps a :class:`~optax_zero_one.StepKind` to a callable step.
      schedule: the optimizer's :class:`~optax_zero_one.StepSchedule` (same policies).
      state_index: the position of the optimizer state among the step's arguments and among
        its results (default 1: ``step(params, opt_state, ...) -> (params, opt_state, ...)``).
      lag: how many steps behind the host checks that the state took each step (it reads a
        counter copied in the background, so the device never waits for the host).

    Returns:
      A :class:`KindDispatcher`, called like the step.

    Example:
      >>> policies = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
      ...                 local_step_clipper=2)
      >>> tx = ozo.zero_one_adam(1e-2, axis_name="w", **policies)
      >>> schedule = ozo.zero_one_schedule(**policies)  # the same policies
      >>> def train_step(params, opt_state, grads, step_kind=None):  # one worker
      ...     updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> def compile_kind(kind):
      ...     return jax.jit(jax.vmap(functools.partial(train_step, step_kind=kind), axis_name="w"))
      >>> step = ozo.dispatch_by_kind(compile_kind, schedule)
      >>> params = ozo.replicate({"w": jnp.zeros(8)}, 2)  # 2 workers
      >>> opt_state = jax.vmap(tx.init, axis_name="w")(params)
      >>> for k in range(8):
      ...     params, opt_state = step(params, opt_state, {"w": jnp.full((2, 8), 1.0 + k)})
      >>> sorted(step.programs)
      ['compressed', 'local', 'sync', 'variance']
    """
    return KindDispatcher(compile_kind, schedule, state_index, lag)
