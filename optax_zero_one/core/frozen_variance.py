"""Adam's moments with a second moment that is updated only on a policy's steps, then frozen.

The first of 0/1 Adam's three ideas (``docs/algorithm.md``, "Phase A"): once the variance stops
moving, an Adam step is linear in the gradient, which is what makes 1-bit compression with
error feedback and local steps sound. Alone, on one device, it is Adam without bias correction
whose ``v`` is updated only on the variance policy's steps and stops at its freeze step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _checks, _graph, kinds, policies
from optax_zero_one.core.kinds import StepKind


def adam_direction(m: Any, v: Any, eps: Any) -> Any:
    """``m / (sqrt(v) + eps)``, and 0 where ``v`` is 0.

    A coordinate whose variance is exactly 0 has had no gradient at any variance step (a dead
    ReLU unit, an embedding row no batch has used). Its momentum can still be non-zero: a 1-bit
    mean gives every coordinate of a leaf the leaf's scale times a sign, zeros included, and
    after the freeze a local gradient may reach it. Over ``eps`` alone that moved it ~1e7 times
    the leaf's scale in one step (a trial: a ReLU network's loss from 1.4 to 3.7e4 at 0/1 Adam's
    first compressed step). With no variance there is no scale to move by: it stays, as a
    masked coordinate does (DeepSpeed's ``exp_avg_mask``, which its users set by hand for such
    rows). Where ``v > 0`` the bits are Adam's (``docs/algorithm.md``)."""
    return jnp.where(v > 0, m / (jnp.sqrt(v) + eps), jnp.zeros([], m.dtype))


class FrozenVarianceAdamState(NamedTuple):
    """State of :func:`scale_by_frozen_variance_adam`.

    Attributes:
      count: int32, the number of updates done (``k - 1`` during update ``k``).
      variance_policy: the variance policy's counters (int32).
      mu: the first moment ``m``, like the updates (float32 or wider).
      nu: the second moment ``v``, like the updates; frozen after the freeze step.
      momentum_mean: the state of ``momentum_mean`` (``optax.EmptyState`` without one).
      dropped_grads: int32, steps after the freeze at which this worker's gradient was not
        finite and was replaced by zero (only with a ``momentum_mean``).
      refused_hint: int32 ``(2,)``: refused hints and the branch asked for at the last one
        (as in :class:`~optax_zero_one.ScheduledMeanState`).
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step
    INNER_FIELDS = ("momentum_mean",)  # other transforms' states

    count: jax.Array
    variance_policy: Any
    mu: optax.Updates
    nu: optax.Updates
    momentum_mean: optax.OptState
    dropped_grads: jax.Array
    refused_hint: jax.Array

    STEP_COUNTER = "count"
    REFUSED_HINT = "refused_hint"
    BRANCHES = ("update v (variance step)", "keep v (phase A)", "frozen v (phase B)")
    walked = staticmethod(policies.variance_walked)  # compared after a restore
    # A skipped step (a mean that is not finite, a refused hint) keeps ``count``, and every
    # other step's output is finite (eps > 0): wrappers read the skip from the counter.
    SKIP_KEEPS_COUNTER = True

    def moved(self, every: Any, fresh: FrozenVarianceAdamState, move: Any) -> Any:
        """To another worker count (:func:`~optax_zero_one.reset_compression`): ``m`` the mean
        of the old workers' (they differ during local steps), the rest as worker 0 has it."""
        return fresh._replace(
            count=self.count,
            variance_policy=self.variance_policy,
            mu=move.worker_mean(every.mu, fresh.mu),
            nu=move(self.nu, every.nu, fresh.nu),
            momentum_mean=move(self.momentum_mean, every.momentum_mean, fresh.momentum_mean),
            dropped_grads=self.dropped_grads,
            refused_hint=self.refused_hint,
        )


# What this transform does at a step: update v, keep v (phase A), or run frozen (phase B).
UPDATE_V, KEEP_V, FROZEN = range(3)


