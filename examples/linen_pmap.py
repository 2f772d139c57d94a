"""0/1 Adam in the classic Flax Linen ``TrainState`` + ``jax.pmap`` data-parallel loop.

    python examples/linen_pmap.py [--steps 300]

Exactly what changes from the usual loop that averages the gradients with ``pmean``::

    -   tx = optax.adamw(learning_rate, weight_decay=1e-4)
    +   tx = ozo.zero_one_adam(learning_rate, weight_decay=1e-4, axis_name=AXIS,
    +                          num_workers=num_devices, var_freeze_step=..., ...)
        state = flax.jax_utils.replicate(TrainState.create(apply_fn=..., params=..., tx=tx))

    -   @partial(jax.pmap, axis_name=AXIS)
    -   def train_step(state, x, y):
    +   def worker_step(state, x, y, step_kind=None):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, ...)
    -       grads = jax.lax.pmean(grads, AXIS)
    -       state = state.apply_gradients(grads=grads)
    +       state = apply_gradients(state, grads, step_kind)
    +
    +   train_step = ozo.dispatch_by_kind(  # one pmap program per step kind
    +       lambda kind: jax.pmap(partial(worker_step, step_kind=kind), AXIS),
    +       ozo.zero_one_schedule(var_freeze_step=..., ...), state_index=0)

    -   params = flax.jax_utils.unreplicate(state).params
    +   params = ozo.synchronized_params(*ozo.unreplicate((state.params, state.opt_state)))

- The optimizer gets each device's *local* gradients and averages them itself (full precision on
  variance steps, 1-bit on compressed and sync steps, not at all on local steps).
- ``num_workers`` is needed because ``TrainState.create`` runs ``tx.init`` outside ``pmap``.
- Which kind a step is follows from its number and the schedule alone. ``step_kind`` passed on to
  ``tx.update`` compiles a program for one kind; ``ozo.dispatch_by_kind`` compiles one per kind,
  at its first use, and runs each step's (chosen on the host), so no program branches on it.
  ``TrainState.apply_gradients`` passes no keyword arguments to ``tx.update``, hence the
  three-line ``apply_gradients`` below.
- During local steps the devices' parameters differ; ``synchronized_params`` gives where they
  all were at the last sync (identical on every device): evaluate and checkpoint that.

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

import flax.jax_utils  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import optax_zero_one as ozo  # noqa: E402

AXIS = "devices"
DIM, CLASSES, BATCH_PER_DEVICE = 32, 10, 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(CLASSES)(x)


def teacher_task(seed=0):
    """Labels from a fixed random network: a task with unlimited fresh data."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((DIM, 64)) / np.sqrt(DIM)
    w2 = rng.standard_normal((64, CLASSES))

    def sample(rng, *shape):
        x = rng.standard_normal((*shape, DIM)).astype(np.float32)
        return x, (np.tanh(x @ w1) @ w2).argmax(-1).astype(np.int32)

    return sample


def apply_gradients(state, grads, step_kind):
    """``TrainState.apply_gradients``, with the step kind passed on to ``tx.update``."""
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, step_kind=step_kind)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def bytes_per_step_kind(replicated_params, devices):
    """Bytes one device sends per step of each kind, read from compiled programs."""
    replicated_params = jax.tree.map(  # shapes only: comm_stats compiles, nothing runs
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), replicated_params
    )
    onebit = ozo.onebit_mean(AXIS)
    dense = jax.pmap(lambda g: ozo.float_mean(g, AXIS), AXIS, devices=devices)  # = pmean(grads)
    compressed = jax.pmap(lambda g: onebit.update(g, onebit.init(g))[0], AXIS, devices=devices)
    dense_bytes = ozo.comm_stats(dense, replicated_params).sent_bytes_per_device
    compressed_bytes = ozo.comm_stats(compressed, replicated_params).sent_bytes_per_device
    return {"variance": dense_bytes, "compressed": compressed_bytes, "sync": compressed_bytes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    devices = jax.local_devices()
    if len(devices) == 1:
        devices = jax.local_devices(backend="cpu")  # the simulated CPU devices
    num_devices = len(devices)

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
    tx = ozo.zero_one_adam(
        learning_rate,
        b2=0.99,
        weight_decay=1e-4,
        axis_name=AXIS,
        num_workers=num_devices,
        **schedule,
    )

    model = MLP()
    params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, DIM), np.float32))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = flax.jax_utils.replicate(state, devices)  # one copy per device
    per_kind = bytes_per_step_kind(state.params, devices)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def worker_step(state, x, y, step_kind=None):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
        # The usual loop averages here: grads = jax.lax.pmean(grads, AXIS). Not with 0/1 Adam.
        state = apply_gradients(state, grads, step_kind)
        return state, jax.lax.pmean(loss, AXIS)

    def compile_kind(kind):  # the program for one kind of step
        one_kind = functools.partial(worker_step, step_kind=kind)
        return jax.pmap(one_kind, AXIS, devices=devices, donate_argnums=0)

    step_schedule = ozo.zero_one_schedule(**schedule)  # every step's kind, known on the host
    train_step = ozo.dispatch_by_kind(compile_kind, step_schedule, state_index=0)
    eval_loss = jax.jit(loss_fn)

    def synchronized(state):
        """The parameters at the last sync (the same on every device): evaluate or save these."""
        params, opt_state = ozo.unreplicate((state.params, state.opt_state))  # device 0's copy
        return ozo.synchronized_params(params, opt_state)

    sample = teacher_task()
    rng = np.random.default_rng(1)
    x_eval, y_eval = sample(np.random.default_rng(2), 4096)
    kinds = np.asarray(step_schedule.names)[step_schedule.indices(steps)]  # each step's kind
    print(f"{num_devices} devices ({devices[0].platform}), {steps} steps, schedule {schedule}")
    first_eval = float(eval_loss(synchronized(state), x_eval, y_eval))
    print(f"step    0  eval loss {first_eval:.4f}")
    for k in range(1, steps + 1):
        x, y = sample(rng, num_devices, BATCH_PER_DEVICE)  # leading axis: one batch per device
        state, loss = train_step(state, x, y)
        jax.block_until_ready(loss)  # pace the loop (simulated devices can deadlock otherwise)
        if k % max(1, steps // 10) == 0 or k == steps:
            evaluated = float(eval_loss(synchronized(state), x_eval, y_eval))
            print(
                f"step {k:4d}  {kinds[k - 1]:<10}  train loss {float(loss[0]):.4f}  "
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
