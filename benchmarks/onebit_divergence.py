"""Why 1-bit Adam diverges in the 10,000-step study, and what stops it.

Run as ``python -m benchmarks.onebit_divergence [--resume] [--remedies ...] [--report]
[--quick] [--out DIR]`` (about 27 min wall on 2 shared cores); the page:
``docs/benchmarks/onebit_divergence.md``.

In ``benchmarks.convergence_long`` 1-bit Adam (warm-up, i.e. variance frozen, at step 1,500 =
15% of 10,000) diverged on seeds 0 and 2 at its sweep-best rate 2e-3, just after the freeze.
This script trains the study's 1-bit Adam on the study's workload and recipe (the ``base``
config of :class:`benchmarks.convergence_long.Study` with ``steps=10_000``, so that the
schedule and the freeze step are those of the long runs; it only stops the loop early):

1. **Ours against the float64 reference.** Our ``ozo.onebit_adam`` as the study builds it
   (:func:`benchmarks.support.training.make_spec`), and, as the optimizer in the same loop,
   the float64 NumPy reference of ``docs/algorithm.md`` (``tests/support/reference.py``,
   :class:`OnebitAdam`): each step the JAX model computes each worker's local gradient at the
   reference's own per-worker parameters (float32 for the model; the reference keeps float64
   state) and the reference takes the step. Same seed, batches, learning-rate schedule, Adam
   constants, weight decay and freeze step. A benchmark imports test support here on purpose:
   that module is the specification's executable reference, written without the library, so a
   divergence it shares is the algorithm's, not our code's.
2. **Where it blows up.** Around the freeze, per leaf, the largest update relative to the
   parameter and the first step at which a leaf becomes non-finite; for the token embedding,
   per row (one character): its frozen ``sqrt(v)``, the character's count in the training text,
   its momentum before and after the first compressed step, and its step size.
3. **Remedies a DeepSpeed user would apply**: a momentum mask (DeepSpeed's ``exp_avg_mask``)
   on the embedding rows of rare characters, seeds 0 and 2; a later freeze (25% of the run, the
   top of DeepSpeed's 15-25%) and a larger ``eps``, seed 2 (the CPU budget). Each runs past
   its own freeze.

Every finished run is saved at once to ``<out>/onebit_divergence.partial.json``; ``--resume``
runs only what is missing. At the end it writes ``<out>/onebit_divergence.json`` and ``.md``
(``--report``: the ``.md`` again from the ``.json``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported; main() sets PJRT_NPROC

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

STEM = "onebit_divergence"
ROOT = pathlib.Path(__file__).resolve().parents[1]

# A row of the token embedding is masked (its compressed momentum zeroed after the freeze) when
# its character occurs fewer than this many times in the training text. Chosen from the
# diagnosis (part 2): see docs/benchmarks/onebit_divergence.md.
RARE_COUNT = 100
LARGE_EPS = 3e-4  # remedy (c): bounds every token row's first compressed step by ~10 lr (part 2)
LATE_FREEZE = 0.25  # remedy (b): 25% of the run, DeepSpeed's upper end
REMEDIES = ("mask", "late_freeze", "large_eps")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What is run. Steps are 1-based (step ``k`` is the ``k``-th update)."""

    lr: float = 2e-3
    seeds: tuple[int, ...] = (0, 2)  # the seeds that diverged in the study
    reference_seeds: tuple[int, ...] = (2, 0)
    diverge_steps: int = 1_750  # ours and the reference, without a remedy
    remedy_steps: int = 2_500
    late_freeze_steps: int = 3_000
    window: int = 30  # steps after the freeze with per-leaf statistics
    eval_every: int = 250  # as the study's long runs
    rare_count: int = RARE_COUNT
    large_eps: float = LARGE_EPS
    late_freeze: float = LATE_FREEZE
    # the CPU budget (the machine was shared): one seed for the second and third remedies
    late_freeze_seeds: tuple[int, ...] = (2,)
    large_eps_seeds: tuple[int, ...] = (2,)
    changes: tuple[tuple[str, Any], ...] = ()  # on top of the study's config (--quick only)

    def config(self, seed: int, **changes: Any) -> Any:
        return base_config(seed, self.lr, **dict(self.changes), **changes)


