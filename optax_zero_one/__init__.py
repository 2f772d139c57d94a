"""optax_zero_one: 0/1 Adam and 1-bit Adam as composable Optax transforms for JAX.

Communication-efficient data-parallel Adam (Lu et al., ICLR 2023, arXiv:2202.06009; Tang et al.,
ICML 2021, arXiv:2102.02888). Each worker passes its *local* gradient; the transforms do the
averaging over a named axis (``axis_name``) bound by ``jax.shard_map``, ``jax.pmap`` or
``jax.vmap``, with a fused 1-bit compressed collective for most steps.

The three transforms, each usable on its own (``docs/design.md``):

- :func:`scale_by_frozen_variance_adam`: Adam's moments with ``v`` updated only on a variance
  policy's steps and frozen after its freeze step;
- :func:`onebit_mean`: the 1-bit compressed mean with error feedback (one all-to-all and one
  all-gather per call for the whole tree), and :func:`scheduled_mean`, which picks a float mean,
  a 1-bit mean or no communication per step from a variance policy;
- :func:`local_step_sync`: local steps of any inner transform, replaced by their 1-bit average on
  a local-step policy's sync steps (rules :class:`ParamsAverage`, :class:`MomentumAverage`,
  :class:`FrozenAdamSync`).

:func:`zero_one_adam` and :func:`onebit_adam` are short compositions of them inside
:func:`flatten`, which runs a transform on one flat buffer per worker so that the compiled
program does not grow with the number of leaves. Also: the policies (:class:`VarianceDoubling`,
:class:`LocalStepDoubling`, :class:`FullPrecisionWarmup`), the step kinds of a run
(:class:`StepSchedule`, :class:`StepKind`; pass ``step_kind=`` to ``update`` to compile one kind
alone, or let :func:`dispatch_by_kind` pick each step's program on the host),
:func:`comm_stats` (what a compiled program sends), the worker layout (:func:`replicate`,
:func:`unreplicate`, :func:`synchronized_params`), the worker layout across processes
(:func:`initialize_from_env`, :func:`worker_mesh`, :func:`to_workers`, :func:`local_rows`,
:func:`on_workers`; a local launcher: ``python -m optax_zero_one.launch``) and checkpoints
across worker counts (:func:`check_worker_count`, :func:`reset_compression`).
"""

from optax_zero_one.checkpoint import check_worker_count, reset_compression, worker_count
from optax_zero_one.collective import OnebitMeanState, compressed_mean, float_mean, onebit_mean
from optax_zero_one.comm_stats import Collective, CommStats, comm_stats, parse_hlo
from optax_zero_one.data_parallel import DataParallel, data_parallel
from optax_zero_one.deepspeed import from_deepspeed_config
from optax_zero_one.dispatch import KindDispatcher, dispatch_by_kind
from optax_zero_one.distributed import (
    DistributedJob,
    initialize_from_env,
    local_rows,
    on_workers,
    to_workers,
    worker_mesh,
)
from optax_zero_one.flat import FlatTree, Layout
from optax_zero_one.frozen_variance import FrozenVarianceAdamState, scale_by_frozen_variance_adam
from optax_zero_one.kinds import (
    ONEBIT_STEP_KINDS,
    STEP_KINDS,
    StepKind,
    StepSchedule,
    onebit_schedule,
    onebit_step_kinds,
    step_count,
    step_kind,
    step_kinds,
    zero_one_schedule,
)
from optax_zero_one.local_steps import (
    LocalStepSyncState,
    MomentumAverage,
    ParamsAverage,
    local_step_sync,
)
from optax_zero_one.onebit_adam import onebit_adam, scale_by_onebit_adam
from optax_zero_one.policies import (
    FullPrecisionWarmup,
    IntervalState,
    LocalStepDoubling,
    LocalStepPolicy,
    VarianceDoubling,
    VariancePolicy,
    sync_steps,
    variance_steps,
)
from optax_zero_one.scheduled_mean import ScheduledMeanState, scheduled_mean
from optax_zero_one.workers import ShardLocalState, replicate, synchronized_params, unreplicate
from optax_zero_one.wrappers import FlattenState, SkipNotFiniteState, flatten, skip_not_finite
from optax_zero_one.zero_one_adam import FrozenAdamSync, scale_by_zero_one_adam, zero_one_adam

__version__ = "0.2.0"

__all__ = [
    "DataParallel",
    "ShardLocalState",
    "data_parallel",
    "Collective",
    "CommStats",
    "DistributedJob",
    "FlatTree",
    "FlattenState",
    "FrozenAdamSync",
    "FrozenVarianceAdamState",
    "FullPrecisionWarmup",
    "IntervalState",
    "KindDispatcher",
    "Layout",
    "LocalStepDoubling",
    "LocalStepPolicy",
    "LocalStepSyncState",
    "MomentumAverage",
    "ONEBIT_STEP_KINDS",
    "OnebitMeanState",
    "ParamsAverage",
    "STEP_KINDS",
    "ScheduledMeanState",
    "StepKind",
    "StepSchedule",
    "SkipNotFiniteState",
    "VarianceDoubling",
    "VariancePolicy",
    "check_worker_count",
    "comm_stats",
    "compressed_mean",
    "dispatch_by_kind",
    "flatten",
    "float_mean",
    "from_deepspeed_config",
    "initialize_from_env",
    "local_rows",
    "local_step_sync",
    "on_workers",
    "onebit_adam",
    "onebit_mean",
    "onebit_schedule",
    "onebit_step_kinds",
    "parse_hlo",
    "replicate",
    "reset_compression",
    "scale_by_frozen_variance_adam",
    "scale_by_onebit_adam",
    "scale_by_zero_one_adam",
    "scheduled_mean",
    "skip_not_finite",
    "step_count",
    "step_kind",
    "step_kinds",
    "sync_steps",
    "synchronized_params",
    "to_workers",
    "unreplicate",
    "variance_steps",
    "worker_count",
    "worker_mesh",
    "zero_one_adam",
    "zero_one_schedule",
]
