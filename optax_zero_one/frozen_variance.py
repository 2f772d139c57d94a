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
import optax

from optax_zero_one import _checks, _graph, policies


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
    """

    count: jax.Array
    variance_policy: Any
    mu: optax.Updates
    nu: optax.Updates
    momentum_mean: optax.OptState
    dropped_grads: jax.Array


def scale_by_frozen_variance_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    variance_policy: policies.VariancePolicy | None = None,
    momentum_mean: optax.GradientTransformation | None = None,
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

    Args:
      b1, b2, eps: Adam's constants.
      variance_policy: when to update ``v`` and when to freeze it (default
        :class:`~optax_zero_one.VarianceDoubling` ``(100_000, 16)``).
      momentum_mean: optional transform applied to ``m`` at every step after the freeze.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`FrozenVarianceAdamState`.

    Example:
      >>> tx = optax.chain(scale_by_frozen_variance_adam(variance_policy=VarianceDoubling(100)),
      ...                  optax.scale_by_learning_rate(1e-3))

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1); Tang et al., 1-bit Adam,
      arXiv:2102.02888 (variance freezing).
    """
    _checks.check_range("b1", b1, 0.0, 1.0, high_open=True)
    _checks.check_range("b2", b2, 0.0, 1.0, high_open=True)
    _checks.check_range("eps", eps, 0.0, float("inf"), high_open=True)
    policy = variance_policy or policies.VarianceDoubling()

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
        )

    def update_fn(
        updates: Any, state: FrozenVarianceAdamState, params: Any, **extra_args: Any
    ) -> Any:
        _checks.check_tree_matches(updates, state.mu, "updates", "the optimizer state")
        k = state.count + 1
        frozen = k > policy.freeze_step
        variance_step = _graph.both(
            _graph.negate(frozen), policy.is_update_step(state.variance_policy, k)
        )
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)

        # Before the freeze the input is a mean over the workers: if it is not finite, every
        # worker keeps its state (the check comes first, so the writes below can keep it).
        # After it, with a momentum_mean, the input is this worker's own: dropped if not finite.
        checked = _graph.negate(frozen) if momentum_mean is None else True
        grads, ok = _graph.check_finite_if(checked, grads, jnp.ones([], bool))
        drop = _graph.both(frozen, jnp.logical_not(ok)) if momentum_mean is not None else False
        ok = jnp.logical_or(ok, frozen) if momentum_mean is not None else ok
        if momentum_mean is not None:
            grads = _graph.zero_if(drop, grads, like=grads)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        mu = jax.tree.map(lambda m, g: keep(b1 * m + (1 - b1) * g, m), state.mu, grads)

        def update_variance(carry: Any) -> Any:
            g, v = carry
            return g, jax.tree.map(lambda v, g: keep(b2 * v + (1 - b2) * jnp.square(g), v), v, g)

        grads, nu = _graph.run_if(variance_step, update_variance, (grads, state.nu), like=grads)
        averaged = state.momentum_mean
        if momentum_mean is not None:

            def average(carry: Any) -> Any:
                m, inner, _ = carry
                mean, inner = momentum_mean.update(m, inner, params, **extra_args)
                good = _graph.all_finite(mean)  # an overflow: skipped together
                return jax.tree.map(lambda x, o: jnp.where(good, x, o), mean, m), inner, good

            mu, averaged, good = _graph.run_if(
                frozen, average, (mu, averaged, jnp.ones([], bool)), like=grads
            )
            ok = jnp.logical_and(ok, good)
        direction = jax.tree.map(
            lambda m, v: jnp.where(ok, m / (jnp.sqrt(v) + eps), jnp.nan), mu, nu
        )
        advanced = FrozenVarianceAdamState(
            count=optax.safe_increment(state.count),
            variance_policy=policies.advance(
                policy, state.variance_policy, k, _graph.negate(frozen)
            ),
            mu=mu,
            nu=nu,
            momentum_mean=averaged,
            dropped_grads=state.dropped_grads + jnp.asarray(drop, jnp.int32),
        )
        return direction, _graph.restore_scalars(ok, advanced, state)

    return _checks.transformation(
        init_fn, update_fn, FrozenVarianceAdamState, "scale_by_frozen_variance_adam"
    )
