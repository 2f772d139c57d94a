"""Step kinds: what each step of a run communicates, from the policies alone; pinning a state
to one step.

0/1 Adam's steps are of four kinds (``docs/algorithm.md``, "Step kinds"), 1-bit Adam's of two;
which kind a step is follows from the policies and the step number only. So a whole run's
kinds can be listed without running anything (to count bytes and rounds), and a state can be
*pinned* to step ``k``: its counters replaced by the Python ints they hold before step ``k``,
so that tracing ``update`` sees the kind as a constant and compiles that kind alone (to read
its collectives, or to time it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_zero_one import _graph, policies
from optax_zero_one.frozen_variance import FrozenVarianceAdamState
from optax_zero_one.local_steps import LocalStepSyncState
from optax_zero_one.scheduled_mean import ScheduledMeanState

STEP_KINDS = ("variance", "compressed", "local", "sync")
"""0/1 Adam's step kinds, in the order of the indices :func:`step_kinds` returns."""

ONEBIT_STEP_KINDS = ("warmup", "compressed")
"""1-bit Adam's step kinds: full-precision warm-up, then compressed momentum."""

VARIANCE, COMPRESSED, LOCAL, SYNC = range(4)


def kind_of(
    step: Any,
    variance_state: Any,
    local_state: Any,
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy,
) -> Any:
    """The 0/1 Adam kind of ``step`` given the policies' counters before it (ints or arrays)."""
    phase_a = step <= variance_policy.freeze_step
    variance = variance_policy.is_update_step(variance_state, step)
    sync = local_step_policy.is_sync_step(local_state, step)
    if all(isinstance(v, bool | int | np.bool_ | np.integer) for v in (phase_a, variance, sync)):
        return (VARIANCE if variance else COMPRESSED) if phase_a else (SYNC if sync else LOCAL)
    return jnp.where(
        phase_a, jnp.where(variance, VARIANCE, COMPRESSED), jnp.where(sync, SYNC, LOCAL)
    ).astype(jnp.int32)


def step_kinds(
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy,
    num_steps: int,
) -> np.ndarray:
    """0/1 Adam's kind (an index into :data:`STEP_KINDS`) of each step ``1..num_steps``.

    Walks the policies once, advancing them as the optimizer does (the variance policy through
    phase A, the local-step policy through phase B).

    Example:
      >>> step_kinds(VarianceDoubling(4, 2), LocalStepDoubling(2, 2), 8)
      array([0, 0, 1, 0, 2, 3, 2, 3], dtype=int8)
    """
    vs, ls = variance_policy.init(), local_step_policy.init()
    kinds = np.empty(num_steps, dtype=np.int8)
    for k in range(1, num_steps + 1):
        kinds[k - 1] = kind_of(k, vs, ls, variance_policy, local_step_policy)
        if k <= variance_policy.freeze_step:
            vs = variance_policy.next(vs, k)
        else:
            ls = local_step_policy.next(ls, k)
    return kinds


def onebit_step_kinds(freeze_step: int, num_steps: int) -> np.ndarray:
    """1-bit Adam's kind (an index into :data:`ONEBIT_STEP_KINDS`) of each step."""
    return (np.arange(1, num_steps + 1) > freeze_step).astype(np.int8)


def step_kind(
    state: Any,
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy | None = None,
) -> Any:
    """The kind of the next update of a 0/1 Adam (or 1-bit Adam) state, from its counters.

    An int32 array (an index into :data:`STEP_KINDS`; for 1-bit Adam, with no local-step
    policy, into :data:`ONEBIT_STEP_KINDS`), or a Python int for a pinned state.
    """
    scheduled = _graph.only_node(state, ScheduledMeanState, "step_kind")
    step = scheduled.count + 1
    if local_step_policy is None:
        after = step > variance_policy.freeze_step
        return int(after) if isinstance(after, bool) else after.astype("int32")
    local = _graph.only_node(state, LocalStepSyncState, "step_kind")
    return kind_of(
        step, scheduled.variance_policy, local.local_step_policy, variance_policy, local_step_policy
    )


