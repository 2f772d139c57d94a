"""0/1 Adam as a short composition of the three transforms.

::

    flatten(                                    one flat buffer per worker
      local_step_sync(                          phase B: local steps, 1-bit syncs
        optax.chain(
          scheduled_mean(variance_policy),      phase A: float mean / 1-bit mean / nothing
          scale_by_frozen_variance_adam(...),   Adam moments, v frozen after the freeze step
          optax.add_decayed_weights(wd),
          optax.scale_by_learning_rate(lr)),
        local_step_policy, start_step=F, rule=FrozenAdamSync(...)))

Step kinds (``docs/algorithm.md``): variance (float all-reduce), compressed (1-bit mean of the
gradients), local (nothing), sync (1-bit mean of the interval's weighted updates).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from optax_zero_one.core import _checks, _graph, local_steps, policies
from optax_zero_one.core import collective as collective_lib  # `collective` names the backend
from optax_zero_one.core.comm import Comm
from optax_zero_one.core.frozen_variance import (
    FrozenVarianceAdamState,
    adam_direction,
    scale_by_frozen_variance_adam,
)
from optax_zero_one.core.scheduled_mean import ScheduledMeanState, scheduled_mean_over
from optax_zero_one.core.wrappers import decayed_weights, flatten_over


@dataclasses.dataclass(frozen=True)
class FrozenAdamSync(local_steps.ParamsAverage):
    r"""0/1 Adam's sync rule, for an inner chain holding one
    :class:`~optax_zero_one.FrozenVarianceAdamState` (and a
    :class:`~optax_zero_one.ScheduledMeanState`)::

        payload w = u (sqrt(v) + eps)       (linear in the interval's momenta: v is frozen)
        after it: m <- what / sum(lr)       (the learning-rate-weighted mean momentum)

    It lends the wrapper the error buffers of the inner :func:`~optax_zero_one.scheduled_mean`,
    which are idle (and zero) after the variance freeze, so 0/1 Adam keeps one set of error
    buffers; the wrapper's ``start_step`` must not come before the freeze (checked).

    Args:
      learning_rate: the inner chain's learning rate (float or schedule of the count).
      eps: Adam's ``eps`` (as in the inner transform).
      variance_policy: the inner transform's variance policy (for its freeze step).
    """

    learning_rate: optax.ScalarOrSchedule  # no default: 0 would zero m at every sync
    eps: float = 1e-8
    variance_policy: Any = None
    inner_frozen_after_start: ClassVar[bool] = True  # start_step >= freeze (checked in errors)

    def __post_init__(self) -> None:
        _checks.check_learning_rate(self.learning_rate)
        _checks.check_range("eps", self.eps, 0.0, float("inf"), high_open=True)
        eps = _checks.concrete_number(self.eps)  # a tracer (injected, in update) is not checked
        if _checks.is_static_number(eps) and eps == 0:
            raise ValueError("FrozenAdamSync's eps must be > 0 (the weight is sqrt(v) + eps).")

    def learning_rate_at(self, count: jax.Array) -> Any:
        return _checks.evaluate(self.learning_rate, count)

    def weight(self, inner_state: Any) -> Any:
        nu = _graph.only_node(inner_state, FrozenVarianceAdamState, "FrozenAdamSync").nu
        return jax.tree.map(lambda v: jnp.sqrt(v) + self.eps, nu)

    def unweighted(self, inner_state: Any, mean: Any) -> Any:
        """``what / (sqrt(v) + eps)``, 0 where ``v`` is 0 (as the local steps' direction,
        :func:`~optax_zero_one.core.frozen_variance.adam_direction`: such a coordinate's payload
        is 0, but its 1-bit mean is the leaf's scale times a sign)."""
        nu = _graph.only_node(inner_state, FrozenVarianceAdamState, "FrozenAdamSync").nu
        # sqrt(v) again after the collective, not kept across it from the payload's weight: XLA
        # shares one sqrt(v) between the two and holds it, a buffer the size of the params, for
        # the whole collective (dp.jit's sync step on CPU: 4 bytes per parameter less at its
        # peak and ~13% faster, docs/jit.md "Memory"); the same values, computed twice
        mean, nu = jax.lax.optimization_barrier((mean, nu))
        return jax.tree.map(lambda w, v: adam_direction(w, v, self.eps), mean, nu)

    def after_sync(self, inner_state: Any, mean: Any, lr_sum: jax.Array, ok: jax.Array) -> Any:
        old = _graph.only_node(inner_state, FrozenVarianceAdamState, "FrozenAdamSync").mu
        momentum = _graph.keep_if(ok, local_steps.divide_by_sum(mean, lr_sum), old)
        return local_steps.replace_nodes(
            inner_state, FrozenVarianceAdamState, lambda s: s._replace(mu=momentum)
        )

    def errors(self, inner_state: Any, start_step: int) -> Any:
        found = _graph.only_node(inner_state, ScheduledMeanState, "FrozenAdamSync")
        freeze = getattr(self.variance_policy, "freeze_step", None)
        static = _checks.is_static_number(start_step) and _checks.is_static_number(freeze)
        if static and start_step > freeze:
            # the scheduled mean stops averaging at the freeze: until start_step nothing would
            # average, and each worker would train (and anchor) on its own gradients
            raise ValueError(
                f"local_step_sync's start_step ({start_step}) is after the variance freeze "
                f"(step {freeze}): the scheduled mean stops averaging at the freeze, so between "
                f"the two each worker would train on its own gradients and the workers would "
                f"part. Pass start_step={freeze} (0/1 Adam's phase B starts at the freeze)."
            )
        if not isinstance(found.errors, collective_lib.OnebitMeanState):
            return None
        if freeze is None:
            raise ValueError(
                "FrozenAdamSync needs the inner transform's variance_policy (for its freeze "
                "step): FrozenAdamSync(learning_rate, eps, variance_policy)."
            )
        if static and start_step < freeze:
            raise ValueError(
                f"FrozenAdamSync borrows the scheduled mean's error buffers, which are idle only "
                f"after the variance freeze (step {freeze}); local_step_sync's start_step "
                f"({start_step}) must be at least that."
            )
        return found.errors

    def with_errors(self, inner_state: Any, errors: Any) -> Any:
        return local_steps.replace_nodes(
            inner_state, ScheduledMeanState, lambda s: s._replace(errors=errors)
        )


def scale_by_zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    variance_policy: policies.VariancePolicy | None = None,
    local_step_policy: policies.LocalStepPolicy | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    mask: Any = None,
    collective: str = "two_phase",
    fast_axis_name: str | None = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""0/1 Adam with pluggable policies: the update, learning rate and weight decay included.

    ::

        phase A (k <= F):  variance step:   gbar = mean_i g_i;  m, v <- Adam moments of gbar
                           compressed step: m <- b1 m + (1-b1) mask * C(g_i);  v unchanged
                           x <- x - lr_k (m / (sqrt(v) + eps) + wd x)
        phase B (k > F):   m <- b1 m + (1-b1) g_i;  x <- x - lr_k (m / (sqrt(v) + eps) + wd x)
                   sync:   u = xbar - x;  what = mask * C(u (sqrt(v) + eps));  m <- what / sum(lr)
                           xbar <- xbar - what / (sqrt(v) + eps);  x <- xbar

    ``xbar`` is the last synchronised point (kept by :func:`~optax_zero_one.local_step_sync`),
    so ``u`` is the sum of the interval's local updates. After a sync every worker's params are
    ``x + (xbar - x)`` as ``optax.apply_updates`` rounds it: ``xbar`` up to the last bit,
    which may differ between workers (their ``x`` do); ``xbar`` itself, the same bits on every
    worker, is what :func:`~optax_zero_one.synchronized_params` returns. No bias correction.
    Pass each worker's *local* gradient: the optimizer does the averaging. Non-finite gradients
    are skipped together at the steps that communicate and dropped per worker at local steps
    (``docs/algorithm.md``).

    The learning rate is part of the composition (not chained after it) because the sync
    replaces the interval's learning-rate-scaled updates and needs their sum.

    Args (all but ``learning_rate`` by keyword):
      learning_rate: a float or an ``optax.Schedule`` of the update count.
      variance_policy: decides variance steps and the freeze (default
        :class:`~optax_zero_one.VarianceDoubling` ``(100_000, 16)``).
      local_step_policy: decides sync steps in phase B (default
        :class:`~optax_zero_one.LocalStepDoubling` ``(32_678, 16)``).
      b1, b2, eps: Adam's constants.
      weight_decay: decoupled weight decay, scaled by the learning rate.
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed means (a
        compression mask, not ``optax.adamw``'s: that is ``weight_decay_mask``).
      collective: the backend of ``C``: ``"two_phase"`` (DeepSpeed's scheme) or ``"psum"``
        (one integer all-reduce, up to 255 workers); see :func:`~optax_zero_one.onebit_mean`.
      fast_axis_name: a second worker axis, inside a node (fast links). Then ``axis_name`` is
        the axis across nodes: every mean is exact over ``fast_axis_name`` and compressed only
        over ``axis_name``, on a 1/L share per worker (``docs/hierarchical.md``).
        ``num_workers`` is then a pair ``(nodes, workers per node)``. Two-phase backend only.
      weight_decay_mask: optional pytree of 0/1 like the params (per leaf or per element):
        the parameters ``weight_decay`` applies to, as ``optax.adamw``'s ``mask`` (e.g. not
        biases and norms). A tree, not a function: pass ``mask_fn(params)``. (Under
        ``optax.inject_hyperparams`` a mask that is one array is injected as a value.)

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``.

    References:
      Lu et al., Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam,
      ICLR 2023, arXiv:2202.06009.
    """
    _checks.check_learning_rate(learning_rate)
    _checks.check_weight_decay(weight_decay)
    # the workers and the backend, checked once and shared by every block
    comm = Comm.of(axis_name, fast_axis_name, num_workers, collective, mask)
    variance_policy = variance_policy or policies.VarianceDoubling()
    local_step_policy = local_step_policy or policies.LocalStepDoubling()
    _checks.check_variance_policy(variance_policy)
    _checks.check_policy(
        "local_step_policy", local_step_policy, "is_sync_step", "ozo.LocalStepDoubling(16, 16)"
    )
    steps = [
        scheduled_mean_over(comm, variance_policy),
        scale_by_frozen_variance_adam(b1, b2, eps, variance_policy, axis_name=comm.axes),
    ]
    steps.append(decayed_weights(weight_decay, "zero_one_adam", weight_decay_mask))
    steps.append(optax.scale_by_learning_rate(learning_rate))
    synced = local_steps.local_step_sync_over(
        optax.chain(*steps),
        local_step_policy,
        comm,
        start_step=variance_policy.freeze_step,
        rule=FrozenAdamSync(learning_rate, eps, variance_policy),
    )
    return _checks.schedules_checked_at_init(
        flatten_over(synced, comm), learning_rate=learning_rate, weight_decay=weight_decay
    )


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int = 100_000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32_678,
    local_step_clipper: int = 16,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    mask: Any = None,
    collective: str = "two_phase",
    fast_axis_name: str | None = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """0/1 Adam (Lu et al., 2023) with DeepSpeed's default schedules.

    :func:`scale_by_zero_one_adam` with :class:`~optax_zero_one.VarianceDoubling`
    ``(var_freeze_step, var_update_scaler)`` and :class:`~optax_zero_one.LocalStepDoubling`
    ``(local_step_scaler, local_step_clipper)``. See there for the maths.

    Pass each worker's **local** gradient (no ``pmean`` of your own) and keep one copy of the
    params and state per worker: the device axis under ``pmap``, a leading worker axis sharded
    with ``P(axis_name)`` under ``shard_map``, a leading worker axis under ``vmap``.

    Args:
      learning_rate: a float or an ``optax.Schedule``.
      b1, b2, eps: Adam's constants (no bias correction).
      weight_decay: decoupled weight decay, scaled by the learning rate.
      var_freeze_step: ``F``; the variance is frozen after step ``F``.
      var_update_scaler: ``kappa``; variance steps per interval before the gap doubles.
      local_step_scaler: ``alpha``; phase-B steps per interval before the sync gap doubles.
      local_step_clipper: ``H``; the largest sync gap.
      axis_name, num_workers, mask, collective, fast_axis_name, weight_decay_mask: as in
        :func:`scale_by_zero_one_adam` (the worker axis; its size if ``init`` runs outside it;
        a 0/1 compression mask; the backend; the axis inside a node, for hierarchical
        compression; which parameters decay).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> tx = zero_one_adam(1e-3, var_freeze_step=1000, axis_name="batch")
      >>> def step(params, opt_state, local_grads):  # one worker, under pmap/shard_map/vmap
      ...     updates, opt_state = tx.update(local_grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> params = jnp.zeros((4, 10))  # 4 workers' copies
      >>> opt_state = jax.vmap(tx.init, axis_name="batch")(params)
      >>> grads = jnp.ones((4, 10))  # each worker's own
      >>> params, opt_state = jax.vmap(step, axis_name="batch")(params, opt_state, grads)

    References:
      Lu et al., Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam,
      ICLR 2023, arXiv:2202.06009.
    """
    _checks.check_variance_measured(var_freeze_step, "var_freeze_step")
    return scale_by_zero_one_adam(
        learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        variance_policy=policies.VarianceDoubling(var_freeze_step, var_update_scaler),
        local_step_policy=policies.LocalStepDoubling(local_step_scaler, local_step_clipper),
        axis_name=axis_name,
        num_workers=num_workers,
        mask=mask,
        collective=collective,
        fast_axis_name=fast_axis_name,
        weight_decay_mask=weight_decay_mask,
    )