# A smoke test of the pipeline in about a minute (a tiny model, freeze at step 150): not
# evidence.
QUICK = Setup(
    seeds=(0,),
    reference_seeds=(0,),
    large_eps_seeds=(0,),
    late_freeze_seeds=(0,),
    diverge_steps=200,
    remedy_steps=200,
    late_freeze_steps=300,
    window=10,
    eval_every=50,
    changes=(
        ("model", (("dim", 32), ("layers", 1), ("heads", 2), ("context", 16))),
        ("steps", 1000),
    ),
)


def base_config(seed: int, lr: float, **changes: Any) -> Any:
    """The 1-bit Adam config of the first 10,000-step study (pydoc, freeze 15%, no rare-row
    mask; convergence_long has since moved to the standard library's sources and the authors'
    recipes), ``changes`` on top."""
    from benchmarks.support import training

    cfg = dataclasses.replace(
        training.PRESETS[("char_lm", "full")],
        steps=10_000,
        peak_lr=lr,
        seed=seed,
        eval_every=250,
        optimizers=("onebit_adam",),
    )
    return dataclasses.replace(cfg, **changes)


# --------------------------------------------------------------------------- the text


def _leaf_names(params: Any) -> list[str]:
    import jax

    def name(key: Any) -> str:
        return str(getattr(key, "key", getattr(key, "idx", key)))

    return [".".join(map(name, p)) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


# --------------------------------------------------------------------------- the runs


def _first(flags: Any) -> int | None:
    """The 1-based step of the first true flag (``None``: none)."""
    hits = np.flatnonzero(np.asarray(flags, bool))
    return int(hits[0]) + 1 if hits.size else None


def loss_events(losses: list[float | None], freeze: int) -> dict[str, Any]:
    """Where a run's training loss (per step, ``None``: non-finite) blew up after ``freeze``."""
    a = np.asarray(_floats(losses), np.float64)
    finite = np.isfinite(a)
    before = float(np.mean(a[freeze - 100 : freeze]))
    late = np.arange(len(a)) >= freeze  # steps freeze+1, ...
    blocks = len(a) // 100
    means = a[: blocks * 100].reshape(blocks, 100).mean(1)
    finite_blocks = np.flatnonzero(np.isfinite(means))
    last = int(finite_blocks[-1]) if finite_blocks.size else None
    return {
        "steps": len(a),
        "loss_before_freeze": round(before, 5),  # mean of the 100 steps up to the freeze
        "first_loss_spike": _first(late & ~(a <= 2 * before)),  # > 2x that mean, or non-finite
        "first_loss_over_1e3x": _first(late & ~(a <= 1e3 * before)),
        "first_nonfinite_loss": _first(~finite),
        "last_finite_block": (
            None
            if last is None
            else {
                "steps": f"{last * 100 + 1}-{last * 100 + 100}",
                "mean_loss": round(float(means[last]), 5),
            }
        ),
        "final_block_mean_loss": _num(float(means[-1])) if blocks else None,
    }


def param_events(
    leaf_max: np.ndarray, steps: np.ndarray, freeze: int, names: list[str]
) -> dict[str, Any]:
    """Where a run's parameters blew up: from each leaf's ``max |x|`` (``leaf_max[i]``, after
    step ``steps[i]``; the freeze step must be one of them)."""
    at_freeze = leaf_max[list(steps).index(freeze)]
    grown = ~(leaf_max <= 1e3 * at_freeze)  # > 1e3x its value at the freeze, or non-finite

    def first(flags: np.ndarray) -> int | None:
        hit = _first(flags)
        return None if hit is None else int(steps[hit - 1])

    bad = {n: first(~np.isfinite(leaf_max[:, j])) for j, n in enumerate(names)}
    bad = {k: v for k, v in bad.items() if v is not None}
    row = _first(grown.any(1))
    return {
        "first_param_over_1e3x": first(grown.any(1)),  # a leaf's max |x| > 1e3x at the freeze
        "first_leaf_over_1e3x": None if row is None else names[int(np.argmax(grown[row - 1]))],
        "first_nonfinite_param_step": min(bad.values()) if bad else None,
        "first_nonfinite_leaves": sorted(k for k, v in bad.items() if v == min(bad.values())),
        "params_finite": bool(np.isfinite(leaf_max).all()),
        "max_abs_param": float(np.nanmax(np.where(np.isfinite(leaf_max), leaf_max, np.nan))),
    }


def _summary(run: dict[str, Any], freeze: int) -> dict[str, Any]:
    out = loss_events(run["train_loss"], freeze) | run["param_events"]
    out["all_finite"] = out["first_nonfinite_loss"] is None and out["params_finite"]
    return out


def run_ours(
    cfg: Any,
    workload: Any,
    mesh: Any,
    stop: int,
    mask: Any = None,
    window: int = 0,
    eval_every: int = 250,
) -> dict[str, Any]:
    """Our 1-bit Adam (the study's spec for ``cfg``) for ``stop`` steps of the ``cfg.steps``-step
    schedule; with ``window``, per-leaf statistics for the steps around the freeze and the
    token embedding's moments at the freeze."""
    import jax
    import jax.numpy as jnp

    import optax_zero_one as ozo
    from benchmarks.support import common, training
    from optax_zero_one.core.frozen_variance import FrozenVarianceAdamState

    start, cpu = time.perf_counter(), time.process_time()
    spec = training.make_spec("onebit_adam", cfg, mask)
    freeze = cfg.onebit_freeze_step()
    axes = common.worker_axes(mesh)
    step = common.train_step(spec, workload.loss, mesh)
    init = jax.jit(ozo.on_workers(spec.tx.init, mesh, axes))
    one = workload.init_params(cfg.seed)
    names = _leaf_names(one)
    token = next(i for i, n in enumerate(names) if n.startswith("tokens"))
    params = ozo.to_workers(ozo.replicate(one, training.NUM_WORKERS), mesh, axes)
    state = init(params)
    evaluate = jax.jit(ozo.on_workers(workload.eval_sums, mesh, axes))
    eval_batch = ozo.to_workers(workload.eval_batch, mesh, axes)
    leaf_max = jax.jit(lambda p: jnp.stack([jnp.max(jnp.abs(x[0])) for x in jax.tree.leaves(p)]))

    def host(tree: Any) -> list[np.ndarray]:  # worker 0's leaves, float64 on the host
        return [np.asarray(x[0], np.float64) for x in jax.tree.leaves(tree)]

    def moments(state: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FrozenVarianceAdamState))
        fv = next(x for x in found if isinstance(x, FrozenVarianceAdamState))
        return host(fv.mu.to_tree()), host(fv.nu.to_tree())

    def validate(params: Any) -> float:
        sums = {k: np.asarray(v, np.float64).sum() for k, v in evaluate(params, eval_batch).items()}
        return float(sums["loss"] / sums["count"])

    losses, maxes, max_steps, val = [], [], [], {"step": [0], "loss": [validate(params)]}
    rel, absmax, token_rows, at_freeze = [], [], [], {}
    for i in range(stop):
        k = i + 1
        watch = window and freeze - 2 <= k <= freeze + window
        before = host(params) if watch else None
        batch = ozo.to_workers(workload.train_batch(i), mesh, axes)
        params, state, loss, _ = common.run_step(step, params, state, batch)
        losses.append(float(np.asarray(loss, np.float64).mean()))
        if window or k % 10 == 0 or k in (freeze, stop):  # every 10 steps: a smaller overhead
            maxes.append(np.asarray(leaf_max(params), np.float64))
            max_steps.append(k)
        if watch:
            after = host(params)
            delta = [a - b for a, b in zip(after, before)]
            rel.append([_rms(d) / max(_rms(b), 1e-30) for d, b in zip(delta, before)])
            absmax.append([float(np.max(np.abs(d))) for d in delta])
            if freeze < k <= freeze + 10:
                token_rows.append(np.sqrt(np.mean(delta[token] ** 2, axis=1)))
            if k in (freeze, freeze + 1):
                mu, nu = moments(state)
                at_freeze[k] = {"mu": mu[token], "nu": nu[token]}
        if k % eval_every == 0:
            val["step"].append(k)
            val["loss"].append(validate(params))
        if i >= freeze + 100 and not np.isfinite(losses[-100:]).any():
            break  # 100 non-finite losses in a row: nothing more to learn from this run
    out = {
        "param_events": param_events(np.asarray(maxes), np.asarray(max_steps), freeze, names),
        "val": {"step": val["step"], "loss": [_num(x) for x in val["loss"]]},
        "train_loss": [_num(x) for x in losses],
        "leaf_max_abs": np.asarray(maxes).round(6).tolist() if window else None,
        "seconds": {
            "wall": round(time.perf_counter() - start, 1),
            "cpu": round(time.process_time() - cpu, 1),
        },
        "freeze_step": freeze,
        "leaves": names,
    }
    if window:
        out["window"] = {
            "steps": [k for k in range(freeze - 2, freeze + window + 1) if k <= len(losses)],
            "rel_update": np.asarray(rel).tolist(),  # rms(delta) / rms(x), per step and leaf
            "max_abs_update": np.asarray(absmax).tolist(),
            "token_row_update_rms": np.asarray(token_rows).tolist(),  # steps T+1..T+10
            "token_mu_at_freeze": at_freeze[freeze]["mu"].tolist(),
            "token_nu_at_freeze": at_freeze[freeze]["nu"].tolist(),
            "token_mu_after_first_compressed": at_freeze[freeze + 1]["mu"].tolist(),
            "lr_first_compressed": float(cfg.schedule()(freeze)),
        }
    return out


