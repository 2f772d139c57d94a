"""0/1 Adam in a ``jax.jit`` training loop on a ("data", "model") mesh, with ``ozo.data_parallel``.

    python examples/jit_sharded.py [--steps 200] [--mesh 4x2]

A small character-level transformer (Flax NNX) whose weights are sharded over the ``model``
axis, as a jit user shards them (``nnx.with_partitioning``); 0/1 Adam runs over the ``data``
axis. What changes against a usual jit loop:

1. ``dp = ozo.data_parallel(mesh, params)`` reads how each weight is sharded;
   ``tx = dp.optimizer(ozo.zero_one_adam(..., axis_name="data"))`` runs the optimizer on each
   device's own shard of the weights.
2. The step is written for one data worker: *local* gradients, no ``pmean``; it passes a
   ``step_kind`` on to ``tx.update``. ``dp.jit(step, schedule=...)`` compiles it over the worker
   layout, one program per step kind, and runs each step's (every data worker keeps its own
   copy of the params; the model axis is left to XLA as usual). It takes the global batch.
3. ``dp.to_workers(params)`` makes the copies; ``dp.synchronized_params`` gives back the
   params at the last sync, sharded as before, to evaluate or save.

On one device (a laptop, Colab's CPU) it runs on 8 simulated CPU devices.
"""

import os

# Before JAX starts: simulated CPU devices (used only if there is a single device), and
# PJRT_NPROC >= 2x their number against a rendezvous deadlock of simulated devices on few cores.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("PJRT_NPROC", "16")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

DIM, HEADS, LAYERS, CONTEXT, BATCH = 64, 4, 2, 64, 32  # BATCH: global, split over data workers


def sharded(init, *axes):
    return nnx.with_partitioning(init, axes)


class Block(nnx.Module):
    """Pre-norm attention and MLP; in-projections column-sharded, out-projections row-sharded
    over ``model`` (Megatron-style: one all-reduce of activations per sub-block)."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.02)
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        col = dict(use_bias=False, kernel_init=sharded(init, None, "model"), rngs=rngs)
        row = dict(use_bias=False, kernel_init=sharded(init, "model", None), rngs=rngs)
        self.qkv, self.proj = nnx.Linear(DIM, 3 * DIM, **col), nnx.Linear(DIM, DIM, **row)
        self.up, self.down = nnx.Linear(DIM, 4 * DIM, **col), nnx.Linear(4 * DIM, DIM, **row)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3, HEADS, -1), 3, axis=2)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = nnx.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], mask=mask)
        x = x + self.proj(att.reshape(b, t, DIM))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab, rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, DIM, embedding_init=init, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CONTEXT, DIM)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids) + self.pos[...][: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))  # tied output embedding


def text_data():
    """The Python language reference (ships with Python): 90% train, 10% held out."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    vocab = sorted(set(text))
    ids = np.asarray([vocab.index(c) for c in text[:200_000]], np.int32)  # enough for a demo
    cut = int(0.9 * len(ids))
    return len(vocab), ids[:cut], ids[cut:]


def windows(ids, rng, count):
    starts = rng.integers(0, len(ids) - CONTEXT - 1, count)
    return np.stack([ids[s : s + CONTEXT + 1] for s in starts])


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def data_bytes(dp, step, step_schedule, taken, args):
    """Bytes one device sends over the data axis in a step of each kind taken (local steps send
    nothing): the whole step compiled for that kind alone, read with ``ozo.comm_stats``."""
    out = {}
    for kind in step_schedule.kinds:
        if kind.name == "local":
            continue
        out[kind.name] = 0.0
        if kind.name in taken:
            program = dp.jit(functools.partial(step, step_kind=kind), donate=False)
            stats = ozo.comm_stats(program, *args)
            out[kind.name] = stats.sent_bytes_by_axes(dp.mesh).get(dp.data_axes, 0.0)
    return out


