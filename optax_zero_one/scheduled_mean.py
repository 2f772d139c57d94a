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
import optax

from optax_zero_one import _checks, _graph, flat, policies
from optax_zero_one import collective as collective_lib  # `collective` names the backend
from optax_zero_one.flat import FlatTree


class ScheduledMeanState(NamedTuple):
    """State of :func:`scheduled_mean`.

    Attributes:
      count: int32, the number of updates done.
      variance_policy: the policy's counters (int32).
      errors: the compressed mean's error buffers (:class:`~optax_zero_one.OnebitMeanState`),
        or ``optax.EmptyState()`` without compressed steps. Zeroed at the end of the freeze
        step; idle after it (:class:`~optax_zero_one.FrozenAdamSync` reuses them for syncs).
    """

    count: jax.Array
    variance_policy: Any
    errors: Any


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

    ``C`` is :func:`~optax_zero_one.onebit_mean`'s compressed mean; its error buffers are zeroed
    at the end of step ``F`` (they held gradient errors). Every worker takes the same branch (the
    counters are identical), and a kind that does not run costs nothing.

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
      >>> policy = VarianceDoubling(freeze_step=1000)
      >>> tx = optax.chain(scheduled_mean("w", policy), scale_by_frozen_variance_adam(
      ...     variance_policy=policy), optax.scale_by_learning_rate(1e-3))

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1).
    """
    axes = _checks.worker_axes(axis_name, fast_axis_name)
    collective_lib.check_collective(collective)
    collective_lib.check_hierarchy(fast_axis_name, collective)
    freeze = variance_policy.freeze_step

    def init_fn(params: optax.Params) -> ScheduledMeanState:
        _checks.check_float_leaves(params, "params")
        _checks.resolve_num_workers(axes, num_workers)
        _checks.check_mask(mask, params.shapes() if isinstance(params, FlatTree) else params)
        errors = (
            collective_lib.init_state(params, axes, num_workers, collective)
            if compressed_steps
            else optax.EmptyState()
        )
        state = ScheduledMeanState(
            jnp.zeros([], jnp.int32), _checks.as_int32_state(variance_policy.init()), errors
        )
        return _graph.worker_state(state, axes)

    def update_fn(updates: Any, state: ScheduledMeanState, params: Any, **extra_args: Any) -> Any:
        del params, extra_args
        _checks.axis_size(axes)
        k = state.count + 1
        phase_a = k <= freeze
        variance = _graph.both(phase_a, variance_policy.is_update_step(state.variance_policy, k))
        compressed = _graph.both(phase_a, _graph.negate(variance))

        def float_step(g: Any) -> Any:
            mean = collective_lib.float_mean(g, axes)
            return jax.tree.map(lambda m, x: m.astype(x.dtype), mean, g)

        updates = _graph.run_if(variance, float_step, updates, like=updates)
        errors = state.errors
        if compressed_steps:
            updates, errors = _compressed(updates, errors, compressed)
            errors = _graph.zero_if(_graph.both(phase_a, k == freeze), errors, like=updates)
        new_state = ScheduledMeanState(
            optax.safe_increment(state.count),
            policies.advance(variance_policy, state.variance_policy, k, phase_a),
            errors,
        )
        return updates, new_state

    def _compressed(updates: Any, errors: Any, active: Any) -> tuple[Any, Any]:
        values, in_form = flat.as_flat(updates, _checks.axis_size(axes))

        def step(carry: Any) -> Any:
            mean, e, _ = collective_lib.masked_compressed_mean(*carry, axes, collective, mask)
            return mean, e

        values, errors = _graph.run_if(active, step, (values, errors), like=values)
        return in_form(values), errors

    return _checks.transformation(init_fn, update_fn, ScheduledMeanState, "scheduled_mean")
