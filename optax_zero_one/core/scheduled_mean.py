"""The mean over workers in the precision a variance policy asks for, step by step.

The piece of 0/1 Adam's phase A that decides what the gradient is (``docs/algorithm.md``,
"Step kinds"): a full-precision mean on the variance steps (the variance must see the true
mean), a 1-bit compressed mean on the steps between them, and nothing after the freeze step,
where the workers take local steps and a sync schedule (:func:`~optax_zero_one.local_step_sync`)
does the communicating.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _checks, _graph, flat, kinds, policies
from optax_zero_one.core import collective as collective_lib  # `collective` names the backend
from optax_zero_one.core.comm import Comm
from optax_zero_one.core.kinds import StepKind


class ScheduledMeanState(NamedTuple):
    """State of :func:`scheduled_mean`.

    Attributes:
      count: int32, the number of updates done.
      variance_policy: the policy's counters (int32).
      errors: the compressed mean's error buffers (:class:`~optax_zero_one.OnebitMeanState`),
        or ``optax.EmptyState()`` without compressed steps. Idle after the freeze step
        (0/1 Adam's sync rule borrows them, from zero, for its syncs).
      refused_hint: int32 ``(2,)``: how many hinted steps were refused (their ``step_kind``
        did not match the counters), and 1 + the branch the counters asked for at the last
        one (see ``BRANCHES``). Not a scalar, so a skipped step does not roll it back.
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step

    count: jax.Array
    variance_policy: Any
    errors: Any
    refused_hint: jax.Array

    STEP_COUNTER = "count"
    REFUSED_HINT = "refused_hint"
    BRANCHES = ("a float mean (variance step)", "a 1-bit mean (compressed step)", "no mean")
    walked = staticmethod(policies.variance_walked)  # compared after a restore


# What this transform does at a step: a float mean, a compressed mean, or nothing.
FLOAT, COMPRESS, IDLE = range(3)


def scheduled_mean(
    axis_name: str | None,
    variance_policy: policies.VariancePolicy,
    *,
    compressed_steps: bool = True,
    num_workers: int | tuple[int, int] | None = None,
    collective: str = "two_phase",
    mask: Any = None,
    fast_axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Averages the workers' updates in full precision, in 1 bit, or not at all, by the step.

    For update ``k`` and the policy's freeze step ``F``::

        k <= F, a variance step:      g <- mean_i g_i               (one float all-reduce)
        k <= F, any other step:       g <- mask * C(g_i)             (1-bit compressed mean)
        k >  F:                       g <- g_i                       (no communication)

    ``C`` is :func:`~optax_zero_one.onebit_mean`'s compressed mean; its error buffers are idle
    after step ``F``. Every worker takes the same branch (the counters are identical).

    Step kinds: with ``step_kind=`` (a static :class:`~optax_zero_one.StepKind`) ``update``
    traces that kind's branch alone (``phase_a`` and ``variance`` say which) and checks it
    against the counters: a step whose hint is wrong is not applied (a NaN update, so that the
    guard around it skips the step, and the state kept; ``refused_hint`` counts it).
    Without it the branch is chosen in the graph. Its schedule (for a dispatcher or the hints):
    ``ozo.StepSchedule(variance_policy, ozo.SyncEvery(1))`` (after ``F`` its kinds pass through).

    Args:
      axis_name: the worker axis, or ``None`` for one worker (then every branch is the identity).
      variance_policy: which steps are variance steps, and the freeze step.
      compressed_steps: ``False`` for policies whose non-variance steps before the freeze should
        not communicate either (and to keep no error buffers).
      num_workers: needed only when ``init`` runs outside the mapped context.
      collective: the backend of ``C`` (``"two_phase"`` or ``"psum"``).
      mask: optional tree of 0/1 like the params, multiplying the compressed means.
      fast_axis_name: the axis inside a node; both means are then hierarchical, exact over it
        and 1-bit only over ``axis_name`` (:func:`~optax_zero_one.onebit_mean`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`ScheduledMeanState`.

    Example:
      >>> policy = ozo.VarianceDoubling(freeze_step=1000)
      >>> tx = ozo.skip_not_finite(optax.chain(ozo.scheduled_mean("w", policy),
      ...     ozo.scale_by_frozen_variance_adam(variance_policy=policy),
      ...     optax.scale_by_learning_rate(1e-3)))

      ``skip_not_finite`` makes a non-finite step a skip for both: without it the Adam block
      skips it and the mean counts it, and their step counts part for good (the variance then
      moved on each worker's own gradient at the freeze).

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1).
    """
    comm = Comm.of(axis_name, fast_axis_name, num_workers, collective, mask)
    if not (  # a bool, or the int 0 / 1
        isinstance(compressed_steps, bool | np.bool_)
        or (isinstance(compressed_steps, int) and compressed_steps in (0, 1))
    ):
        raise ValueError(f"compressed_steps must be True or False, got {compressed_steps!r}.")
    return scheduled_mean_over(comm, variance_policy, compressed_steps=compressed_steps)


def scheduled_mean_over(
    comm: Comm, variance_policy: policies.VariancePolicy, *, compressed_steps: bool = True
) -> optax.GradientTransformationExtraArgs:
    """:func:`scheduled_mean` for a checked :class:`~optax_zero_one.core.comm.Comm`."""
    _checks.check_variance_policy(variance_policy)
    axes = comm.axes
    freeze = variance_policy.freeze_step

    def init_fn(params: optax.Params) -> ScheduledMeanState:
        _checks.check_float_leaves(params, "params")
        comm.init_workers(params)
        comm.check_mask(params)
        errors = collective_lib.init_state(params, comm) if compressed_steps else optax.EmptyState()
        state = ScheduledMeanState(
            jnp.zeros([], jnp.int32),
            _checks.as_int32_state(variance_policy.init()),
            errors,
            _graph.no_refusals(),
        )
        return _graph.worker_state(state, axes)

    def branch_of(kind: StepKind) -> int:
        if not kind.phase_a:
            return IDLE
        if kind.variance:
            return FLOAT
        return COMPRESS if compressed_steps else IDLE

    def expected(state: ScheduledMeanState) -> jax.Array:
        k = optax.safe_increment(state.count)  # saturates, as the count does
        phase_a = k <= freeze
        variance = jnp.logical_and(
            phase_a, variance_policy.is_update_step(state.variance_policy, k)
        )
        idle = jnp.logical_not(phase_a) if compressed_steps else jnp.logical_not(variance)
        return _graph.index_of([variance, jnp.logical_not(idle), True])

    def update_fn(updates: Any, state: ScheduledMeanState, params: Any, **extra_args: Any) -> Any:
        del params
        comm.update_workers(updates)
        # int and bool gradients were averaged in their own dtype (a mean of 0 and 1 read 0)
        _checks.check_float_leaves(updates, "scheduled_mean's input")
        kind = kinds.check_step_kind(extra_args.get("step_kind"), "scheduled_mean")
        hint = None if kind is None else branch_of(kind)
        return _graph.by_kind(
            hint, expected(state), 3, step, (updates, state), extra_args, axes, _graph.nan_unless
        )

    def step(branch: int, ok: Any, operand: tuple, extra_args: dict) -> tuple:
        del extra_args  # nothing inside reads them
        updates, state = operand
        k = optax.safe_increment(state.count)  # saturates, as the count does
        errors = state.errors
        if branch == FLOAT:
            mean = collective_lib.float_mean(updates, axes)
            updates = jax.tree.map(lambda m, x: m.astype(x.dtype), mean, updates)
        elif branch == COMPRESS and compressed_steps:
            values, in_form = flat.as_flat(updates, _checks.axis_size(axes))
            mean, new_errors, _ = collective_lib.masked_compressed_mean(
                values, errors, axes, comm.collective, comm.mask
            )
            errors = _graph.keep_if(ok, new_errors, errors)
            updates = in_form(mean)
        phase_a = k <= freeze
        new_state = ScheduledMeanState(
            optax.safe_increment(state.count),
            policies.advance(variance_policy, state.variance_policy, k, phase_a),
            errors,
            state.refused_hint,
        )
        return updates, new_state

    return _checks.transformation(init_fn, update_fn, ScheduledMeanState, "scheduled_mean")