def run_reference(cfg: Any, workload: Any, stop: int) -> dict[str, Any]:
    """The float64 reference :class:`OnebitAdam` as the optimizer, the JAX model for the
    gradients (each worker's local gradient at that worker's reference parameters)."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the spec's reference
    from support import reference

    from benchmarks.support import training

    start, cpu = time.perf_counter(), time.process_time()
    n = training.NUM_WORKERS
    one = workload.init_params(cfg.seed)
    names = _leaf_names(one)
    treedef = jax.tree.structure(one)
    token = next(i for i, name in enumerate(names) if name.startswith("tokens"))
    freeze = cfg.onebit_freeze_step()
    lrs = np.asarray(cfg.schedule()(jnp.arange(stop + 1)), np.float64)  # the same float32 rates
    ref = reference.OnebitAdam(
        [np.asarray(x) for x in jax.tree.leaves(one)],
        n,
        lambda count: float(lrs[count]),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        freeze_step=freeze,
        mask=None
        if workload.mask is None
        else [np.asarray(m) for m in jax.tree.leaves(workload.mask)],
    )
    grads_of = jax.jit(jax.vmap(jax.value_and_grad(workload.loss)))
    losses, maxes, nu_token = [], [], None
    for i in range(stop):
        stacked = [
            np.stack([ref.x[w][j] for w in range(n)]).astype(np.float32) for j in range(len(names))
        ]
        loss, grads = grads_of(jax.tree.unflatten(treedef, stacked), workload.train_batch(i))
        losses.append(float(np.asarray(loss, np.float64).mean()))
        grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
        ref.step([[g[w] for g in grads] for w in range(n)])
        maxes.append(np.asarray([np.max(np.abs(x)) for x in ref.x[0]], np.float64))
        if i + 1 == freeze:
            nu_token = ref.v[0][token].copy()
        if i >= freeze + 100 and not np.isfinite(losses[-100:]).any():
            break
    return {
        "param_events": param_events(
            np.asarray(maxes), np.arange(1, len(maxes) + 1), freeze, names
        ),
        "train_loss": [_num(x) for x in losses],
        "token_nu_at_freeze": None if nu_token is None else nu_token.tolist(),
        "seconds": {
            "wall": round(time.perf_counter() - start, 1),
            "cpu": round(time.process_time() - cpu, 1),
        },
    }


def _floats(xs: list[float | None]) -> list[float]:
    return [math.nan if x is None else x for x in xs]


def _blocks(xs: list[float | None], size: int) -> list[float | None]:
    """Means over consecutive ``size`` steps (``None``: a block with a non-finite loss)."""
    a = np.asarray(_floats(xs), np.float64)
    n = len(a) // size
    return [_num(x) for x in a[: n * size].reshape(n, size).mean(1)]


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a)))) if a.size else 0.0


def _num(x: float) -> float | None:
    return round(float(x), 5) if math.isfinite(x) else None


# --------------------------------------------------------------------------- analysis


def diagnose(run: dict[str, Any], vocab: list[str], counts: np.ndarray) -> dict[str, Any]:
    """Per leaf and per token-embedding row, around the freeze, from a ``window`` run."""
    w, names, freeze = run["window"], run["leaves"], run["freeze_step"]
    steps = w["steps"]
    rel, absmax = np.asarray(w["rel_update"]), np.asarray(w["max_abs_update"])
    at = steps.index(freeze)
    after = slice(at + 1, min(at + 11, len(steps)))
    leaves = []
    for j, name in enumerate(names):
        late = rel[after, j]
        leaves.append(
            {
                "leaf": name,
                "rel_update_at_freeze": float(rel[at, j]),
                "max_rel_update_next_10": float(
                    np.nanmax(np.where(np.isfinite(late), late, np.inf))
                )
                if late.size
                else None,
                "max_abs_update_next_10": float(np.max(absmax[after, j])),
                "first_nonfinite_step": _first(~np.isfinite(np.asarray(run["leaf_max_abs"])[:, j])),
            }
        )
    nu = np.asarray(w["token_nu_at_freeze"])
    mu, mu_hat = (
        np.asarray(w["token_mu_at_freeze"]),
        np.asarray(w["token_mu_after_first_compressed"]),
    )
    sqrt_v = np.sqrt(nu)
    step_rms = np.asarray(w["token_row_update_rms"])  # (10, vocab)
    rows = []
    for r, ch in enumerate(vocab):
        rows.append(
            {
                "row": r,
                "char": ch,
                "count": int(counts[r]),
                "sqrt_v_min": float(sqrt_v[r].min()),
                "sqrt_v_median": float(np.median(sqrt_v[r])),
                "m_rms_at_freeze": _rms(mu[r]),
                "m_rms_after_first_compressed": _rms(mu_hat[r]),
                "step_rms_first_compressed": float(step_rms[0, r]),
                "step_rms_max_next_10": float(np.nanmax(step_rms[:, r])),
            }
        )
    ranks = [np.argsort(np.argsort(x)) for x in (counts, step_rms[0])]
    spearman = float(np.corrcoef(*ranks)[0, 1])  # count against step size; < 0: rarer, larger
    bins = [(0, 10), (10, 100), (100, 1_000), (1_000, 10_000), (10_000, 10**9)]
    by_count = []
    for lo, hi in bins:
        pick = (counts >= lo) & (counts < hi)
        if pick.any():
            by_count.append(
                {
                    "count": f"{lo:,}-{hi - 1:,}" if hi < 10**9 else f">= {lo:,}",
                    "rows": int(pick.sum()),
                    "sqrt_v_median": float(np.median(sqrt_v[pick])),
                    "m_rms_at_freeze_median": float(
                        np.median([_rms(mu[r]) for r in np.flatnonzero(pick)])
                    ),
                    "m_hat_rms_median": float(
                        np.median([_rms(mu_hat[r]) for r in np.flatnonzero(pick)])
                    ),
                    "step_rms_first_compressed_median": float(np.median(step_rms[0, pick])),
                    "step_rms_first_compressed_max": float(np.max(step_rms[0, pick])),
                }
            )
    return {
        "leaves": leaves,
        "token_rows": sorted(rows, key=lambda x: -x["step_rms_first_compressed"]),
        "token_rows_by_count": by_count,
        "spearman_count_vs_step": spearman,
        "lr_first_compressed": w["lr_first_compressed"],
    }


# --------------------------------------------------------------------------- the study


class _Store:
    """Finished runs, saved after each one (``--resume`` runs only what is missing)."""

    def __init__(self, path: pathlib.Path, settings: dict[str, Any], resume: bool) -> None:
        self.path, self.settings, self.runs = path, settings, {}
        if resume and path.exists():
            saved = json.loads(path.read_text())
            if saved["settings"] != settings:
                raise SystemExit(f"{path} was written with other settings: remove it")
            self.runs = saved["runs"]

    def get(self, key: str, make: Any) -> dict[str, Any]:
        if key not in self.runs:
            print(f"{key} ...", file=sys.stderr, flush=True)
            self.runs[key] = make()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": self.settings, "runs": self.runs}))
            losses = _floats(self.runs[key]["train_loss"])
            print(
                f"{key}: {self.runs[key]['seconds']}, {len(losses)} steps, first non-finite loss "
                f"{_first(~np.isfinite(losses))}",
                file=sys.stderr,
                flush=True,
            )
        return self.runs[key]


def run(
    setup: Setup, out: pathlib.Path, resume: bool = False, remedies: tuple[str, ...] = REMEDIES
) -> dict[str, Any]:
    """Runs (or resumes) the three parts (part 3: the ``remedies`` named); returns the
    JSON-ready result."""
    from benchmarks.support import common, training, workloads

    common.setup_cpu_devices(training.NUM_WORKERS)
    import optax_zero_one as ozo

    mesh = ozo.worker_mesh(common.AXIS, training.NUM_WORKERS)
    settings = json.loads(json.dumps(dataclasses.asdict(setup)))
    # the remedies' parameters are in their runs' keys, so that one can change without the rest
    shared = {
        k: v
        for k, v in settings.items()
        if k
        not in ("rare_count", "large_eps", "late_freeze", "large_eps_seeds", "late_freeze_seeds")
    }
    store = _Store(out / f"{STEM}.partial.json", shared, resume)
    wall, cpu = time.perf_counter(), time.process_time()
    made: dict[int, Any] = {}

    def workload(seed: int) -> Any:
        if seed not in made:
            made[seed] = training.make_workload(setup.config(seed))
        return made[seed]

    first = workload(setup.seeds[0])
    vocab, counts = list(first.vocab), first.token_counts
    runs: dict[str, Any] = {}
    for seed in setup.seeds:
        cfg = setup.config(seed)
        runs[f"ours/{seed}"] = store.get(
            f"ours/{seed}",
            lambda cfg=cfg: run_ours(
                cfg,
                workload(cfg.seed),
                mesh,
                setup.diverge_steps,
                window=setup.window,
                eval_every=setup.eval_every,
            ),
        )
    for seed in setup.reference_seeds:
        cfg = setup.config(seed)
        runs[f"reference/{seed}"] = store.get(
            f"reference/{seed}",
            lambda cfg=cfg: run_reference(cfg, workload(cfg.seed), setup.diverge_steps),
        )
    mask = workloads.rare_token_mask(first, setup.rare_count)
    tried = {
        f"mask<{setup.rare_count}": ("mask", dict(), mask, setup.remedy_steps),
        f"freeze={setup.late_freeze:g}": (
            "late_freeze",
            dict(freeze=setup.late_freeze),
            None,
            setup.late_freeze_steps,
        ),
        f"eps={setup.large_eps:g}": (
            "large_eps",
            dict(eps=setup.large_eps),
            None,
            setup.remedy_steps,
        ),
    }
    for label, (name, changes, m, steps) in tried.items():
        if name not in remedies:
            continue
        seeds = {"large_eps": setup.large_eps_seeds, "late_freeze": setup.late_freeze_seeds}
        for seed in seeds.get(name, setup.seeds):
            cfg = setup.config(seed, **changes)
            runs[f"{name}/{seed}"] = store.get(
                f"{label}/{seed}",
                lambda cfg=cfg, m=m, steps=steps: run_ours(
                    cfg, workload(cfg.seed), mesh, steps, mask=m, eval_every=setup.eval_every
                ),
            )

    seed = 2 if 2 in setup.seeds else setup.seeds[0]  # the diagnosis's seed
    found = diagnose(runs[f"ours/{seed}"], vocab, counts)
    agreement = {}
    for s in setup.seeds:
        if f"reference/{s}" not in runs:
            continue
        ours, ref = runs[f"ours/{s}"], runs[f"reference/{s}"]
        a, b = (np.asarray(_floats(r["train_loss"])) for r in (ours, ref))
        f = ours["freeze_step"]
        o, r = (np.sqrt(np.asarray(x["token_nu_at_freeze"])) for x in (ours["window"], ref))
        agreement[str(s)] = {
            # the two loops before the freeze: float32 against float64, same algorithm
            "max_abs_train_loss_gap_steps_1_to_freeze": float(np.max(np.abs(a[:f] - b[:f]))),
            "token_sqrt_v_at_freeze_median_rel_gap": float(
                np.median(np.abs(o - r) / np.maximum(r, 1e-30))
            ),
        }
    study = _study_seed1()
    result = {
        "benchmark": STEM,
        "workload": workload(setup.seeds[0]).description,
        "setup": settings,
        "recipe": {
            k: v
            for k, v in dataclasses.asdict(setup.config(0)).items()
            if k in ("steps", "peak_lr", "warmup", "final_lr", "b1", "b2", "eps", "weight_decay")
        }
        | {"freeze_step": setup.config(0).onebit_freeze_step()},
        "masked_rows": [
            {"row": int(r), "char": vocab[r], "count": int(counts[r])}
            for r in np.flatnonzero(counts < setup.rare_count)
        ],
        "summaries": {k: _summary(r, _freeze(k, setup)) for k, r in runs.items()},
        "train_loss_block_means": {k: _blocks(r["train_loss"], 100) for k, r in runs.items()},
        "val": {k: r["val"] for k, r in runs.items() if "val" in r},
        "seconds": {k: r["seconds"] for k, r in runs.items()},
        "agreement": agreement,
        "diagnosis_seed": 2 if 2 in setup.seeds else setup.seeds[0],
        "diagnosis": found,
        "study_seed1_untreated_val": study,
        "wall_seconds_this_process": round(time.perf_counter() - wall, 1),
        "cpu_seconds_this_process": round(time.process_time() - cpu, 1),
    }
    return result


def _freeze(key: str, setup: Setup) -> int:
    """The freeze step of run ``key``."""
    changes = dict(freeze=setup.late_freeze) if key.startswith("late_freeze/") else {}
    return setup.config(0, **changes).onebit_freeze_step()


def _study_seed1() -> dict[str, Any] | None:
    """Seed 1 of the study's 1-bit Adam at 2e-3 (it did not diverge): its validation curve."""
    path = ROOT / "results" / "convergence_long.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("corpus", {}).get("corpus", "pydoc") != "pydoc":  # a later study (git history)
        return None
    run = saved["runs"].get("long/onebit_adam/1")
    return None if run is None else {"step": run["val"]["step"], "loss": run["val"]["loss"]}


