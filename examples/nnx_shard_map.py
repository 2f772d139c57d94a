"""0/1 Adam in a Flax NNX training loop, data-parallel with ``jax.shard_map`` over all devices.

    python examples/nnx_shard_map.py [--steps 300]

What differs from a usual data-parallel NNX loop:

1. The optimizer is ``ozo.zero_one_adam(..., axis_name=AXIS)`` and is given each worker's
   *local* gradients: no ``pmean`` of your own; it averages them itself (full precision on
   variance steps, 1-bit on compressed and sync steps, not at all on local steps).
2. Every worker keeps its own copy of the params and optimizer state (during local steps the
   copies differ): the *worker layout*, a leading worker axis sharded with ``P(AXIS)``.
   ``ozo.on_workers`` runs one worker's function under ``jax.shard_map``: each device sees a
   block of size 1, dropped before the function runs and restored after.
3. Which kind a step is follows from its number and the schedule alone: the step passes
   ``step_kind`` on to ``tx.update``, and ``ozo.dispatch_by_kind`` compiles one program per
   kind (at its first use) and runs each step's, chosen on the host.
4. To evaluate or export, take ``ozo.synchronized_params``: where all workers were at the last
   sync, the same on every worker.

The model is split into its graph and its params (``nnx.split``) and the optimizer state is
optax's own, so that the host can read the step counter in it; ``nnx.Optimizer`` works too
with a single program that decides each step's kind in the graph
(``docs/jit.md``, "Flax NNX").

With one device (e.g. a laptop CPU or a single GPU) it runs on 8 simulated CPU devices.
"""

import os

# Before JAX starts: simulated CPU devices (used only if there is a single device), and
# PJRT_NPROC >= 2x their number against a rendezvous deadlock of simulated devices on few cores.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("PJRT_NPROC", "16")

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

