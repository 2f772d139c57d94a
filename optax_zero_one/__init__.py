"""optax_zero_one: 0/1 Adam and 1-bit Adam as composable Optax transforms for JAX.

Communication-efficient data-parallel Adam (Lu et al., ICLR 2023, arXiv:2202.06009; Tang et al.,
ICML 2021, arXiv:2102.02888). Each worker passes its *local* gradient; the transforms do the
averaging over a named axis (``axis_name``) bound by ``jax.shard_map``, ``jax.pmap`` or
``jax.vmap``, with a fused 1-bit compressed collective for most steps.

The package has two parts (``docs/design.md``):

- :mod:`optax_zero_one.core`, the optimizer: pure Optax transforms, nothing of processes, meshes
  or files. The three transforms, each usable on its own:

  - :func:`scale_by_frozen_variance_adam`: Adam's moments with ``v`` updated only on a variance
    policy's steps and frozen after its freeze step;
  - :func:`onebit_mean`: the 1-bit compressed mean with error feedback, and
    :func:`scheduled_mean`, which picks a float mean, a 1-bit mean or no communication per step;
  - :func:`local_step_sync`: local steps of any inner transform, replaced by their 1-bit average
    on a local-step policy's sync steps (rules :class:`ParamsAverage`, :class:`MomentumAverage`,
    :class:`FrozenAdamSync`);

  :func:`zero_one_adam` and :func:`onebit_adam`, short compositions of them inside
  :func:`flatten`; the policies (:class:`VarianceDoubling`, :class:`LocalStepDoubling`,
  :class:`FullPrecisionWarmup`) and the step kinds of a run (:class:`StepSchedule`,
  :class:`StepKind`: pass ``step_kind=`` to ``update`` to compile one kind alone);
  :func:`diloco`, local steps of any inner optimizer with an outer optimizer on the averaged
  delta (:class:`SyncEvery`, :func:`diloco_schedule`, :func:`local_step_schedule`).
- :mod:`optax_zero_one.integration`, what runs it: :func:`dispatch_by_kind` and
  :func:`data_parallel` (one program per step kind, chosen on the host), the worker layout
  (:func:`replicate`, :func:`unreplicate`, :func:`synchronized_params`, :func:`worker_mesh`,
  :func:`to_workers`, :func:`local_rows`, :func:`on_workers`), multi-process jobs
  (:func:`initialize_from_env`; a local launcher, ``python -m optax_zero_one.integration.launch``),
  checkpoints across worker counts (:func:`check_worker_count`, :func:`reset_compression`),
  :func:`comm_stats` (what a compiled program sends) and :func:`from_deepspeed_config`.

The names here are what a training loop needs; the rest (flat layouts, the collectives'
building blocks, HLO parsing, per-policy step lists) is in the submodules, documented there.
"""

from optax_zero_one.core.collective import OnebitMeanState, float_mean, onebit_mean
from optax_zero_one.core.diloco import diloco, diloco_schedule
from optax_zero_one.core.frozen_variance import (
    FrozenVarianceAdamState,
    scale_by_frozen_variance_adam,
)
from optax_zero_one.core.kinds import (
    STEP_KINDS,
    StepKind,
    StepSchedule,
    check_hints,
    check_schedule,
    local_step_schedule,
    onebit_schedule,
    step_count,
    step_kind,
    step_kinds,
    zero_one_schedule,
)
from optax_zero_one.core.local_steps import (
    LocalStepSyncState,
    MomentumAverage,
    ParamsAverage,
    local_step_sync,
)
from optax_zero_one.core.onebit_adam import onebit_adam, scale_by_onebit_adam
from optax_zero_one.core.policies import (
    FullPrecisionWarmup,
    LocalStepDoubling,
    LocalStepPolicy,
    SyncEvery,
    VarianceDoubling,
    VariancePolicy,
)
from optax_zero_one.core.scheduled_mean import ScheduledMeanState, scheduled_mean
from optax_zero_one.core.wrappers import flatten, skip_not_finite
from optax_zero_one.core.zero_one_adam import FrozenAdamSync, scale_by_zero_one_adam, zero_one_adam
from optax_zero_one.integration.checkpoint import (
    check_restored,
    check_worker_count,
    reset_compression,
    worker_count,
)
from optax_zero_one.integration.comm_stats import CommStats, comm_stats
from optax_zero_one.integration.data_parallel import DataParallel, data_parallel
from optax_zero_one.integration.deepspeed import from_deepspeed_config
from optax_zero_one.integration.dispatch import KindDispatcher, KindMemory, dispatch_by_kind
from optax_zero_one.integration.distributed import (
    DistributedJob,
    initialize_from_env,
    local_rows,
    on_workers,
    to_workers,
    worker_mesh,
)
from optax_zero_one.integration.workers import replicate, synchronized_params, unreplicate

__version__ = "0.2.0"

__all__ = [
    "check_worker_count",
    "worker_count",
    "comm_stats",
    "CommStats",
    "data_parallel",
    "DataParallel",
    "diloco",
    "diloco_schedule",
    "dispatch_by_kind",
    "DistributedJob",
    "flatten",
    "float_mean",
    "from_deepspeed_config",
    "FrozenAdamSync",
    "FrozenVarianceAdamState",
    "FullPrecisionWarmup",
    "initialize_from_env",
    "KindDispatcher",
    "KindMemory",
    "local_rows",
    "local_step_schedule",
    "local_step_sync",
    "LocalStepDoubling",
    "LocalStepPolicy",
    "LocalStepSyncState",
    "MomentumAverage",
    "on_workers",
    "onebit_adam",
    "onebit_mean",
    "onebit_schedule",
    "OnebitMeanState",
    "ParamsAverage",
    "replicate",
    "reset_compression",
    "scale_by_frozen_variance_adam",
    "scale_by_onebit_adam",
    "scale_by_zero_one_adam",
    "scheduled_mean",
    "ScheduledMeanState",
    "skip_not_finite",
    "check_hints",
    "check_restored",
    "check_schedule",
    "step_count",
    "step_kind",
    "STEP_KINDS",
    "step_kinds",
    "StepKind",
    "StepSchedule",
    "synchronized_params",
    "SyncEvery",
    "to_workers",
    "unreplicate",
    "VarianceDoubling",
    "VariancePolicy",
    "worker_mesh",
    "zero_one_adam",
    "zero_one_schedule",
]