# --------------------------------------------------------------------------- report


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "non-finite"
    return format(x, spec) if isinstance(x, float) else f"{x:,}" if isinstance(x, int) else str(x)


def _val_at(run_val: dict[str, Any] | None, step: int) -> float | None:
    if not run_val or step not in run_val["step"]:
        return None
    return run_val["loss"][run_val["step"].index(step)]


def markdown(result: dict[str, Any]) -> str:
    """The report's tables."""
    s, d = result["summaries"], result["diagnosis"]
    lines = [
        "# 1-bit Adam's divergence: ours, the float64 reference, remedies",
        "",
        result["workload"],
        "",
        f"Recipe: {result['recipe']}",
        "",
        "## Without a remedy: ours and the reference",
        "",
        "| run | seed | loss before freeze | first step loss > 2x | first non-finite loss "
        "| first step a leaf's max abs > 1e3x | leaf | first non-finite param (leaves) "
        "| last finite 100-step block (mean loss) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, x in s.items():
        kind, seed = key.split("/")
        if kind not in ("ours", "reference"):
            continue
        block = x["last_finite_block"]
        last = f"{block['steps']} ({block['mean_loss']:.4f})" if block else "-"
        lines.append(
            f"| {kind} | {seed} | {x['loss_before_freeze']:.4f} | {_fmt(x['first_loss_spike'])} "
            f"| {_fmt(x['first_nonfinite_loss'])} | {_fmt(x['first_param_over_1e3x'])} "
            f"| {_fmt(x['first_leaf_over_1e3x'])} | {_fmt(x['first_nonfinite_param_step'])} "
            f"({_leaves(x['first_nonfinite_leaves'], len(result['diagnosis']['leaves']))}) "
            f"| {last} |"
        )
    lines += [
        "",
        "The two loops up to the freeze (the same algorithm in float32 and in float64):",
        "",
    ]
    for seed, a in result["agreement"].items():
        lines.append(
            f"- seed {seed}: largest gap in the training loss over steps 1 to the freeze "
            f"{a['max_abs_train_loss_gap_steps_1_to_freeze']:.1e} (losses are kept to 5 "
            f"decimals); median relative gap of the token embedding's sqrt(v) at the freeze "
            f"{a['token_sqrt_v_at_freeze_median_rel_gap']:.1e}."
        )
    lines += [
        "",
        f"## Per leaf, seed {result['diagnosis_seed']}: update size around the freeze",
        "",
        "rms(update) / rms(param); the freeze step is the last full-precision step.",
        "",
        "| leaf | at the freeze | largest, next 10 steps | largest abs update, next 10 "
        "| first non-finite step |",
        "|---|---|---|---|---|",
    ]
    for leaf in sorted(d["leaves"], key=lambda x: -(x["max_rel_update_next_10"] or 0)):
        lines.append(
            f"| {leaf['leaf']} | {leaf['rel_update_at_freeze']:.2e} "
            f"| {leaf['max_rel_update_next_10']:.2e} | {leaf['max_abs_update_next_10']:.2e} "
            f"| {_fmt(leaf['first_nonfinite_step'])} |"
        )
    lines += [
        "",
        f"## Token embedding rows, seed {result['diagnosis_seed']} (lr of the first compressed "
        f"step {d['lr_first_compressed']:.3e})",
        "",
        "By the character's count in the training text (medians over the rows of each bin):",
        "",
        "| count | rows | sqrt(v) at freeze | rms m at freeze | rms m after first compressed "
        "| rms step, first compressed | largest row step |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in d["token_rows_by_count"]:
        lines.append(
            f"| {b['count']} | {b['rows']} | {b['sqrt_v_median']:.2e} "
            f"| {b['m_rms_at_freeze_median']:.2e} | {b['m_hat_rms_median']:.2e} "
            f"| {b['step_rms_first_compressed_median']:.2e} "
            f"| {b['step_rms_first_compressed_max']:.2e} |"
        )
    lines += [
        "",
        f"Spearman rank correlation of count against row step size: "
        f"{d['spearman_count_vs_step']:.3f} (negative: rarer, larger step).",
        "",
        "The 12 rows with the largest step at the first compressed step, and the 3 smallest:",
        "",
        "| char | count | sqrt(v) min | sqrt(v) median | rms m at freeze | rms m after "
        "| rms step | largest rms step, next 10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["token_rows"][:12] + d["token_rows"][-3:]:
        lines.append(
            f"| {r['char']!r} | {r['count']:,} | {r['sqrt_v_min']:.2e} | {r['sqrt_v_median']:.2e} "
            f"| {r['m_rms_at_freeze']:.2e} | {r['m_rms_after_first_compressed']:.2e} "
            f"| {r['step_rms_first_compressed']:.2e} | {r['step_rms_max_next_10']:.2e} |"
        )
    setup = result["setup"]
    masked = ", ".join(f"{r['char']!r} ({r['count']})" for r in result["masked_rows"])
    lines += [
        "",
        "## Remedies",
        "",
        f"mask: token-embedding rows of characters with count < {setup['rare_count']} "
        f"({len(result['masked_rows'])} rows: {masked}). late_freeze: freeze at "
        f"{setup['late_freeze']:.0%} of {result['recipe']['steps']:,} (step "
        f"{round(setup['late_freeze'] * result['recipe']['steps']):,}). large_eps: eps = "
        f"{setup['large_eps']:g} (the recipe's: {result['recipe']['eps']:g}).",
        "",
        "| remedy | seed | steps | finite | final 100-step train loss | last val loss (step) "
        "| max abs param | untreated: last finite block | study seed 1 (untreated) val at end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, x in s.items():
        kind, seed = key.split("/")
        if kind in ("ours", "reference"):
            continue
        val = result["val"][key]
        end = val["step"][-1]
        block = s.get(f"ours/{seed}", {}).get("last_finite_block")
        last = f"{block['steps']} ({block['mean_loss']:.4f})" if block else "-"
        lines.append(
            f"| {kind} | {seed} | {x['steps']:,} | {'yes' if x['all_finite'] else 'no'} "
            f"| {_fmt(x['final_block_mean_loss'])} | {_fmt(val['loss'][-1])} ({end:,}) "
            f"| {x['max_abs_param']:.3g} "
            f"| {last} "
            f"| {_fmt(_val_at(result['study_seed1_untreated_val'], end))} |"
        )
    lines += ["", "Seconds per run: " + json.dumps(result["seconds"])]
    return "\n".join(lines) + "\n"


def _leaves(names: list[str], total: int) -> str:
    if not names:
        return "-"
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} of {total} leaves"


def main(argv: list[str] | None = None) -> None:
    from benchmarks.support import common

    parser = common.argument_parser("benchmarks.onebit_divergence", __doc__)
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=ROOT / "results",
        help=f"the directory for {STEM}.json and .md (default: results/)",
    )
    parser.add_argument("--resume", action="store_true", help="run only what is missing")
    parser.add_argument("--quick", action="store_true", help="a smoke test (tiny model)")
    parser.add_argument(
        "--report", action="store_true", help="rewrite the .md from the saved .json (no runs)"
    )
    parser.add_argument(
        "--remedies",
        default=",".join(REMEDIES),
        help=f"comma-separated, of {','.join(REMEDIES)} ('': parts 1 and 2 only)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.remedies.split(",")) - {"", *REMEDIES})
    if unknown:
        parser.error(f"--remedies: no remedy {', '.join(unknown)} (of {', '.join(REMEDIES)})")
    if args.report:
        text = markdown(json.loads((args.out / f"{STEM}.json").read_text()))
        (args.out / f"{STEM}.md").write_text(text)
        print(text)
        return
    remedies = tuple(r for r in args.remedies.split(",") if r)
    result = run(QUICK if args.quick else Setup(), args.out, args.resume, remedies)
    text = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{STEM}.md").write_text(text)
    if remedies == REMEDIES:  # the whole study: it is done
        (args.out / f"{STEM}.partial.json").unlink(missing_ok=True)
    print(text)


if __name__ == "__main__":
    main()