def scale_by_frozen_variance_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    variance_policy: policies.VariancePolicy | None = None,
    momentum_mean: optax.GradientTransformation | None = None,
    axis_name: str | tuple[str, str] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by Adam's moments, the second moment updated only where a policy says.

    For update ``k`` with incoming ``g`` and the policy's freeze step ``F``::

        m <- b1 m + (1 - b1) g
        v <- b2 v + (1 - b2) g^2       only if k <= F and the policy calls k a variance step
        m <- momentum_mean(m)          only if k > F and a momentum_mean is given
        output: m / (sqrt(v) + eps)

    No bias correction (the frozen-variance phase relies on its absence; DeepSpeed applies none
    either). With :class:`~optax_zero_one.VarianceDoubling` the variance steps fall at doubling
    gaps; with :class:`~optax_zero_one.FullPrecisionWarmup` at every step up to ``F``. What
    ``g`` is (a float mean, a compressed mean or a local gradient) is decided before this
    transform, e.g. by :func:`~optax_zero_one.scheduled_mean`. ``momentum_mean`` averages the
    momentum across workers after the freeze: with :func:`~optax_zero_one.onebit_mean` this is
    1-bit Adam's compressed stage.

    Step kinds: with ``step_kind=`` (a static :class:`~optax_zero_one.StepKind`) ``update``
    traces that kind alone (``phase_a``, ``variance``) and checks it against the counters; a
    step whose hint is wrong gives a NaN update (so that a guard such as
    :func:`~optax_zero_one.skip_not_finite` skips it) and keeps the state. Without it the
    kind is chosen in the graph.

    Args:
      b1, b2, eps: Adam's constants (``eps > 0``).
      variance_policy: when to update ``v`` and when to freeze it (default
        :class:`~optax_zero_one.VarianceDoubling` ``(100_000, 16)``).
      momentum_mean: optional transform applied to ``m`` at every step after the freeze.
      axis_name: the worker axis (or ``(slow, fast)`` pair) when workers are simulated with
        ``jax.vmap``, so that a step decided in the graph is decided once for all of them (this
        transform communicates nothing itself). Optional elsewhere.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`FrozenVarianceAdamState`.

    Example:
      >>> policy = ozo.VarianceDoubling(100)
      >>> tx = optax.chain(ozo.scale_by_frozen_variance_adam(variance_policy=policy),
      ...                  optax.scale_by_learning_rate(1e-3))

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1); Tang et al., 1-bit Adam,
      arXiv:2102.02888 (variance freezing).
    """
    _checks.check_range("b1", b1, 0.0, 1.0, high_open=True)
    _checks.check_range("b2", b2, 0.0, 1.0, high_open=True)
    _checks.check_range("eps", eps, 0.0, float("inf"), high_open=True)
    # below float32's smallest normal number eps is 0 to the update's arithmetic (flushed on
    # XLA:CPU): a coordinate that never had a gradient then computes 0 / 0
    eps_now = _checks.concrete_number(eps)  # injected: checked like a number
    if _checks.is_static_number(eps_now) and eps_now < np.finfo(np.float32).tiny:
        raise _checks.ArgumentError(
            "eps",
            f"eps must be >= {np.finfo(np.float32).tiny:.3g} (float32's smallest normal "
            f"number), got {eps_now}: a coordinate whose frozen variance is 0 would divide by zero "
            "at every step after the freeze (a smaller eps is 0 in float32). Use e.g. "
            "eps=1e-8 (Adam's and DeepSpeed's default).",
        )
    policy = variance_policy or policies.VarianceDoubling()
    _checks.check_variance_policy(policy)
    _checks.check_variance_measured(policy.freeze_step)
    _checks.worker_axes(*(axis_name if isinstance(axis_name, tuple) else (axis_name, None)))
    momentum_mean = _checks.check_transformation("momentum_mean", momentum_mean)

    def init_fn(params: optax.Params) -> FrozenVarianceAdamState:
        zeros = lambda: jax.tree.map(  # noqa: E731 (separate buffers, so the state can be donated)
            lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)),
            params,
        )
        return FrozenVarianceAdamState(
            count=jnp.zeros([], jnp.int32),
            variance_policy=_checks.as_int32_state(policy.init()),
            mu=zeros(),
            nu=zeros(),
            momentum_mean=momentum_mean.init(zeros()) if momentum_mean else optax.EmptyState(),
            dropped_grads=jnp.zeros([], jnp.int32),
            refused_hint=_graph.no_refusals(),
        )

    def branch_of(kind: StepKind) -> int:
        if not kind.phase_a:
            return FROZEN
        return UPDATE_V if kind.variance else KEEP_V

    def expected(state: FrozenVarianceAdamState) -> jax.Array:
        k = optax.safe_increment(state.count)  # saturates, as the count does
        phase_a = k <= policy.freeze_step
        variance = jnp.logical_and(phase_a, policy.is_update_step(state.variance_policy, k))
        return _graph.index_of([variance, phase_a, True])

    def update_fn(
        updates: Any, state: FrozenVarianceAdamState, params: Any, **extra_args: Any
    ) -> Any:
        _checks.check_tree_matches(updates, state.mu, "updates", "the optimizer state")
        kind = kinds.check_step_kind(extra_args.get("step_kind"), "scale_by_frozen_variance_adam")
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)
        hint = None if kind is None else branch_of(kind)
        run = lambda b, ok, o, extra: step(b, ok, *o, params, extra)  # noqa: E731
        return _graph.by_kind(
            hint, expected(state), 3, run, (grads, state), extra_args, axis_name, _graph.nan_unless
        )

    def step(
        branch: int,
        admit: Any,
        grads: Any,
        state: FrozenVarianceAdamState,
        params: Any,
        extra_args: dict,
    ) -> tuple:
        k = optax.safe_increment(state.count)  # saturates, as the count does
        frozen = branch == FROZEN
        averaged, drop = state.momentum_mean, jnp.zeros([], bool)
        if not frozen:
            # Before the freeze the input is a mean over the workers: if it is not finite, every
            # worker keeps its state (the selects below keep it) and the output is NaN.
            ok = _graph.all_finite(grads)
        elif momentum_mean is not None:
            # After it, with a momentum_mean, the input is this worker's own: dropped if not
            # finite (replaced by zero), and the momentum is averaged.
            drop = jnp.logical_not(_graph.all_finite(grads))
            grads = _graph.zero_unless(jnp.logical_not(drop), grads)
            ok = jnp.ones([], bool)
        elif extra_args.get(kinds.INPUTS_FINITE):
            ok = jnp.ones([], bool)  # local gradients, zeroed where not finite by the caller
        else:
            # a mean passed on by another transform (scheduled_mean's, NaN where not finite):
            # refused like one before the freeze, so that a skip keeps the counter as promised
            ok = _graph.all_finite(grads)
        ok = jnp.logical_and(ok, admit)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        mu = jax.tree.map(lambda m, g: keep(b1 * m + (1 - b1) * g, m), state.mu, grads)
        nu = state.nu
        if branch == UPDATE_V:
            nu = jax.tree.map(lambda v, g: keep(b2 * v + (1 - b2) * jnp.square(g), v), nu, grads)
        if frozen and momentum_mean is not None:
            forwarded = {k: v for k, v in extra_args.items() if k != kinds.INPUTS_FINITE}
            mean, new_averaged = momentum_mean.update(mu, averaged, params, **forwarded)
            averaged = _graph.keep_if(admit, new_averaged, averaged)
            ok = jnp.logical_and(_graph.all_finite(mean), admit)  # an overflow: skipped together
            mu = jax.tree.map(lambda x, o: jnp.where(ok, x, o), mean, mu)
        direction = jax.tree.map(
            lambda m, v: jnp.where(ok, adam_direction(m, v, eps), jnp.nan), mu, nu
        )
        advanced = FrozenVarianceAdamState(
            count=optax.safe_increment(state.count),
            variance_policy=policies.advance(policy, state.variance_policy, k, not frozen),
            mu=mu,
            nu=nu,
            momentum_mean=averaged,
            dropped_grads=state.dropped_grads + drop.astype(jnp.int32),
            refused_hint=state.refused_hint,
        )
        return direction, _graph.restore_scalars(ok, advanced, state)

    return _checks.transformation(
        init_fn, update_fn, FrozenVarianceAdamState, "scale_by_frozen_variance_adam"
    )
