"""0/1 Adam with N simulated workers on one device, through ``jax.vmap(axis_name=...)``.

    python examples/vmap_simulated_workers.py [--workers 8] [--steps 300]

The research (and Colab) path: study the algorithm without N accelerators. ``vmap`` with an
``axis_name`` binds the worker axis exactly as ``pmap``/``shard_map`` do, so the optimizer's
collectives (float mean, 1-bit compressed mean) run for real, on one device, and the results
match a multi-device run to float rounding.

Each worker gets its own batch and passes its *local* gradient; params and optimizer state carry
a leading worker axis. Each step runs the program compiled for its kind of step
(``ozo.dispatch_by_kind``, the kind chosen on the host from the schedule). The log shows how far
the workers' parameters drift apart during local steps (``spread``) and that
``ozo.synchronized_params`` (where they were at the last sync) is identical on every worker
(``synced spread``, float rounding only).

Bytes are those a run on N devices would send, by the formulas of ``docs/algorithm.md``; for the
compressed and sync steps they equal what ``ozo.comm_stats`` reads from the compiled program on N
devices (see ``examples/nnx_shard_map.py``); a variance step's float all-reduce also carries the
flat layout's padding, which ``comm_stats`` counts (0.07-0.25% more at N = 5 to 8).
"""

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_zero_one as ozo