def device_bytes(tree):
    """Bytes of ``tree`` held on the first device."""
    first = jax.devices()[0]
    return sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
        if s.device == first
    )  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mesh", default="4x2", help="data x model, e.g. 4x2 or 4x1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the loss curve here")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    n_data, n_model = (int(v) for v in args.mesh.split("x"))
    devices = jax.devices() if len(jax.devices()) > 1 else jax.devices("cpu")
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh(
        (n_data, n_model), ("data", "model"), axis_types=auto, devices=devices[: n_data * n_model]
    )
    vocab, train_ids, val_ids = text_data()

    # Build the model sharded over the mesh, as a jit user does.
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(GPT(vocab, nnx.Rngs(args.seed)), nnx.Param)
        specs = nnx.get_partition_spec(params)
        params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)

    steps = args.steps
    warmup = max(steps // 3, min(steps - 1, 30))
    schedule = dict(
        var_freeze_step=warmup,
        var_update_scaler=8,
        local_step_scaler=max(1, steps // 10),
        local_step_clipper=8,
    )
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, steps, 3e-4)

    dp = ozo.data_parallel(mesh, params, data_axis="data")
    tx = dp.optimizer(ozo.zero_one_adam(lr, b2=0.99, axis_name="data", **schedule))

    # One data worker's step (its params, state and batch share; local grads to the optimizer).
    # dp.jit gives it a step_kind, passed on to tx.update: each program holds one kind of step.
    def step(params, opt_state, batch, step_kind=None):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
        return optax.apply_updates(params, updates), opt_state, loss

    params_w = dp.to_workers(params)
    opt_state = dp.init(tx, params_w)
    step_schedule = ozo.zero_one_schedule(**schedule)  # every step's kind, known on the host
    train_step = dp.jit(step, schedule=step_schedule)  # one program per kind, run step by step
    eval_loss = jax.jit(lambda p, b: loss_fn(nnx.merge(graphdef, p), b))

    numel = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{n_data} data x {n_model} model devices, {numel:,} parameters, {steps} steps; "
        f"per device: params {device_bytes(params_w):,} B, optimizer state "
        f"{device_bytes(opt_state):,} B (params replicated: {4 * numel:,} B)"
    )
    # optional: every kind's program compiled now, several at once, rather than phase B's at
    # the variance freeze, mid-run (any batch of the run's shape will do)
    began = time.perf_counter()
    compiled = train_step.precompile(
        params_w, opt_state, windows(train_ids, np.random.default_rng(0), BATCH)
    )
    print(f"precompiled {', '.join(compiled)} in {time.perf_counter() - began:.1f} s")
    rng, val = np.random.default_rng(args.seed + 1), windows(val_ids, np.random.default_rng(7), 256)
    evaluated = float(eval_loss(dp.synchronized_params(params_w, opt_state), val))
    print(f"step    0  eval loss {evaluated:.4f}")
    curve = []
    for k in range(1, steps + 1):
        batch = windows(train_ids, rng, BATCH)
        params_w, opt_state, loss = train_step(params_w, opt_state, batch)
        loss = float(np.mean(jax.block_until_ready(loss)))  # pace the loop (see docs/testing.md)
        curve.append(loss)
        if k % max(1, steps // 10) == 0 or k == steps:
            evaluated = float(eval_loss(dp.synchronized_params(params_w, opt_state), val))
            print(f"step {k:4d}  train loss {loss:.4f}  eval loss {evaluated:.4f}")
    train_step.settle()  # a step refused in the last few is reported here (docs/reliability.md)

    taken = np.asarray(step_schedule.names)[step_schedule.indices(steps)]  # each step's kind
    per_kind = data_bytes(dp, step, step_schedule, set(taken), (params_w, opt_state, batch))
    sent = sum(per_kind[name] * np.sum(taken == name) for name in per_kind)
    local_numel = device_bytes(params) // 4
    pmean = steps * 2 * 4 * local_numel * (n_data - 1) / n_data  # float32 ring all-reduce
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mesh": args.mesh, "train_loss": curve, "eval_loss": evaluated}, f)
    print(
        "bytes per step over the data axis: "
        + ", ".join(f"{name} {b:,.0f}" for name, b in per_kind.items())
        + f"; a pmean {pmean / steps:,.0f} ({time.perf_counter() - start:.0f} s)"
    )
    print(
        f"final eval loss {evaluated:.4f} after {steps} steps, bytes sent per data worker "
        f"{sent:,.0f} (pmean every step would send {pmean:,.0f})"
    )
    return evaluated, sent, pmean


if __name__ == "__main__":
    main()
