"""The 0/1 Adam step kind of a state, computed in the graph from its counters (tests only).

The library decides kinds on the host (``ozo.StepSchedule``); some tests want the kind that a
state's own counters imply inside a traced loop, as an independent check of the schedule.
"""

import jax
import jax.numpy as jnp

import optax_zero_one as ozo


def find(state, cls):
    """The one node of ``state`` that is a ``cls``."""
    nodes = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, cls))
    (node,) = [s for s in nodes if isinstance(s, cls)]
    return node


def kind_index(state, variance_policy, local_step_policy):
    """An index into ``ozo.STEP_KINDS``: the kind of the next update of a 0/1 Adam state."""
    scheduled = find(state, ozo.ScheduledMeanState)
    local = find(state, ozo.LocalStepSyncState)
    k = scheduled.count + 1
    phase_a = k <= variance_policy.freeze_step
    variance = variance_policy.is_update_step(scheduled.variance_policy, k)
    sync = local_step_policy.is_sync_step(local.local_step_policy, k)
    return jnp.where(phase_a, jnp.where(variance, 0, 1), jnp.where(sync, 3, 2)).astype(jnp.int32)
