"""Skipping a step that every worker sees as non-finite, together.

For transforms that communicate on every step (1-bit Adam): a NaN or Inf in any worker's input
reaches every worker through the mean, so all of them see a non-finite update and skip it
together; the state stays exactly as it was, so the step is retried with the next gradient
(``docs/algorithm.md``, "Non-finite values"). ``optax.apply_if_finite`` is the single-device
precedent; this one never gives up (a worker that applied a non-finite update would diverge
from the others) and costs nothing on a finite step but the check.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_zero_one import _checks, _graph


class SkipNotFiniteState(NamedTuple):
    """State of :func:`skip_not_finite`.

    Attributes:
      skipped_updates: int32, the steps skipped because the update was not finite.
      inner_state: the wrapped transform's state (unchanged by a skipped step).
    """

    skipped_updates: jax.Array
    inner_state: optax.OptState


def skip_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` and keeps its result only if the update is finite.

    ::

        u, s' = inner(g, s)
        finite:      return u, s'
        otherwise:   return 0, s        (skipped_updates += 1)

    Every worker skips together if ``inner`` averages across workers before producing ``u``
    (a non-finite value then reaches every worker); wrap only such transforms. The wrapper
    restores every counter of the inner state; the buffers must be kept by the transforms that
    own them, as this library's do when their input is not finite (restoring a buffer afterwards
    would cost a pass over it on every step).

    Args:
      inner: the transformation to guard.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`SkipNotFiniteState`.

    Example:
      >>> tx = skip_not_finite(optax.chain(scheduled_mean("w", policy), optax.sgd(0.1)))
    """

    def init_fn(params: optax.Params) -> SkipNotFiniteState:
        return SkipNotFiniteState(jnp.zeros([], jnp.int32), inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: SkipNotFiniteState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipNotFiniteState]:
        _checks.check_state_type(state, SkipNotFiniteState, "skip_not_finite")
        step, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        finite = _graph.all_finite(step)
        kept = SkipNotFiniteState(state.skipped_updates, inner_state)
        skipped = SkipNotFiniteState(state.skipped_updates + 1, state.inner_state)
        new_state = _graph.restore_scalars(finite, kept, skipped)
        step = jax.tree.map(lambda d: jnp.where(finite, d, jnp.zeros_like(d)), step)
        return step, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
