"""Building our optimizers from the ``optimizer`` section of a DeepSpeed JSON config.

DeepSpeed configures 0/1 Adam and 1-bit Adam with a section like::

    "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 4e-4, "var_freeze_step": 12500}}

:func:`from_deepspeed_config` maps such a section onto :func:`~optax_zero_one.zero_one_adam` or
:func:`~optax_zero_one.onebit_adam`. Like DeepSpeed, which passes ``params`` to the optimizer's
constructor as keyword arguments, it rejects keys it does not know. Keys that only steer
DeepSpeed's PyTorch communication backend are accepted and ignored, and so are keys that
DeepSpeed's own implementation stores but never reads, when they hold a value that changes
nothing; a value that would ask for behaviour neither implementation has is rejected.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import optax

from optax_zero_one.core import _checks
from optax_zero_one.core.onebit_adam import onebit_adam
from optax_zero_one.core.zero_one_adam import zero_one_adam

# DeepSpeed matches optimizer types case-insensitively (``type.lower()``).
_TYPES = {"zerooneadam": "ZeroOneAdam", "onebitadam": "OneBitAdam"}

# Keys of both DeepSpeed optimizers' constructors that map onto our arguments.
_COMMON = ("lr", "betas", "eps", "weight_decay")
_OWN = {
    "ZeroOneAdam": (
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
    ),
    "OneBitAdam": ("freeze_step",),
}

# Keys accepted with any value and ignored, and why.
_IGNORED = {
    "cuda_aware": "it tells DeepSpeed's MPI backend whether MPI can read GPU memory; "
    "JAX's collectives are compiled by XLA for the platform",
    "comm_backend_name": "it selects DeepSpeed's PyTorch communication backend (nccl, mpi, "
    "hccl, compressed); JAX's collectives are compiled by XLA for the platform",
    "bias_correction": "DeepSpeed stores it but never applies bias correction in these "
    "optimizers, and neither do we (the frozen variance relies on it)",
}

# Keys accepted only with the value that changes nothing, and why other values are refused.
_ONLY_DEFAULT = {
    "amsgrad": (
        False,
        "AMSGrad is not supported by 0/1 Adam or 1-bit Adam (DeepSpeed raises on it too)",
    ),
    "eps_inside_sqrt": (
        False,
        "DeepSpeed stores it but never reads it: eps is always added outside the square root. "
        "Remove the key to get DeepSpeed's behaviour",
    ),
}

# Keys refused whatever their value, as DeepSpeed's engine refuses them.
_REFUSED = {
    "max_grad_norm": "DeepSpeed's engine refuses it in the optimizer params, whatever its value "
    "(its clipping is the top-level 'gradient_clipping' key). Remove the key; to clip, chain "
    "optax.clip_by_global_norm before the optimizer yourself (it then clips each worker's "
    "local gradient)",
}

_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def from_deepspeed_config(
    config: Mapping[str, Any],
    *,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    mask: Any = None,
    learning_rate: optax.ScalarOrSchedule | None = None,
    fast_axis_name: str | None = None,
    collective: str = "two_phase",
) -> optax.GradientTransformationExtraArgs:
    """Builds 0/1 Adam or 1-bit Adam from the ``optimizer`` section of a DeepSpeed config.

    Keys of ``config["params"]`` and what they become (DeepSpeed's defaults where absent):

    ======================= =====================================================
    DeepSpeed key           our argument
    ======================= =====================================================
    ``lr`` (1e-3)           ``learning_rate`` (or the ``learning_rate`` override)
    ``betas`` ([0.9,0.999]) ``b1``, ``b2``
    ``eps`` (1e-8)          ``eps`` (added outside the square root, as DeepSpeed)
    ``weight_decay`` (0)    ``weight_decay`` (decoupled, scaled by the learning rate)
    ``var_freeze_step``     ``var_freeze_step`` (ZeroOneAdam only)
    ``var_update_scaler``   ``var_update_scaler`` (ZeroOneAdam only)
    ``local_step_scaler``   ``local_step_scaler`` (ZeroOneAdam only)
    ``local_step_clipper``  ``local_step_clipper`` (ZeroOneAdam only)
    ``freeze_step``         ``freeze_step`` (OneBitAdam only)
    ``cuda_aware``,         ignored: PyTorch communication backend settings
    ``comm_backend_name``
    ``bias_correction``     ignored (true, false, 0 or 1): DeepSpeed applies none
    ``amsgrad``             only ``false`` or ``0`` (AMSGrad is not supported)
    ``eps_inside_sqrt``     only ``false`` or ``0`` (DeepSpeed ignores ``true``)
    ``max_grad_norm``       refused, as DeepSpeed's engine refuses it
    ======================= =====================================================

    Any other key raises ``ValueError``, as DeepSpeed's constructors raise ``TypeError``.
    Behaviour follows ``docs/algorithm.md``, which lists where it deviates from DeepSpeed on
    purpose (no wasted first step, compressed steps with one worker, exact checkpoints).

    Args:
      config: the ``optimizer`` section, ``{"type": ..., "params": {...}}``; ``type`` is
        ``"ZeroOneAdam"`` or ``"OneBitAdam"`` (any case, as in DeepSpeed).
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context (with
        ``fast_axis_name``, the pair ``(nodes, per_node)``).
      mask: optional pytree of 0/1 like the params (DeepSpeed's ``exp_avg_mask``, which it
        takes from the parameter groups rather than from the config).
      learning_rate: replaces ``params["lr"]``, e.g. with an ``optax.Schedule`` equivalent to
        the config's ``scheduler`` section (which this function does not read).
      fast_axis_name, collective: as in :func:`~optax_zero_one.zero_one_adam` (settings of
        this library with no DeepSpeed key: hierarchical compression across nodes, and the
        one-``psum`` backend).

    Returns:
      :func:`~optax_zero_one.zero_one_adam` or :func:`~optax_zero_one.onebit_adam`, configured.

    Example:
      >>> import json
      >>> ds = json.loads('{"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 4e-4, '
      ...                 '"weight_decay": 0.01, "var_freeze_step": 12500}}}')
      >>> tx = from_deepspeed_config(ds["optimizer"], axis_name="batch")

    References:
      DeepSpeed's ``ZeroOneAdam`` and ``OnebitAdam`` (``deepspeed/runtime/fp16/onebit``);
      Lu et al., arXiv:2202.06009; Tang et al., arXiv:2102.02888.
    """
    kind, params = _parse_section(config)
    supported = (*_COMMON, *_OWN[kind], *_IGNORED, *_ONLY_DEFAULT)
    for key in params:
        if key in _REFUSED:
            raise ValueError(f"{kind} param {key} is not supported: {_REFUSED[key]}.")
        if key not in supported:
            raise ValueError(_unknown_key_message(kind, key, supported))
    for key, (allowed, why) in _ONLY_DEFAULT.items():
        if key in params and not _same(params[key], allowed):
            raise ValueError(f"{kind} param {key}={params[key]!r} is not supported: {why}.")
    bias_correction = params.get("bias_correction", False)
    if not (isinstance(bias_correction, bool) or bias_correction in (0, 1)):
        raise ValueError(
            f"{kind} param bias_correction must be true or false, got {bias_correction!r}."
        )

    lr = params.get("lr", _DEFAULTS["lr"])
    keys = dict(_CONFIG_KEYS)  # our argument a range error names -> its config key
    if learning_rate is None:
        learning_rate = _number(kind, "lr", lr)
    else:  # the caller's own rate (a schedule): its errors are not the config's
        del keys["learning_rate"]
    b1, b2 = _betas(kind, params.get("betas", _DEFAULTS["betas"]))
    eps = _number(kind, "eps", params.get("eps", _DEFAULTS["eps"]))
    weight_decay = _number(
        kind, "weight_decay", params.get("weight_decay", _DEFAULTS["weight_decay"])
    )
    common = dict(
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        axis_name=axis_name,
        num_workers=num_workers,
        mask=mask,
        fast_axis_name=fast_axis_name,
        collective=collective,
    )
    own = {key: params[key] for key in _OWN[kind] if key in params}
    for key, value in own.items():
        # a JSON config may write a step count as 1e5 or 12500.0; DeepSpeed only compares it
        if isinstance(value, float) and value.is_integer():
            own[key] = value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{kind} param {key} must be an integer, got {value!r}.{_auto(value)}")
    build = zero_one_adam if kind == "ZeroOneAdam" else onebit_adam
    try:
        return build(learning_rate, **common, **{k: int(v) for k, v in own.items()})
    except _checks.ArgumentError as e:  # names our argument: say which config key it is
        key = keys.get(e.argument, e.argument if e.argument in own else None)
        if key is None:
            raise
        raise ValueError(f"{kind} param {key}: {e}") from None


# our argument a range error names -> the DeepSpeed config key it came from
_CONFIG_KEYS = {
    "learning_rate": "lr",
    "b1": "betas[0]",
    "b2": "betas[1]",
    "eps": "eps",
    "weight_decay": "weight_decay",
}


def _parse_section(config: Any) -> tuple[str, Mapping[str, Any]]:
    if not isinstance(config, Mapping):
        raise ValueError(
            f"config must be the optimizer section of a DeepSpeed config (a dict with 'type' "
            f"and 'params'), got {type(config).__name__}."
        )
    if "type" not in config:
        hint = (
            " This looks like a whole DeepSpeed config: pass config['optimizer']."
            if "optimizer" in config
            else ""
        )
        raise ValueError(f"The optimizer section has no 'type'.{hint}")
    # legacy_fusion steers DeepSpeed's fp16 optimizer wrapper; nothing here depends on it.
    extra = sorted(set(config) - {"type", "params", "legacy_fusion"})
    if extra:
        raise ValueError(
            f"Unsupported keys in the optimizer section: {extra}. Expected 'type', 'params' "
            "and optionally 'legacy_fusion' (ignored); keys like 'lr' belong inside 'params'."
        )
    name = config["type"]
    if not isinstance(name, str) or name.lower() not in _TYPES:
        raise ValueError(
            f"Optimizer type {name!r} is not one this library implements; supported: "
            "'ZeroOneAdam' (0/1 Adam) and 'OneBitAdam' (1-bit Adam). For plain Adam/AdamW use "
            "optax.adamw with a jax.lax.pmean of the gradients."
        )
    params = config.get("params")
    params = {} if params is None else params  # DeepSpeed reads a null params as none
    if not isinstance(params, Mapping):
        raise ValueError(f"'params' must be a dict, got {type(params).__name__}.")
    return _TYPES[name.lower()], params


def _unknown_key_message(kind: str, key: str, supported: tuple[str, ...]) -> str:
    hints = {
        ("ZeroOneAdam", "freeze_step"): " 0/1 Adam has no freeze_step; its closest analogue "
        "is var_freeze_step, the step after which the variance is frozen (usually the end of the "
        "learning-rate warm-up; 1-bit Adam's freeze_step is usually later).",
        ("OneBitAdam", "var_freeze_step"): " 1-bit Adam's analogue is freeze_step, the number "
        "of full-precision warm-up steps.",
    }
    if key == "exp_avg_mask":
        hints[kind, key] = (
            " DeepSpeed takes the momentum mask from the parameter groups; here it is the "
            "mask= argument of from_deepspeed_config (a tree of 0/1 like the params)."
        )
    return (
        f"{kind} param {key!r} is not supported.{hints.get((kind, key), '')} Supported keys: "
        f"{', '.join(sorted(supported))}."
    )


def _same(value: Any, allowed: Any) -> bool:
    # DeepSpeed tests these keys for truth (``if amsgrad:``), so JSON's 0 is its false and
    # false its 0; a string such as "false" is truthy there and stays refused here.
    return isinstance(value, numbers.Real) and value == allowed


def _auto(value: Any) -> str:
    """The hint for a value DeepSpeed's Hugging Face integration would have filled in."""
    if isinstance(value, str) and value == "auto":
        return " Resolve 'auto' values (filled in by the Hugging Face integration) before calling."
    return ""


def _number(kind: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{kind} param {key} must be a number, got {value!r}.{_auto(value)}")
    return float(value)


def _betas(kind: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(
            f"{kind} param betas must be a pair [b1, b2], got {value!r}.{_auto(value)}"
        )
    return _number(kind, "betas[0]", value[0]), _number(kind, "betas[1]", value[1])