AXIS = "workers"
DIM, CLASSES, BATCH_PER_WORKER = 32, 10, 64


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(DIM, 256, rngs=rngs)
        self.hidden2 = nnx.Linear(256, 256, rngs=rngs)
        self.out = nnx.Linear(256, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def teacher_task(seed=0):
    """Labels from a fixed random network: a task with unlimited fresh data."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((DIM, 64)) / np.sqrt(DIM)
    w2 = rng.standard_normal((64, CLASSES))

    def sample(rng, *shape):
        x = rng.standard_normal((*shape, DIM)).astype(np.float32)
        return x, (np.tanh(x @ w1) @ w2).argmax(-1).astype(np.int32)

    return sample


def bytes_per_step_kind(params, mesh, num_workers):
    """Bytes one device sends per step of each kind, read from compiled programs."""
    on_mesh = NamedSharding(mesh, P(AXIS))
    grads = jax.tree.map(  # shapes only: comm_stats compiles, nothing is allocated
        lambda p: jax.ShapeDtypeStruct((num_workers, *p.shape), p.dtype, sharding=on_mesh), params
    )
    onebit = ozo.onebit_mean(AXIS)
    dense = ozo.on_workers(lambda g: ozo.float_mean(g, AXIS), mesh)  # = a pmean of the gradients
    compressed = ozo.on_workers(lambda g: onebit.update(g, onebit.init(g))[0], mesh)
    dense_bytes = ozo.comm_stats(dense, grads).sent_bytes_per_device
    compressed_bytes = ozo.comm_stats(compressed, grads).sent_bytes_per_device
    return {"variance": dense_bytes, "compressed": compressed_bytes, "sync": compressed_bytes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    devices = jax.devices()
    if len(devices) == 1:
        devices = jax.devices("cpu")  # the simulated CPU devices
    num_workers = len(devices)
    mesh = jax.make_mesh((num_workers,), (AXIS,), devices=devices)
    on_mesh = NamedSharding(mesh, P(AXIS))

    # The schedule, relative to the run: the variance freezes at the end of the learning-rate
    # warm-up, and the sync interval doubles (up to 8) every tenth of the run after it.
    steps = args.steps
    warmup = max(steps // 3, min(steps - 1, 30))  # >= 30 steps before the freeze
    schedule = dict(
        var_freeze_step=warmup,
        var_update_scaler=8,
        local_step_scaler=max(1, steps // 10),
        local_step_clipper=8,
    )
    learning_rate = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, steps, 3e-4)
    # b2 = 0.99 for a short run: without bias correction v carries a factor 1 - b2**n after n
    # variance steps, so b2's memory (~1 / (1 - b2) steps) must fit the variance steps taken.
    # num_workers because the optimizer state is made here, outside shard_map.
    tx = ozo.zero_one_adam(
        learning_rate,
        b2=0.99,
        weight_decay=1e-4,
        axis_name=AXIS,
        num_workers=num_workers,
        **schedule,
    )

    model = nnx.jit(lambda: MLP(nnx.Rngs(0)))()  # one compiled program, not one per initialiser
    graphdef, params = nnx.split(model)  # the graph, and the state (Params only, for this MLP)
    params = nnx.as_pure(params)  # plain arrays, for optax
    per_kind = bytes_per_step_kind(params, mesh, num_workers)
    to_workers = jax.jit(lambda tree: ozo.replicate(tree, num_workers), out_shardings=on_mesh)
    # the worker layout: one copy per worker, sharded over the mesh
    params, opt_state = to_workers(params), to_workers(jax.jit(tx.init)(params))

    def worker_step(params, opt_state, x, y, step_kind=None):  # one worker's view and batch
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(params)
        # local grads in; the optimizer does the averaging (or not, by the step's kind)
        updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
        return optax.apply_updates(params, updates), opt_state, loss

    def compile_kind(kind):  # the program for one kind of step
        # batched: XLA:CPU then updates the donated params and state in place
        one_kind = ozo.on_workers(
            functools.partial(worker_step, step_kind=kind), mesh, batched=True
        )
        return jax.jit(one_kind, donate_argnums=(0, 1))

    step_schedule = ozo.zero_one_schedule(**schedule)  # every step's kind, known on the host
    # params_index: the params come first, compared across workers after the first syncs
    train_step = ozo.dispatch_by_kind(compile_kind, step_schedule, params_index=0)

    def synchronized_model(params, opt_state):
        """The model at the last sync point (worker 0's copy): what to evaluate or checkpoint."""
        return nnx.merge(graphdef, ozo.synchronized_params(*ozo.unreplicate((params, opt_state))))

    eval_loss = nnx.jit(loss_fn)
    sample = teacher_task()
    rng = np.random.default_rng(1)
    x_eval, y_eval = sample(np.random.default_rng(2), 4096)
    kinds = np.asarray(step_schedule.names)[step_schedule.indices(steps)]  # each step's kind
    print(f"{num_workers} workers on {devices[0].platform}, {steps} steps, schedule {schedule}")
    first_eval = float(eval_loss(synchronized_model(params, opt_state), x_eval, y_eval))
    print(f"step    0  eval loss {first_eval:.4f}")
    for k in range(1, steps + 1):
        x, y = sample(rng, num_workers, BATCH_PER_WORKER)  # one batch per worker
        params, opt_state, losses = train_step(
            params, opt_state, jax.device_put(x, on_mesh), jax.device_put(y, on_mesh)
        )
        jax.block_until_ready(losses)  # pace the loop (simulated devices can deadlock otherwise)
        if k % max(1, steps // 10) == 0 or k == steps:
            evaluated = float(eval_loss(synchronized_model(params, opt_state), x_eval, y_eval))
            print(
                f"step {k:4d}  {kinds[k - 1]:<10}  train loss {np.mean(losses):.4f}  "
                f"eval loss (synchronised params) {evaluated:.4f}"
            )
    train_step.settle()  # a step refused in the last few is reported here (docs/reliability.md)

    taken = {kind: int(np.sum(kinds == kind)) for kind in ("variance", "compressed", "sync")}
    sent = sum(taken[kind] * per_kind[kind] for kind in taken)
    baseline = steps * per_kind["variance"]  # AdamW with a pmean of the gradients every step
    print(
        f"\nbytes sent per device: {sent:,.0f} with 0/1 Adam vs {baseline:,.0f} for a pmean of "
        f"the gradients every step ({baseline / sent:.1f}x less, {baseline - sent:,.0f} saved)"
    )
    for kind in ("variance", "compressed", "sync"):
        print(f"  {kind:<10} {taken[kind]:4d} steps x {per_kind[kind]:>10,.0f} B")
    print(f"  {'local':<10} {int(np.sum(kinds == 'local')):4d} steps x {0:>10,} B")
    print(f"eval loss {first_eval:.4f} -> {evaluated:.4f}; {time.perf_counter() - start:.1f} s")
    return first_eval, evaluated, baseline, sent


if __name__ == "__main__":
    main()