AXIS = "workers"
DIM, HIDDEN, CLASSES, BATCH_PER_WORKER = 32, 256, 10, 64


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    dense = lambda k, m, n: jax.random.normal(k, (m, n)) * math.sqrt(2.0 / m)
    return {
        "w1": dense(k1, DIM, HIDDEN),
        "b1": jnp.zeros(HIDDEN),
        "w2": dense(k2, HIDDEN, HIDDEN),
        "b2": jnp.zeros(HIDDEN),
        "w3": dense(k3, HIDDEN, CLASSES),
        "b3": jnp.zeros(CLASSES),
    }


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    h = jax.nn.relu(h @ params["w2"] + params["b2"])
    logits = h @ params["w3"] + params["b3"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def teacher_task(seed=0):
    """Labels from a fixed random network: a task with unlimited fresh data."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((DIM, 64)) / np.sqrt(DIM)
    w2 = rng.standard_normal((64, CLASSES))

    def sample(rng, *shape):
        x = rng.standard_normal((*shape, DIM)).astype(np.float32)
        return x, (np.tanh(x @ w1) @ w2).argmax(-1).astype(np.int32)

    return sample


def bytes_per_step_kind(params, n):
    """Bytes one of ``n`` workers sends per step of each kind (``docs/algorithm.md``).

    Float ring all-reduce: ``2 * 4 P (n-1)/n``. 1-bit mean: every leaf padded to a multiple of
    ``8 n`` elements and cut into ``n`` chunks, each rounded up to the layout's block
    (``ozo.core.flat.Layout``: 8 elements for small models); row ``j`` of the worker-major buffer
    (chunk
    ``j`` of every leaf, ``C`` = ``layout.width`` columns) goes to worker ``j``. One all-to-all
    and one all-gather, each sending ``n - 1`` rows of ``C/8`` bytes of signs plus a 4-byte
    scale per leaf.
    """
    leaves = jax.tree.leaves(params)
    numel = sum(leaf.size for leaf in leaves)
    layout = ozo.core.flat.Layout.of(params, n)
    dense = 2 * 4 * numel * (n - 1) / n
    compressed = 2 * (n - 1) * (layout.width / 8 + 4 * len(leaves))
    return {"variance": dense, "compressed": compressed, "sync": compressed}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    n, steps = args.workers, args.steps

    # The schedule, relative to the run: the variance freezes at the end of the learning-rate
    # warm-up, and the sync interval doubles (up to 8) every tenth of the run after it.
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
    tx = ozo.zero_one_adam(learning_rate, b2=0.99, weight_decay=1e-4, axis_name=AXIS, **schedule)

    def worker_step(params, opt_state, x, y, step_kind=None):  # one worker's view
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        # local grads in; step_kind: compile this step for one kind of step alone
        updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
        params = optax.apply_updates(params, updates)
        synced = ozo.synchronized_params(params, opt_state)
        return params, opt_state, jax.lax.pmean(loss, AXIS), synced

    def spread(tree):
        """Largest difference between any worker's copy and worker 0's."""
        return jax.tree.reduce(jnp.maximum, jax.tree.map(lambda a: jnp.abs(a - a[0]).max(), tree))

    def all_workers_step(params, opt_state, x, y, step_kind=None):
        one_kind = functools.partial(worker_step, step_kind=step_kind)
        params, opt_state, loss, synced = jax.vmap(one_kind, axis_name=AXIS)(
            params, opt_state, x, y
        )
        return params, opt_state, loss[0], spread(params), spread(synced), synced

    # one program per step kind (compiled at its first use), each step's chosen on the host;
    # params_index: the params come first, compared across workers after the first syncs
    step_schedule = ozo.zero_one_schedule(**schedule)
    train_step = ozo.dispatch_by_kind(
        lambda kind: jax.jit(functools.partial(all_workers_step, step_kind=kind)),
        step_schedule,
        params_index=0,
    )

    # the worker layout, made in one compiled program: a leading axis of n identical copies
    params = jax.jit(lambda key: ozo.replicate(init_params(key), n))(jax.random.key(0))
    # init inside the mapped context knows the number of workers (no num_workers needed)
    opt_state = jax.jit(jax.vmap(tx.init, axis_name=AXIS))(params)
    eval_loss = jax.jit(loss_fn)
    per_kind = bytes_per_step_kind(ozo.unreplicate(params), n)

    sample = teacher_task()
    rng = np.random.default_rng(1)
    x_eval, y_eval = sample(np.random.default_rng(2), 4096)
    kinds = np.asarray(step_schedule.names)[step_schedule.indices(steps)]  # each step's kind
    print(f"{n} simulated workers on one {jax.devices()[0].platform} device, {steps} steps")
    print(f"schedule {schedule}")
    first_eval = float(eval_loss(ozo.unreplicate(params), x_eval, y_eval))
    print(f"step    0  eval loss {first_eval:.4f}")
    log_every = max(1, steps // 10)
    for k in range(1, steps + 1):
        x, y = sample(rng, n, BATCH_PER_WORKER)  # one batch per worker
        params, opt_state, loss, drift, synced_drift, synced = train_step(params, opt_state, x, y)
        # show a run of phase-B steps in full: local steps drift, a sync brings them together
        detail = steps - 2 * schedule["local_step_clipper"] < k
        if k % log_every == 0 or detail:
            evaluated = float(eval_loss(ozo.unreplicate(synced), x_eval, y_eval))
            print(
                f"step {k:4d}  {kinds[k - 1]:<10}  train loss {float(loss):.4f}  "
                f"eval loss (synchronised) {evaluated:.4f}  spread {float(drift):.1e}  "
                f"synced spread {float(synced_drift):.1e}"
            )
    train_step.settle()  # a step refused in the last few is reported here (docs/reliability.md)

    taken = {kind: int(np.sum(kinds == kind)) for kind in ("variance", "compressed", "sync")}
    sent = sum(taken[kind] * per_kind[kind] for kind in taken)
    baseline = steps * per_kind["variance"]  # AdamW with a pmean of the gradients every step
    print(
        f"\nbytes per worker over {n} devices: {sent:,.0f} with 0/1 Adam vs {baseline:,.0f} for "
        f"a pmean of the gradients every step ({baseline / sent:.1f}x less, "
        f"{baseline - sent:,.0f} saved)"
    )
    for kind in ("variance", "compressed", "sync"):
        print(f"  {kind:<10} {taken[kind]:4d} steps x {per_kind[kind]:>10,.0f} B")
    print(f"  {'local':<10} {int(np.sum(kinds == 'local')):4d} steps x {0:>10,} B")
    print(f"eval loss {first_eval:.4f} -> {evaluated:.4f}; {time.perf_counter() - start:.1f} s")
    return first_eval, evaluated, baseline, sent


if __name__ == "__main__":
    main()
