"""optax_zero_one: 0/1 Adam and 1-bit Adam as composable Optax transforms for JAX.

Communication-efficient data-parallel Adam (Lu et al., ICLR 2023, arXiv:2202.06009; Tang et al.,
ICML 2021, arXiv:2102.02888). Each worker passes its *local* gradient; the optimizers do the
averaging over a named axis (``axis_name``) bound by ``jax.shard_map``, ``jax.pmap`` or
``jax.vmap``, with a fused 1-bit compressed collective for most steps.

Building blocks, and how they compose:

- :func:`onebit_mean`: the 1-bit compressed mean with error feedback (one all-to-all and one
  all-gather per call for the whole tree). ``optax.chain(onebit_mean("w"), optax.sgd(lr))`` is
  1-bit SGD with error feedback; ``optax.chain(onebit_mean("w"), optax.sgd(lr, momentum=0.9))``
  adds momentum on the averaged gradient.
- Policies (:class:`VarianceDoubling`, :class:`LocalStepDoubling`): when to update the variance
  and when to synchronise. Any object with the same ``init``/``is_*_step``/``next`` methods can
  replace them, e.g. a sync policy tied to the learning rate::

      class SyncEvery:                      # sync every `gap` steps, whatever the counters
          def __init__(self, gap): self.gap = gap
          def init(self): return 0
          def is_sync_step(self, state, k): return k % self.gap == 0
          def next(self, state, k): return state

      tx = scale_by_zero_one_adam(lr, variance_policy=VarianceDoubling(1000, 16),
                                  local_step_policy=SyncEvery(4), axis_name="w")

- :func:`scale_by_zero_one_adam` / :func:`scale_by_onebit_adam`: the algorithms;
  :func:`zero_one_adam` / :func:`onebit_adam`: the aliases with DeepSpeed's defaults.
- :func:`local_step`, :func:`sync_payload`, :func:`sync_step`: the pure pieces of 0/1 Adam's
  phase B, for building variants.
- :func:`comm_stats`: which collectives a compiled program runs and how many bytes it sends.
- :func:`replicate`, :func:`unreplicate`, :func:`synchronized_params`: the worker layout.
- :func:`worker_count`, :func:`check_worker_count`, :func:`reset_compression`: checkpoints and
  worker counts (exact resume needs none of them: save and restore the worker layout).
"""

from optax_zero_one.checkpoint import check_worker_count, reset_compression, worker_count
from optax_zero_one.collective import OnebitMeanState, compressed_mean, float_mean, onebit_mean
from optax_zero_one.comm_stats import Collective, CommStats, comm_stats, parse_hlo
from optax_zero_one.deepspeed import from_deepspeed_config
from optax_zero_one.onebit_adam import OnebitAdamState, onebit_adam, scale_by_onebit_adam
from optax_zero_one.policies import (
    IntervalState,
    LocalStepDoubling,
    LocalStepPolicy,
    VarianceDoubling,
    VariancePolicy,
    sync_steps,
    variance_steps,
)
from optax_zero_one.workers import replicate, synchronized_params, unreplicate
from optax_zero_one.zero_one_adam import (
    STEP_KINDS,
    ZeroOneAdamState,
    local_step,
    scale_by_zero_one_adam,
    step_kind,
    sync_payload,
    sync_step,
    zero_one_adam,
)

__version__ = "0.1.0"

__all__ = [
    "STEP_KINDS",
    "Collective",
    "CommStats",
    "IntervalState",
    "LocalStepDoubling",
    "LocalStepPolicy",
    "OnebitAdamState",
    "OnebitMeanState",
    "VarianceDoubling",
    "VariancePolicy",
    "ZeroOneAdamState",
    "check_worker_count",
    "comm_stats",
    "compressed_mean",
    "float_mean",
    "from_deepspeed_config",
    "local_step",
    "onebit_adam",
    "onebit_mean",
    "parse_hlo",
    "replicate",
    "reset_compression",
    "scale_by_onebit_adam",
    "scale_by_zero_one_adam",
    "step_kind",
    "sync_payload",
    "sync_step",
    "synchronized_params",
    "sync_steps",
    "unreplicate",
    "variance_steps",
    "worker_count",
    "zero_one_adam",
]
