"""1-bit Adam's divergence after its freeze, and the momentum mask that prevents it.

``benchmarks/onebit_divergence.py`` (``docs/benchmarks/onebit_divergence.md``) found why 1-bit
Adam diverged in the 10,000-step study: the char-level GPT ties its output to its token
embedding, so the row of a character that (almost) never occurs gets only the softmax's push-down,
which shrinks as its probability does; its frozen ``sqrt(v)`` is tiny (1e-7 for '°'). After the
freeze each element moves by its compressed momentum (a sign times a scale shared by its whole
chunk of the leaf) over that frozen ``sqrt(v)``, so the rare row jumps (72 per element on the
first compressed step) and the model follows. Zeroing those rows' momentum (``mask``, DeepSpeed's
``exp_avg_mask``) kept every run finite.

That run takes minutes; this is the same mechanism in seconds: a tied-embedding softmax model
on 8 vmapped workers whose last token never occurs, trained by ``ozo.onebit_adam`` with the
study's Adam constants. Without the mask the rare row and the loss blow up after the freeze;
with the rare row masked the loss stays where it was.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_zero_one as ozo
from benchmarks import onebit_divergence as obd
from optax_zero_one.core.frozen_variance import FrozenVarianceAdamState

N, VOCAB, DIM = 8, 16, 8
COMMON = VOCAB - 1  # token VOCAB - 1 is never an input nor a target
FREEZE, STEPS, LR = 2000, 2300, 1e-2


def loss(params, batch):
    x, y = batch[..., 0], batch[..., 1]
    h = jnp.tanh(params["emb"][x] @ params["w"])
    logits = h @ params["emb"].T  # tied output: every row gets a gradient through the softmax
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data():
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.normal(0, 0.5, (VOCAB, DIM)), jnp.float32),
        "w": jnp.asarray(rng.normal(0, 0.5, (DIM, DIM)), jnp.float32),
    }
    x = rng.integers(0, COMMON, (STEPS, N, 16))
    y = (x + rng.integers(1, 4, x.shape)) % COMMON  # noisy: the common rows keep a gradient
    return params, jnp.asarray(np.stack([x, y], -1), jnp.int32)


def train(mask):
    """Per-step mean loss and the rare row's max |x|, and the state after the freeze step."""
    tx = ozo.onebit_adam(LR, b1=0.9, b2=0.95, freeze_step=FREEZE, axis_name="w", mask=mask)

    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    @jax.jit
    def scan(p, s, batches):
        def body(carry, batch):
            p, s, value = jax.vmap(step, axis_name="w")(*carry, batch)
            return (p, s), (value.mean(), jnp.max(jnp.abs(p["emb"][0, VOCAB - 1])))

        return jax.lax.scan(body, (p, s), batches)

    params, batches = data()
    p = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params)
    s = jax.vmap(tx.init, axis_name="w")(p)
    (p, s), first = scan(p, s, batches[:FREEZE])
    frozen = s
    _, rest = scan(p, s, batches[FREEZE:])
    losses, rare = (np.concatenate([np.asarray(a), np.asarray(b)]) for a, b in zip(first, rest))
    return losses, rare, frozen


def frozen_sqrt_v(state):
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FrozenVarianceAdamState))
    fv = next(x for x in found if isinstance(x, FrozenVarianceAdamState))
    return np.sqrt(np.asarray(fv.nu.to_tree()["emb"][0]))


def test_onebit_adam_blows_up_on_a_rare_tied_row_and_the_momentum_mask_prevents_it():
    mask = {"emb": np.ones((VOCAB, DIM), np.float32), "w": np.ones((DIM, DIM), np.float32)}
    mask["emb"][VOCAB - 1] = 0.0

    losses, rare, frozen = train(None)
    at_freeze = losses[FREEZE - 100 : FREEZE].mean()
    # the mechanism: the rare row's frozen sqrt(v) is tiny against the common rows'
    sqrt_v = frozen_sqrt_v(frozen)
    assert np.median(sqrt_v[VOCAB - 1]) < 1e-2 * np.median(sqrt_v[:COMMON])
    # without a remedy the rare row and then the loss blow up after the freeze
    after = losses[FREEZE:]
    assert not np.isfinite(after).all() or np.max(after) > 100 * at_freeze
    assert not np.isfinite(rare).all() or np.max(rare) > 100 * rare[FREEZE - 1]

    masked_losses, masked_rare, _ = train(mask)
    np.testing.assert_allclose(masked_losses[:FREEZE], losses[:FREEZE], rtol=1e-5)  # acts after
    assert np.isfinite(masked_losses).all() and np.isfinite(masked_rare).all()
    assert np.max(masked_losses[FREEZE:]) < 1.5 * at_freeze
    # a masked row no longer moves (its momentum is 0, and there is no weight decay here)
    np.testing.assert_array_equal(masked_rare[FREEZE:], masked_rare[FREEZE - 1])


def test_rare_token_mask_zeroes_the_token_rows_of_rare_characters():
    """The benchmarks' mask on the study's workload: 0 exactly on the token-embedding rows of
    characters with fewer than ``RARE_COUNT`` occurrences in the workers' training text, counted
    here independently from the batches' source text."""
    pytest.importorskip("flax")
    from benchmarks.support import training, workloads

    cfg = obd.base_config(0, 2e-3)
    workload = training.make_workload(cfg)
    params = workload.init_params(0)
    text = workloads.corpus()
    train = text[: int(0.9 * len(text))]
    train = train[: len(train) // training.NUM_WORKERS * training.NUM_WORKERS]
    vocab = sorted(set(text))
    counts = np.asarray([train.count(c) for c in vocab])
    assert list(workload.vocab) == vocab
    np.testing.assert_array_equal(workload.token_counts, counts)
    mask = workloads.rare_token_mask(workload, obd.RARE_COUNT)
    tokens = mask["tokens"]["embedding"]
    assert tokens.shape == (len(vocab), params["tokens"]["embedding"].shape[1])
    np.testing.assert_array_equal(tokens[:, 0] == 0, counts < obd.RARE_COUNT)
    assert (tokens == tokens[:, :1]).all()  # whole rows
    others = [m for p, m in jax.tree_util.tree_leaves_with_path(mask) if "tokens" not in str(p)]
    assert all((m == 1).all() for m in others)
    assert vocab[int(np.argmin(counts))] == "°" and counts.min() == 1
