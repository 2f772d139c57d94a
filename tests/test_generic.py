"""Behaviours every public optimizer must have (single worker), declared by capability."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_zero_one as ozo

# Each factory: (learning_rate, **structural) -> transformation. Phases are kept short so the
# runs go through compression/freeze/local steps (which are the identity with one worker).
OPTIMIZERS = {
    "zero_one_adam": lambda lr, **kw: ozo.zero_one_adam(
        lr,
        var_freeze_step=50,
        var_update_scaler=4,
        local_step_scaler=20,
        local_step_clipper=4,
        **kw,
    ),
    "onebit_adam": lambda lr, **kw: ozo.onebit_adam(lr, freeze_step=50, **kw),
}
STATIC = {
    "zero_one_adam": (
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "axis_name",
        "num_workers",
        "mask",
    ),
    "onebit_adam": ("freeze_step", "axis_name", "num_workers", "mask"),
}
ALIASES = {"zero_one_adam": ozo.zero_one_adam, "onebit_adam": ozo.onebit_adam}


def minimise(tx, loss, x0, steps):
    x = jnp.asarray(x0, jnp.float32)
    state = tx.init(x)

    @jax.jit
    def step(x, state):
        g = jax.grad(loss)(x)
        u, state = tx.update(g, state, x)
        return optax.apply_updates(x, u), state

    for _ in range(steps):
        x, state = step(x, state)
    return x


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parabola(name):
    x = minimise(OPTIMIZERS[name](0.05), lambda x: jnp.sum((x - 3.0) ** 2), jnp.zeros(5), 400)
    np.testing.assert_allclose(x, 3.0, atol=0.05)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_rosenbrock(name):
    def rosenbrock(x):
        return (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2

    # the variance freezes after 50 steps, so the curved valley takes a while
    sched = optax.cosine_decay_schedule(0.02, 8000, alpha=0.05)
    x = minimise(OPTIMIZERS[name](sched), rosenbrock, jnp.array([-1.0, 1.5]), 8000)
    assert float(rosenbrock(x)) < 1e-3, x


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_no_recompilation_on_second_update(name):
    """The state that update returns has the types init gave it: jit traces update once."""
    tx = OPTIMIZERS[name](0.1)
    params = {"a": jnp.ones((3, 2)), "b": jnp.zeros(4)}
    state = tx.init(params)
    traces = []

    def counted(updates, state, params):
        traces.append(1)  # runs at trace time only
        return tx.update(updates, state, params)

    update = jax.jit(counted)
    for _ in range(3):
        updates, state = update(params, state, params)
    assert len(traces) == 1
    fresh = tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(fresh)
    dtypes = lambda tree: [jnp.result_type(x) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert dtypes(state) == dtypes(fresh)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_schedule_is_evaluated_at_the_count_before_the_update(name):
    seen = []

    def schedule(count):
        jax.debug.callback(lambda c: seen.append(int(c)), count)
        return 0.1 / (1 + count)

    tx = OPTIMIZERS[name](schedule)
    x = jnp.ones(3)
    state = tx.init(x)
    for k in range(3):
        seen.clear()
        _, state = tx.update(jnp.ones(3), state, x)
        assert seen and set(seen) == {k}  # (0/1 Adam also sums the rates of an interval)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_inject_hyperparams(name):
    injected = optax.inject_hyperparams(ALIASES[name], static_args=STATIC[name])(
        learning_rate=0.1, b1=0.8
    )
    plain = ALIASES[name](0.1, b1=0.8)
    x = jnp.linspace(-1, 1, 6)
    s1, s2 = injected.init(x), plain.init(x)
    for k in range(5):
        g = jnp.sin(x + k)
        u1, s1 = injected.update(g, s1, x)
        u2, s2 = plain.update(g, s2, x)
        np.testing.assert_allclose(u1, u2, rtol=2e-5)  # b1 as f32 array vs Python float
    s1.hyperparams["learning_rate"] = jnp.asarray(0.0)
    u1, _ = injected.update(g, s1, x)
    assert float(jnp.abs(u1).max()) == 0.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dtypes_preserved(name, dtype):
    tx = OPTIMIZERS[name](0.1, weight_decay=0.01)
    params = {"w": jnp.ones((4, 3), dtype), "b": jnp.zeros((3,), dtype)}
    state = tx.init(params)
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32  # buffers stay float32
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    new = optax.apply_updates(params, updates)
    assert all(p.dtype == dtype for p in jax.tree.leaves(new))
    assert all(bool(jnp.all(p < 1)) for p in jax.tree.leaves(new["w"]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(b1=1.0), "b1"),
        (dict(b1=-0.1), "b1"),
        (dict(b2=1.5), "b2"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(var_freeze_step=-5), "var_freeze_step"),
        (dict(var_update_scaler=0), "var_update_scaler"),
        (dict(local_step_scaler=0), "local_step_scaler"),
        (dict(local_step_clipper=0), "local_step_clipper"),
        (dict(var_freeze_step=2.5), "var_freeze_step"),
        (dict(axis_name=3), "axis_name"),
    ],
)
def test_zero_one_adam_rejects_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ozo.zero_one_adam(0.1, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(freeze_step=-1), "freeze_step"),
        (dict(b2=1.0), "b2"),
        (dict(learning_rate=-1.0), "learning_rate"),
        (dict(learning_rate="fast"), "learning_rate"),
    ],
)
def test_onebit_adam_rejects_nonsense(kwargs, match):
    kwargs = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ozo.onebit_adam(**kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_mask_must_match_params(name):
    params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="mask"):
        OPTIMIZERS[name](0.1, mask={"a": 1.0}).init(params)
    with pytest.raises(ValueError, match="mask leaf"):
        OPTIMIZERS[name](0.1, mask={"a": jnp.ones(4), "b": 1.0}).init(params)
    with pytest.raises(ValueError, match="only 0 and 1"):
        OPTIMIZERS[name](0.1, mask={"a": 0.5, "b": 1.0}).init(params)
    OPTIMIZERS[name](0.1, mask={"a": True, "b": jnp.zeros((2, 2))}).init(params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_unbound_axis_at_update_is_a_clear_error(name):
    tx = OPTIMIZERS[name](0.1, axis_name="data", num_workers=2)
    params = jnp.ones(3)
    state = tx.init(params)
    with pytest.raises(ValueError, match="axis_name='data' is not bound"):
        tx.update(params, state, params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrong_tree_at_update_is_a_clear_error(name):
    tx = OPTIMIZERS[name](0.1)
    state = tx.init({"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="tree structure"):
        tx.update({"b": jnp.ones(3)}, state, {"b": jnp.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        tx.update({"a": jnp.ones(4)}, state, {"a": jnp.ones(4)})