def pin_step(
    state: Any,
    step: int,
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy | None = None,
    start_step: int | None = None,
) -> Any:
    """``state`` with every counter replaced by the Python int it holds before update ``step``.

    Tracing ``update`` on the result compiles only that step's kind (the kind is a constant).
    The buffers are left as they are, so a pinned state is for compiling and timing one kind,
    not for training. Pins the counters of :func:`~optax_zero_one.scheduled_mean`,
    :func:`~optax_zero_one.scale_by_frozen_variance_adam` and
    :func:`~optax_zero_one.local_step_sync` (whose local steps start after ``start_step``,
    default the variance freeze step) wherever they are in ``state``.

    Args:
      state: an optimizer state (any nesting, arrays or ``jax.ShapeDtypeStruct``).
      step: the 1-based update to pin to.
      variance_policy: the optimizer's variance policy.
      local_step_policy: 0/1 Adam's local-step policy (``None`` for 1-bit Adam).
      start_step: the step after which local steps begin (default: the freeze step).
    """
    freeze = variance_policy.freeze_step
    start = freeze if start_step is None else start_step
    variance = _ints(policies.state_before(variance_policy, 1, min(step, freeze + 1)))
    local = None
    if local_step_policy is not None:
        local = _ints(policies.state_before(local_step_policy, start + 1, max(step, start + 1)))

    def pin(node: Any) -> Any:
        if isinstance(node, LocalStepSyncState):
            if local is None:
                return node
            return node._replace(count=step - 1, local_step_policy=local, anchored=step - 1 > start)
        return node._replace(count=step - 1, variance_policy=variance)

    return _map_counted(state, pin)


def _ints(tree: Any) -> Any:
    return jax.tree.map(int, tree)


def share_counters(state: Any, axis_name: str | None) -> Any:
    """Under ``jax.vmap`` (simulated workers), the counters that decide the step kind, taken
    once for all workers; elsewhere ``state`` unchanged.

    The counters are identical on every worker by construction. Under ``vmap`` each worker
    still holds its own copy, so every kind's zero-or-one-trip loop would be *batched*: JAX then
    runs it while any worker needs it and selects every carried buffer on every trip, which
    costs passes over the buffers that a real device never pays. A ``pmax`` over the simulated
    axis (no communication under ``vmap``) makes the kind one value, so the loops compile as
    they do on one device. Under ``shard_map`` and ``pmap`` nothing changes (and nothing is
    communicated): each device decides from its own counters.
    """
    if axis_name is None or _graph.worker_axes(axis_name):
        return state
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return state

    def one(tree: Any) -> Any:
        return jax.tree.map(
            lambda x: x if _graph.all_static(x) else jax.lax.pmax(x, axis_name), tree
        )

    def share(node: Any) -> Any:
        if isinstance(node, LocalStepSyncState):
            return node._replace(
                count=one(node.count),
                local_step_policy=one(node.local_step_policy),
                anchored=node.anchored
                if _graph.all_static(node.anchored)
                else one(node.anchored.astype(jnp.int32)).astype(bool),
            )
        return node._replace(count=one(node.count), variance_policy=one(node.variance_policy))

    return _map_counted(state, share)


_COUNTED = ScheduledMeanState | FrozenVarianceAdamState | LocalStepSyncState


def _map_counted(state: Any, fn: Any) -> Any:
    """``fn`` applied to every state in ``state`` whose counters decide the step kind
    (:class:`ScheduledMeanState`, :class:`FrozenVarianceAdamState`, :class:`LocalStepSyncState`),
    including those nested in a ``momentum_mean`` or an ``inner_state``."""

    def node_fn(node: Any) -> Any:
        if not isinstance(node, _COUNTED):
            return node
        if isinstance(node, FrozenVarianceAdamState):
            node = node._replace(momentum_mean=walk(node.momentum_mean))
        if isinstance(node, LocalStepSyncState):
            node = node._replace(inner_state=walk(node.inner_state))
        return fn(node)

    def walk(tree: Any) -> Any:
        return jax.tree.map(node_fn, tree, is_leaf=lambda x: isinstance(x, _COUNTED))

    return walk(state)
