"""Bad input, case by case: each gets a clear error raised early, or is handled correctly.

One test (or one parameter set) per case of docs/reliability.md, "Bad input". Cases the library does
not handle yet are ``xfail(strict=True)`` with the reason and the fix, so that fixing them turns
the suite red until the mark is removed.
"""

import dataclasses
import pickle
import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from support.mapping import AXIS
from support.reference import CompressedMean

import optax_zero_one as ozo

N = 4
# every step kind within 14 steps: variance 1 2 4 6, compressed 3 5, sync 7 8 10 12, local 9 11 13
SCHEDULE = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
STEPS = 14


def zero_one(**kw):
    return ozo.zero_one_adam(0.1, axis_name=AXIS, **{**SCHEDULE, **kw})


def onebit(**kw):
    return ozo.onebit_adam(0.1, axis_name=AXIS, freeze_step=4, **kw)


def mean(**kw):
    return optax.chain(ozo.onebit_mean(AXIS, **kw), optax.sgd(0.1))


OPTIMIZERS = {"zero_one_adam": zero_one, "onebit_adam": onebit, "onebit_mean+sgd": mean}
ADAMS = {"zero_one_adam": zero_one, "onebit_adam": onebit}
PARAMS = {"a": jnp.ones((3, 2)), "b": jnp.ones((5,))}


def per_worker(fn, *trees, axis_size=N):
    """``fn`` on each of ``N`` workers (jit of vmap), the trees replicated over the workers."""
    mapped = jax.jit(jax.vmap(fn, axis_name=AXIS, axis_size=axis_size))
    return mapped(*(ozo.replicate(t, N) for t in trees))


def update_once(tx, grads, params=PARAMS, update_params=None):
    """One ``init`` + ``update`` per worker; ``update_params`` replaces the params at update."""
    update_params = params if update_params is None else update_params

    def fn(p, g, q):
        return tx.update(g, tx.init(p), q)

    return per_worker(fn, params, grads, update_params)


def train(tx, params, steps=STEPS):
    """``steps`` updates on ``N`` workers (one compiled scan); worker ``i`` sees gradient
    ``(1 + i) (x - 1)``. Returns every step's params and the final state."""

    def fn(x):
        curvature = (1 + lax.axis_index(AXIS)).astype(jnp.float32)

        def step(carry, _):
            x, s = carry
            g = jax.tree.map(lambda p: (curvature * (p.astype(jnp.float32) - 1)).astype(p.dtype), x)
            u, s = tx.update(g, s, x)
            x = optax.apply_updates(x, u)
            return (x, s), x

        (_, s), xs = lax.scan(step, (x, tx.init(x)), None, length=steps)
        return xs, s

    xs, s = jax.jit(jax.vmap(fn, axis_name=AXIS, axis_size=N))(ozo.replicate(params, N))
    return jax.tree.map(lambda a: np.swapaxes(np.asarray(a, np.float32), 0, 1), xs), s


# --- wrong tree structure, shapes and dtypes at update --------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrong_tree_structure_at_update(name):
    with pytest.raises(ValueError, match="structure"):
        update_once(OPTIMIZERS[name](), {"a": PARAMS["a"]}, update_params=PARAMS)


@pytest.mark.parametrize("name", ADAMS)
def test_wrong_leaf_shape_at_update(name):
    grads = {"a": jnp.ones((2, 3)), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match=r"updates leaf \['a'\] has shape \(2, 3\)"):
        update_once(ADAMS[name](), grads)


def test_onebit_mean_leaf_of_other_shape_at_update():
    # onebit_mean's state records the layout of the tree it was made for: any other shape is
    # refused with the leaf named (also one that would pad to the same length)
    big = {"a": jnp.ones((40,)), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match=r"updates leaf \['a'\] has shape \(40,\)"):
        update_once(mean(), big)


@pytest.mark.parametrize("name", ADAMS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, jnp.bool_])
def test_non_float_gradients_at_update(name, dtype):
    grads = {"a": jnp.ones((3, 2), dtype), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match=rf"updates leaf \['a'\] has dtype {jnp.dtype(dtype)}"):
        update_once(ADAMS[name](), grads)


def test_a_bare_array_is_named_root_in_errors():
    # a tree that is one array has an empty key path: the errors said "params leaf  has ..."
    with pytest.raises(ValueError, match=r"params leaf <root> has dtype int32"):
        ozo.zero_one_adam(1e-3, axis_name=AXIS, num_workers=N).init(jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match=r"updates leaf <root> has shape \(6,\)"):
        update_once(ozo.zero_one_adam(1e-3, axis_name=AXIS), jnp.ones(6), params=jnp.zeros(5))


def test_onebit_mean_complex_input_at_update():
    grads = {"a": jnp.ones((3, 2), jnp.complex64), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match="complex64"):
        update_once(ozo.onebit_mean(AXIS), grads)


@pytest.mark.parametrize("name", ADAMS)
def test_params_of_wrong_structure_at_update(name):
    with pytest.raises(ValueError, match="params does not have the tree structure"):
        update_once(ADAMS[name](weight_decay=0.1), PARAMS, update_params={"a": PARAMS["a"]})


@pytest.mark.parametrize("name", ADAMS)
def test_params_of_wrong_shape_at_update(name):
    # (before the check, weight decay broadcast a (1, 2) leaf silently into a wrong update)
    wrong = {"a": jnp.ones((1, 2)), "b": jnp.ones((5,))}
    with pytest.raises(ValueError, match=r"params leaf \['a'\] has shape \(1, 2\)"):
        update_once(ADAMS[name](weight_decay=0.1), PARAMS, update_params=wrong)


def test_state_of_another_optimizer_at_update():
    def fn(p):
        return zero_one().update(p, onebit().init(p), p)

    with pytest.raises(ValueError, match="needs a LocalStepSyncState.*got SkipNotFiniteState"):
        per_worker(fn, PARAMS)


@pytest.mark.parametrize("name", ADAMS)
def test_weight_decay_without_params(name):
    def fn(p):
        tx = ADAMS[name](weight_decay=0.1)
        return tx.update(p, tx.init(p))

    with pytest.raises(ValueError, match="params"):
        per_worker(fn, PARAMS)


def test_zero_one_adam_without_params():
    """A sync sends x's distance to the last synchronised point, so 0/1 Adam needs x always."""

    def fn(p):
        tx = ozo.zero_one_adam(0.1, axis_name=AXIS)
        return tx.update(p, tx.init(p))

    with pytest.raises(ValueError, match=r"needs the params: update\(grads, state, params\)"):
        per_worker(fn, PARAMS)


# --- params that cannot be optimised ---------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64])
def test_non_float_params_at_init(name, dtype):
    params = {"a": jnp.ones((3, 2)), "i": jnp.ones((4,), dtype)}
    with pytest.raises(ValueError, match=rf"leaf \['i'\] has dtype {jnp.dtype(dtype)}") as err:
        per_worker(OPTIMIZERS[name]().init, params)
    # the way out it names must be one the docs allow: optax.masked parts the workers (a
    # trial followed the old advice with a complex leaf: its copies 4.1e7 and 1.5e7 apart)
    assert "optax.set_to_zero()" in str(err.value) and "Not optax.masked" in str(err.value)


# --- masks -----------------------------------------------------------------------------------

BAD_MASKS = {
    "structure": ({"a": 1.0}, "structure of the params"),
    "list for a dict": ([1.0, 1.0], "structure of the params"),
    "leaf shape": ({"a": np.ones(3), "b": 1.0}, r"mask leaf \['a'\] has shape \(3,\)"),
    "worker layout": ({"a": np.ones((N, 3, 2)), "b": 1.0}, r"has shape \(4, 3, 2\)"),
    "value 0.5": ({"a": 0.5, "b": 1.0}, "only 0 and 1"),
    "value nan": ({"a": np.nan, "b": 1.0}, "only 0 and 1"),
    "value -1": ({"a": 1.0, "b": -np.ones(5)}, "only 0 and 1"),
}


@pytest.mark.parametrize("name", ADAMS)
@pytest.mark.parametrize("case", BAD_MASKS)
def test_mismatched_mask_at_init(name, case):
    mask, match = BAD_MASKS[case]
    with pytest.raises(ValueError, match=match):
        per_worker(ADAMS[name](mask=mask).init, PARAMS)


def test_boolean_mask_is_the_same_as_a_float_one():
    start = jax.tree.map(jnp.zeros_like, PARAMS)
    as_bool = {"a": True, "b": np.arange(5) % 2 == 0}
    as_float = {"a": 1.0, "b": (np.arange(5) % 2 == 0).astype(np.float32)}
    masked = [train(zero_one(mask=mask), start)[0] for mask in (as_bool, as_float)]
    unmasked = train(zero_one(), start)[0]
    for key in PARAMS:
        np.testing.assert_array_equal(masked[0][key], masked[1][key])
    # the mask acts on its own leaf only ("b"'s other entries feel it through b's scale)
    np.testing.assert_array_equal(masked[0]["a"], unmasked["a"])
    assert not np.allclose(masked[0]["b"][..., 1::2], unmasked["b"][..., 1::2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CallableTree:
    """A pytree node that is also callable, as an Equinox model is."""

    a: Any
    b: Any

    def __call__(self, x):
        return x


def test_a_mask_that_is_a_callable_tree_is_taken_as_a_tree():
    """An Equinox model is a callable pytree: a mask built over one (jax.tree.map over the
    model) was refused as "not a function", with no way in but wrapping params and mask in a
    dict (an Equinox trial). It is a tree: the same bits as the mask given in a dict."""
    params = CallableTree(PARAMS["a"], PARAMS["b"])
    keep = np.arange(5) % 2 == 0
    for mask_of in (
        lambda m: zero_one(mask=m),
        lambda m: zero_one(weight_decay=0.1, weight_decay_mask=m),
        lambda m: onebit(mask=m),
    ):
        got = train(mask_of(CallableTree(1.0, keep)), params)[0]
        want = train(mask_of({"a": 1.0, "b": keep}), PARAMS)[0]
        np.testing.assert_array_equal(got.a, want["a"])
        np.testing.assert_array_equal(got.b, want["b"])
    with pytest.raises(ValueError, match="not a function"):  # a function still is one
        per_worker(zero_one(mask=lambda p: p).init, PARAMS)


# --- the worker axis ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis_name", [3, ("w",), ["w"], ""])
def test_axis_name_not_a_string(axis_name):
    for factory in (ozo.zero_one_adam, ozo.onebit_adam):
        with pytest.raises(ValueError, match="axis_name must be"):
            factory(0.1, axis_name=axis_name)
    with pytest.raises(ValueError, match="axis_name must be"):
        ozo.onebit_mean(axis_name)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_axis_name_unbound_at_init(name):
    tx = OPTIMIZERS[name]()
    with pytest.raises(ValueError, match="init was called outside a context that binds"):
        tx.init(PARAMS)  # no mapping at all
    # another axis name: the error names the bound one (it said init ran outside any mapping)
    with pytest.raises(ValueError, match=r"axis_name='w', but init runs inside .* over 'other'"):
        jax.pmap(tx.init, axis_name="other")(ozo.replicate(PARAMS, 2))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_axis_name_unbound_at_update(name):
    tx = OPTIMIZERS[name](num_workers=N)
    state = tx.init(PARAMS)  # fine outside the mapping with num_workers
    with pytest.raises(ValueError, match="axis_name='w' is not bound"):
        tx.update(PARAMS, state, PARAMS)
    wrong = jax.vmap(lambda g, s: tx.update(g, s, g), axis_name="other")
    with pytest.raises(ValueError, match="axis_name='w' is not bound"):
        wrong(ozo.replicate(PARAMS, N), ozo.replicate(state, N))


@pytest.mark.parametrize("mapping", ["vmap", "pmap", "shard_map"])
def test_a_forgotten_axis_name_inside_a_mapped_step_warns(mapping):
    """Built without axis_name, the optimizer runs on each worker alone and JAX has nothing to
    complain about: the library warns when it is traced per worker over a named axis."""
    tx = ozo.zero_one_adam(0.1, **SCHEDULE)  # axis_name forgotten

    def step(p, s, g):
        return tx.update(g, s, p)

    params = ozo.replicate(PARAMS, N)
    state = jax.vmap(tx.init)(params)
    if mapping == "vmap":
        mapped = jax.vmap(step, axis_name=AXIS)
    elif mapping == "pmap":
        mapped = jax.pmap(step, axis_name=AXIS, devices=jax.devices()[:N])
    else:
        mesh = jax.make_mesh((N,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        block = lambda *t: jax.tree.map(lambda x: x[None], step(*jax.tree.map(lambda x: x[0], t)))  # noqa: E731
        mapped = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    with pytest.warns(UserWarning, match=r"axis_name=None but runs per worker .* over 'w'"):
        mapped(params, state, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one worker, unmapped: nothing to warn about
        jax.jit(step)(PARAMS, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_num_workers_differs_from_axis_size(name):
    tx = OPTIMIZERS[name](num_workers=2)
    with pytest.raises(ValueError, match="num_workers=2 but axis 'w' has 4 workers"):
        per_worker(tx.init, PARAMS)
    state = ozo.replicate(tx.init(PARAMS), N)
    with pytest.raises(ValueError, match="num_workers=2 but axis 'w' has 4 workers"):
        jax.vmap(lambda g, s: tx.update(g, s, g), axis_name=AXIS)(ozo.replicate(PARAMS, N), state)


@pytest.mark.parametrize("num_workers", [0, -1, 2.0, "4", True])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_num_workers_not_a_positive_int_at_construction(name, num_workers):
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        OPTIMIZERS[name](num_workers=num_workers)  # checked once, before init


def test_num_workers_without_axis_name():
    with pytest.raises(ValueError, match="needs an axis_name"):
        ozo.zero_one_adam(0.1, num_workers=4)
    with pytest.raises(ValueError, match=r"num_workers must be None or a pair \(nodes"):
        ozo.onebit_adam(0.1, axis_name="node", fast_axis_name="local", num_workers=8)


def test_state_for_another_worker_count_at_update():
    state = ozo.replicate(zero_one(num_workers=2).init(PARAMS), N)
    step = jax.vmap(lambda g, s: zero_one().update(g, s, g), axis_name=AXIS)
    with pytest.raises(ValueError, match="made for 2 workers, but this axis has 4"):
        step(ozo.replicate(PARAMS, N), state)


# --- dtypes, odd leaves and empty trees, handled --------------------------------------------------

ODD_TREE = {
    "bf16": jnp.zeros((7,), jnp.bfloat16),
    "f16": jnp.zeros((2, 3), jnp.float16),
    "scalar": jnp.zeros((), jnp.float32),
    "empty": jnp.zeros((0, 3), jnp.float32),
    "f32": jnp.zeros((5,), jnp.float32),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_low_precision_scalar_and_zero_size_leaves_are_handled(name):
    xs, state = train(OPTIMIZERS[name](), ODD_TREE)
    for key, leaf in ODD_TREE.items():
        assert xs[key].shape == (STEPS, N, *leaf.shape)
    for key in ("bf16", "f16", "scalar", "f32"):
        distance = np.abs(xs[key] - 1).reshape(STEPS, N, -1).max(-1)  # target 1, start 0
        assert np.all(np.isfinite(xs[key])), key
        assert distance[-1].max() < 0.75, (key, distance[-1])  # it moved toward the target
        # every worker holds the same params after a sync (step 12), up to the rounding of
        # x + (xbar - x) in the params' dtype (0/1 Adam; exactly the same for the others)
        ulps = 2 * float(jnp.finfo(ODD_TREE[key].dtype).eps) if name == "zero_one_adam" else 0
        synced = xs[key][11]
        np.testing.assert_allclose(synced, np.broadcast_to(synced[0], synced.shape), rtol=ulps)
    # buffers are float32 whatever the params' dtype; updates come back in the params' dtype
    for leaf in jax.tree.leaves(state):
        assert leaf.dtype in (jnp.float32, jnp.int32, jnp.bool_), leaf.dtype
    dtypes = jax.eval_shape(lambda: update_once(OPTIMIZERS[name](), ODD_TREE, ODD_TREE)[0])
    assert jax.tree.map(lambda x: x.dtype, dtypes) == {k: v.dtype for k, v in ODD_TREE.items()}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_zero_size_leaf_last_in_the_tree_compiles_in_a_shard_map(workers):
    """A size-0 slice at the end of the flat buffer, inside a one-device shard_map, aborted the
    whole process in XLA:CPU's compiler (jax 0.10): zero-size leaves are made, not sliced."""
    mesh = ozo.worker_mesh(AXIS, workers)
    tree = {
        "a": jnp.ones((workers, 7)),
        "z": jnp.ones((workers, 0, 5)),
        "z2": jnp.ones((workers, 0)),
    }
    tree = jax.device_put(tree, jax.sharding.NamedSharding(mesh, P(AXIS)))
    tx = ozo.onebit_mean(AXIS)
    state = jax.jit(ozo.on_workers(tx.init, mesh, AXIS))(tree)
    step = jax.jit(ozo.on_workers(lambda t, s: tx.update(t, s)[0], mesh, AXIS))
    out = step(tree, state)
    assert jax.tree.map(np.shape, out) == jax.tree.map(np.shape, tree)
    # one worker: the mean is the values; two: 1-bit, the same on both, finite
    expected = tree["a"] if workers == 1 else np.broadcast_to(out["a"][:1], out["a"].shape)
    np.testing.assert_array_equal(out["a"], expected)
    assert np.all(np.isfinite(out["a"])) and np.all(out["a"] > 0)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("empty", [{}, [], (), None], ids=["dict", "list", "tuple", "None"])
def test_empty_trees_are_handled(name, empty):
    tx = OPTIMIZERS[name]()

    def fn(unused):
        state = tx.init(empty)
        for _ in range(3):
            updates, state = tx.update(empty, state, empty)
        return updates, state

    updates, state = jax.jit(jax.vmap(fn, axis_name=AXIS))(jnp.zeros(N))
    assert updates == empty
    assert jax.tree.structure(state) == jax.tree.structure(
        jax.eval_shape(jax.vmap(lambda _: tx.init(empty), axis_name=AXIS), jnp.zeros(N))
    )
    # every step counter in the state counts the three updates
    for _, count in optax.tree.get_all_with_path(state, "count"):
        np.testing.assert_array_equal(count, 3)


# --- hyperparameters out of range -----------------------------------------------------------------

ZERO_ONE_NONSENSE = [
    (dict(b1=1.0), r"b1 must be in \[0.0, 1.0\)"),
    (dict(b1=-0.1), r"b1 must be in"),
    (dict(b1=float("nan")), r"b1 must be in"),
    (dict(b2=1.0), r"b2 must be in"),
    (dict(b2=1.5), r"b2 must be in"),
    (dict(eps=-1e-8), r"eps must be in"),
    (dict(eps=float("nan")), r"eps must be in"),
    (dict(eps=0.0), r"eps must be >= 1.18e-38 .*got 0.0"),
    (dict(eps=1e-39), r"eps must be >= 1.18e-38 .*a smaller eps is 0 in float32"),
    (dict(weight_decay=-0.1), r"weight_decay must be in"),
    (dict(learning_rate=-0.1), r"learning_rate must be in"),
    (dict(learning_rate=float("nan")), r"learning_rate must be in"),
    (dict(learning_rate=float("inf")), r"learning_rate must be in"),
    (dict(learning_rate="0.1"), r"learning_rate must be a float or an optax.Schedule"),
    (dict(learning_rate=None), r"learning_rate must be a float or an optax.Schedule"),
    (dict(learning_rate=True), r"learning_rate must be a float or an optax.Schedule"),
    (dict(var_freeze_step=-1), r"var_freeze_step=-1: The variance is frozen after step -1"),
    (dict(var_freeze_step=1.5), r"var_freeze_step must be an integer >= 1"),
    (dict(var_freeze_step=5.0), r"var_freeze_step must be an integer >= 1, got 5.0"),
    (dict(var_freeze_step=0), r"frozen after step 0, before any step has measured it"),
    (dict(var_freeze_step=10**12), r"var_freeze_step=1000000000000 does not fit .* int32"),
    (
        dict(var_update_scaler=0),
        r"var_update_scaler \(VarianceDoubling.update_scaler\) must be an integer",
    ),
    (
        dict(local_step_scaler=0),
        r"local_step_scaler \(LocalStepDoubling.scaler\) must be an integer",
    ),
    (
        dict(local_step_clipper=0),
        r"local_step_clipper \(LocalStepDoubling.clipper\) must be an integer",
    ),
    (
        dict(local_step_clipper=True),
        r"local_step_clipper \(LocalStepDoubling.clipper\) must be an integer",
    ),
]


@pytest.mark.parametrize("kwargs,match", ZERO_ONE_NONSENSE, ids=lambda x: str(x)[:40])
def test_zero_one_adam_hyperparameters_out_of_range(kwargs, match):
    kwargs = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ozo.zero_one_adam(**kwargs)


ONEBIT_NONSENSE = [
    (dict(b1=1.0), r"b1 must be in"),
    (dict(b2=-0.5), r"b2 must be in"),
    (dict(eps=-1.0), r"eps must be in"),
    (dict(weight_decay=-1.0), r"weight_decay must be in"),
    (dict(learning_rate=-1.0), r"learning_rate must be in"),
    (dict(learning_rate="fast"), r"learning_rate must be a float"),
    (dict(freeze_step=-1), r"freeze_step=-1: The variance is frozen after step -1"),
    (dict(freeze_step=2.0), r"freeze_step must be an integer >= 1"),
    (dict(eps=1e-40), r"eps must be >= 1.18e-38"),
    (dict(freeze_step=0), r"frozen after step 0.*onebit_adam's freeze_step >= 1"),
    (dict(freeze_step=2**31), r"freeze_step=2147483648 does not fit .* int32"),
]


@pytest.mark.parametrize("kwargs,match", ONEBIT_NONSENSE, ids=lambda x: str(x)[:40])
def test_onebit_adam_hyperparameters_out_of_range(kwargs, match):
    kwargs = {"learning_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ozo.onebit_adam(**kwargs)


def test_policies_and_collective_out_of_range():
    # the sync rules need the inner learning rate: a default of 0 zeroed the momentum at every
    # sync, silently (a ninth new-user trial)
    for rule in (ozo.MomentumAverage, ozo.FrozenAdamSync):
        with pytest.raises(TypeError, match="learning_rate"):
            rule()
        with pytest.raises(ValueError, match="learning_rate must be a float or an optax.Schedule"):
            rule(None)
    # the schedules of the optimizers refuse what the optimizers refuse
    with pytest.raises(ValueError, match="var_freeze_step=0: The variance is frozen after step 0"):
        ozo.zero_one_schedule(var_freeze_step=0)
    with pytest.raises(ValueError, match="freeze_step=0: The variance is frozen after step 0"):
        ozo.onebit_schedule(0)
    with pytest.raises(
        ValueError, match=r"var_freeze_step \(VarianceDoubling.freeze_step\) must be an integer"
    ):
        ozo.VarianceDoubling(freeze_step=-5)
    for schedule in (lambda: ozo.diloco_schedule(2, start_step=-1),
                     lambda: ozo.local_step_schedule(ozo.SyncEvery(2), start_step=-1)):  # fmt: skip
        with pytest.raises(ValueError, match="start_step must be an integer >= 0, got -1"):
            schedule()
    with pytest.raises(
        ValueError,
        match=r"local_step_clipper \(LocalStepDoubling.clipper\) must be an integer >= 1",
    ):
        ozo.LocalStepDoubling(clipper=0)
    with pytest.raises(ValueError, match="collective must be one of"):
        ozo.onebit_mean(AXIS, collective="ring")
    # an object that is not a policy fails at construction, naming what it lacks
    with pytest.raises(ValueError, match="variance_policy must be a policy object"):
        ozo.scale_by_zero_one_adam(0.1, variance_policy="doubling")
    with pytest.raises(ValueError, match="local_step_policy must be a policy object"):
        ozo.scale_by_zero_one_adam(0.1, local_step_policy=object())
    with pytest.raises(ValueError, match="variance_policy must be a policy object"):
        ozo.scale_by_frozen_variance_adam(variance_policy=object())  # it failed at init
    with pytest.raises(ValueError, match="variance_policy must be a policy object"):
        ozo.scheduled_mean(AXIS, None)  # an AttributeError on None
    with pytest.raises(ValueError, match="axis_name must be the name"):
        ozo.scale_by_frozen_variance_adam(axis_name=5)  # an XLA shape error at update
    with pytest.raises(ValueError, match="needs the inner transform's variance_policy"):
        ozo.FrozenAdamSync(0.01).errors(
            jax.vmap(ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(2)).init, axis_name=AXIS)(
                jnp.zeros((N, 3))
            ),
            4,
        )


@pytest.mark.parametrize(
    "field, value",
    [("b1", True), ("b2", True), ("eps", True), ("b1", None), ("b1", "0.9"), ("eps", None)],
)
def test_bools_strings_and_none_are_refused_for_the_adam_coefficients(field, value):
    """b1=True trained nothing and b2=True diverged, silently (taken as 1); None and strings
    failed late, inside the update's trace (a review)."""
    with pytest.raises(ValueError, match=f"{field} must be a number in"):
        ozo.zero_one_adam(0.1, axis_name=AXIS, **{field: value})
    with pytest.raises(ValueError, match="weight_decay must be a number in"):
        ozo.onebit_adam(0.1, axis_name=AXIS, weight_decay=True)


def test_learning_rate_arrays_and_injected_values_are_checked():
    # a vector of rates was applied per column of the internal flat buffer (another leaf's)
    with pytest.raises(ValueError, match=r"learning_rate must be a scalar .* shape \(16,\)"):
        ozo.zero_one_adam(jnp.full((16,), 1e-3), axis_name=AXIS)
    ozo.zero_one_adam(np.asarray(1e-3), axis_name=AXIS)  # a 0-d NumPy array is a rate
    ozo.zero_one_adam(1e-3, axis_name=AXIS, num_workers=np.int64(N))  # a NumPy integer too
    # inject_hyperparams hands the constructor concrete arrays at init: checked like numbers
    for name, value in (("eps", 0.0), ("var_freeze_step", 0), ("weight_decay", -1.0)):
        tx = optax.inject_hyperparams(ozo.zero_one_adam, static_args=("axis_name",))(
            1e-3, axis_name=None, **{name: value}
        )
        with pytest.raises(ValueError, match=name if name != "eps" else "eps must be"):
            tx.init({"w": jnp.zeros(3)})
    # bfloat16 params make inject_hyperparams cast b2=0.999 to bfloat16, which is 1.0: the
    # error names the dtype and the way out (it said only "got 1.0")
    tx = optax.inject_hyperparams(ozo.zero_one_adam)(1e-3, b2=0.999)
    with pytest.raises(ValueError, match=r"got 1.0 \(a bfloat16 array: .*hyperparam_dtype"):
        tx.init({"w": jnp.zeros(3, jnp.bfloat16)})
    tx = optax.inject_hyperparams(ozo.zero_one_adam, hyperparam_dtype=jnp.float32)(1e-3, b2=0.999)
    tx.init({"w": jnp.zeros(3, jnp.bfloat16)})
    jax.jit(jax.vmap(tx.init, axis_name=AXIS))({"w": jnp.zeros((2, 3), jnp.bfloat16)})
    # under jit (the documented init), the injected b2 is a tracer whose value cannot be read:
    # it passed as 1.0, and one step sent a param of 1.0 to -101376 (a trial); a traced
    # hyperparameter with an open bound at 1 in a dtype that rounds onto it is refused
    for factory in (ozo.zero_one_adam, ozo.onebit_adam):
        tx = optax.inject_hyperparams(factory)(1e-3, b2=0.999, axis_name=AXIS)
        with pytest.raises(ValueError, match=r"b1 is a traced bfloat16 .*hyperparam_dtype"):
            jax.jit(jax.vmap(tx.init, axis_name=AXIS))({"w": jnp.zeros((2, 3), jnp.bfloat16)})
    tx = optax.inject_hyperparams(ozo.zero_one_adam)(1e-3, b2=0.9999, axis_name=AXIS)
    with pytest.raises(ValueError, match=r"b1 is a traced float16"):  # 0.9999 is 1.0 there
        jax.jit(jax.vmap(tx.init, axis_name=AXIS))({"w": jnp.zeros((2, 3), jnp.float16)})
    # a worker count injected by inject_hyperparams is an array, traced in update: it must be
    # static (it was refused as "a positive int" with no way out named)
    tx = optax.inject_hyperparams(ozo.zero_one_adam)(1e-3, axis_name=AXIS, num_workers=2)
    with pytest.raises(ValueError, match=r"num_workers is a JAX array.*static_args"):
        tx.init({"w": jnp.zeros(3)})
    tx = optax.inject_hyperparams(ozo.zero_one_adam, static_args=("num_workers",))(
        1e-3, axis_name=AXIS, num_workers=2
    )
    state = ozo.replicate(tx.init({"w": jnp.zeros(3)}), 2)
    step = jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS)
    step({"w": jnp.ones((2, 3))}, state, {"w": jnp.zeros((2, 3))})
    # a factory given for momentum_mean is named at construction (was an AttributeError)
    with pytest.raises(TypeError, match="looks like an optimizer's factory"):
        ozo.scale_by_frozen_variance_adam(momentum_mean=optax.adam)


@pytest.mark.parametrize("factory", [ozo.zero_one_adam, ozo.onebit_adam])
def test_a_schedule_of_a_non_scalar_rate_at_construction(factory):
    with pytest.raises(ValueError, match=r"schedule returning shape \(3,\): it must return a"):
        factory(lambda count: jnp.full(3, 1e-3))
    factory(lambda count: 1e-3 if count < 10 else 1e-4)  # not traceable alone: left to update


def test_an_optimizer_factory_given_uncalled_is_named():
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    with pytest.raises(TypeError, match=r"'adamw' looks like an optimizer's factory: call it, "
                       r"e.g. optax.adamw\(1e-3\)"):  # fmt: skip
        ozo.diloco(optax.adamw, outer, 4, AXIS)
    with pytest.raises(TypeError, match=r"outer must be .* call it, e.g. optax.sgd\(0.7"):
        ozo.diloco(optax.adamw(1e-3), optax.sgd, 4, AXIS)


def test_worker_helpers_refuse_swapped_or_malformed_arguments():
    params = {"w": jnp.ones((3, 2))}
    tx = ozo.zero_one_adam(0.1)
    with pytest.raises(ValueError, match=r"arguments are \(params, opt_state\)"):
        ozo.synchronized_params(tx.init(params), params)
    for bad in (0, 4.0, "4"):
        with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
            ozo.replicate(params, bad)
    with pytest.raises(ValueError, match=r"axis_name must be a non-empty str, got 4.*\(axis_"):
        ozo.worker_mesh(4, "w")
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        ozo.worker_mesh("w", 0)
    # past the freeze (anchored), params of another shape than the state's are named, where
    # they were paired by position and broadcast (or raised deep in jnp.where)
    tx = ozo.zero_one_adam(0.1, var_freeze_step=1)
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(params, state, params)
    assert bool(ozo.synchronized_params(params, state)["w"].shape == (3, 2))
    for wrong in ({"w": jnp.ones((1, 2))}, {"w": jnp.ones(())}):
        with pytest.raises(ValueError, match=r"params leaf \['w'\] has shape .*, but the opt"):
            ozo.synchronized_params(wrong, state)


# --- values the compression cannot represent ------------------------------------------------------


def compressed_mean_of(values):
    """The compressed mean of ``values`` (worker layout, shape ``(N, n)``) over ``N`` workers,
    and the float64 reference's."""

    def fn(x):
        tx = ozo.onebit_mean(AXIS)
        return tx.update(x, tx.init(x))

    out, state = jax.jit(jax.vmap(fn, axis_name=AXIS))(values)
    ref = CompressedMean([values.shape[1:]], N)([[np.asarray(v, np.float64)] for v in values])[0]
    return np.asarray(out), state, ref


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 3e37, 1e-20, 1e-25, 1e-30])
def test_values_far_outside_the_squares_range_are_compressed_exactly(magnitude):
    """Magnitudes whose squares overflow or underflow float32 give the same compressed mean as
    the float64 reference (the scales are taken after an exact power-of-two prescale)."""
    raw = np.random.default_rng(0).standard_normal((N, 64)) * magnitude
    out, state, ref = compressed_mean_of(jnp.asarray(raw, jnp.float32))
    for worker in out:
        np.testing.assert_allclose(worker, ref, rtol=1e-5, atol=1e-6 * magnitude)
    assert all(np.all(np.isfinite(np.asarray(e))) for e in jax.tree.leaves(state))


def test_largest_and_smallest_safe_values_are_compressed():
    """At the edges of the fast path (1e17, 1e-17) with exact zeros: the reference's mean."""
    for magnitude in (1e17, 1e-17):
        raw = np.random.default_rng(1).standard_normal((N, 64)) * magnitude
        raw[:, ::5] = 0.0
        out, state, ref = compressed_mean_of(jnp.asarray(raw, jnp.float32))
        np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-6 * magnitude)
        assert all(np.all(np.isfinite(np.asarray(e))) for e in jax.tree.leaves(state))


@pytest.mark.parametrize("name", ADAMS)
def test_float64_params_under_x64_keep_a_float64_state(name):
    """With jax_enable_x64 and float64 params the error buffers were float32 while the
    compressed mean computed in float64: the in-graph update's branches disagreed (an internal
    switch type error, a new-user trial)."""
    with jax.enable_x64(True):
        params = {"a": jnp.ones((3, 2), jnp.float64), "b": jnp.ones((5,), jnp.float64)}
        tx = ADAMS[name]()

        def fn(p, g):
            s = tx.init(p)
            for _ in range(3):
                u, s = tx.update(g, s, p)
                p = optax.apply_updates(p, u)
            return p, s

        p, s = per_worker(fn, params, jax.tree.map(lambda x: 0.5 * x, params))
        buffers = [  # per worker: a leading axis, then the buffer's own (scalars: lr_sum)
            x for x in jax.tree.leaves(s) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 1
        ]
        assert buffers and {x.dtype for x in buffers} == {jnp.dtype(jnp.float64)}
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p))


def test_schedules_and_their_checks_refuse_what_is_not_theirs():
    """A bad-input audit: StepSchedule took anything as a policy (failing at the first kind()
    with an AttributeError), and check_schedule passed silently with its arguments swapped, with
    the params instead of a state, and with 1-bit Adam's schedule for a 0/1 Adam state."""
    with pytest.raises(ValueError, match="variance_policy must be a policy object"):
        ozo.StepSchedule(1000)
    with pytest.raises(ValueError, match="variance_policy must be a policy object.*LocalStep"):
        ozo.StepSchedule(ozo.LocalStepDoubling(), ozo.VarianceDoubling(4))
    with pytest.raises(ValueError, match="got the class SyncEvery: build one"):
        ozo.local_step_schedule(ozo.SyncEvery)
    params = {"w": jnp.ones(4)}
    state = ozo.zero_one_adam(1e-2, var_freeze_step=4).init(params)
    schedule = ozo.zero_one_schedule(var_freeze_step=4)
    ozo.check_schedule(state, schedule)
    for check in (ozo.check_schedule, ozo.step_kind):
        with pytest.raises(TypeError, match=r"takes the optimizer's StepSchedule second.*swapped"):
            check(schedule, state)
    with pytest.raises(ValueError, match="holds no step counter"):
        ozo.check_schedule(params, schedule)
    with pytest.raises(ValueError, match="has local steps .* not this optimizer's schedule"):
        ozo.check_schedule(state, ozo.onebit_schedule(4))


@pytest.mark.parametrize(
    "schedule, message",
    [
        (lambda step, total: 1e-3, "cannot be called with one argument"),
        (lambda count: None, "must return a real scalar"),
        (lambda count: "1e-3", "must return a real scalar"),
        (lambda count: count < 10, "must return a real scalar"),
        (lambda count: jnp.asarray(1e-3 + 0j), "must return a real scalar"),
        (lambda count: -1e-2 + 0 * count, "value at step count 0 is -0.0"),
        (lambda count: jnp.where(count == 0, jnp.nan, 1e-2), "value at step count 0 is nan"),
    ],
)
def test_a_learning_rate_schedule_is_checked_at_construction(schedule, message):
    """A bad-input audit: a schedule was only shape-checked, its trace's errors swallowed, so a
    wrong signature or a None result failed inside optax at update, a bool or complex result
    ran cast, and a negative or NaN rate trained (a NaN poisons 0/1 Adam's lr_sum for good)."""
    for build in (ozo.zero_one_adam, ozo.onebit_adam):
        with pytest.raises(ValueError, match=message):
            build(schedule)


def test_a_schedule_that_branches_on_the_count_in_python_is_left_to_the_trace():
    def schedule(count):  # fine on a concrete count, fails where the update is traced (optax too)
        return 1e-3 if count < 10 else 1e-4

    ozo.zero_one_adam(schedule)  # accepted, as optax.adam(schedule) is
    ozo.zero_one_adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100))  # 0 at count 0


def test_worker_layout_helpers_refuse_a_tree_in_the_other_layout():
    """A bad-input audit: dp.to_workers stacked a second worker axis on a tree already in the
    worker layout (dp.init and dp.jit then trained an N-times larger model), and unreplicate
    returned the first row of every leaf of a tree without a worker axis."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.zeros((4,))}
    dp = ozo.data_parallel(mesh, params, "data")
    workers = dp.to_workers(params)
    assert workers["w"].shape == (4, 4)
    with pytest.raises(ValueError, match=r"\['w'\] of shape \(4, 4\) is already sharded over"):
        dp.to_workers(workers)
    one = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.arange(5.0)}
    with pytest.raises(ValueError, match=r"leading axes disagree \(3 at \['a'\], 5 at \['b'\]\)"):
        ozo.unreplicate(one)
    for worker in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="worker must be an int"):
            ozo.unreplicate(ozo.replicate(one, 4), worker)
    np.testing.assert_array_equal(ozo.unreplicate(ozo.replicate(one, 4), 2)["b"], one["b"])
    best = jnp.argmin(jnp.asarray([3.0, 1.0, 2.0, 5.0]))  # a 0-d int array is an index
    np.testing.assert_array_equal(ozo.unreplicate(ozo.replicate(one, 4), best)["b"], one["b"])


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ozo.zero_one_adam(1e-2, b1=(0.9, 0.999)), r"b1 must be .*betas=\(b1, b2\)"),
        (lambda: ozo.onebit_adam(1e-2, weight_decay=[0.1]), r"weight_decay must be .*\[0.1\]"),
        (lambda: ozo.scale_by_frozen_variance_adam(ozo.VarianceDoubling(100)), "b1 must be"),
        (lambda: ozo.zero_one_adam(1e-2, b1=jnp.full(16, 0.9)), r"array of shape \(16,\)\.$"),
        (lambda: ozo.zero_one_adam(1e-2, eps=jnp.full(2, 1e-8)), r"eps .*shape \(2,\)"),
    ],
)
def test_adam_coefficients_must_be_scalars(build, message):
    """A bad-input audit: b1, b2, eps and weight_decay were range-checked only as numbers, so a
    tuple (PyTorch's betas), a list, a policy passed positionally or a vector built and failed
    at update, deep in JAX."""
    with pytest.raises(ValueError, match=message):
        build()
    optax.inject_hyperparams(ozo.zero_one_adam)(1e-2, b1=0.9, weight_decay=0.1)  # scalar arrays


def test_wrappers_check_their_inner_transform_and_rule_at_construction():
    """A bad-input audit: flatten and skip_not_finite took None or an uncalled optax.adam and
    failed at init with optax's AttributeError; local_step_sync took a rule that was a name or
    a class and failed in the update."""
    for wrap in (ozo.flatten, ozo.skip_not_finite):
        with pytest.raises(TypeError, match="'adam' looks like an optimizer's factory: call it"):
            wrap(optax.adam)
        with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
            wrap(None)
    for rule, message in (
        ("params_average", "sync rule object with"),
        (ozo.ParamsAverage, "the class"),
    ):
        with pytest.raises(ValueError, match=message):
            ozo.local_step_sync(optax.sgd(0.1), ozo.SyncEvery(4), AXIS, rule=rule)
    # MomentumAverage around an SGD without momentum failed at the first sync, in the graph
    tx = ozo.local_step_sync(optax.sgd(0.1), ozo.SyncEvery(2), AXIS, rule=ozo.MomentumAverage(0.1))
    with pytest.raises(ValueError, match="Give the inner SGD a momentum"):
        jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate({"w": jnp.ones(3)}, 2))


def test_dispatch_by_kind_checks_compile_kind():
    """A bad-input audit: None, or the jitted step itself instead of a function of the kind,
    was taken and failed at the first step ("'NoneType' object is not callable", JAX's "Error
    interpreting argument ... as an abstract array"); so did a compile_kind returning None."""
    schedule = ozo.zero_one_schedule(var_freeze_step=4)
    for bad in (None, jax.jit(lambda p, s, g: (p, s))):
        with pytest.raises(ValueError, match="compile_kind must be a function from a step kind"):
            ozo.dispatch_by_kind(bad, schedule)
    params = {"w": jnp.ones(4)}
    run = ozo.dispatch_by_kind(lambda kind: None, schedule)
    with pytest.raises(ValueError, match=r"compile_kind\('variance'\) returned None"):
        run(params, ozo.zero_one_adam(1e-2, var_freeze_step=4).init(params), params)


@pytest.mark.parametrize("schedule", [None, "zero_one"], ids=["in-graph", "dispatched"])
def test_dp_jit_names_the_step_s_contract(schedule):
    """A bad-input audit: a step returning optax's usual pair (params, opt_state) failed with
    JAX's "pytree structure error ... out_shardings ... tuple of length 3", results in another
    order with "reshape requires ndarray ... NoneType"."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.ones(4)}
    dp = ozo.data_parallel(mesh, params, "data")
    tx = dp.optimizer(ozo.zero_one_adam(1e-2, axis_name="data", var_freeze_step=4))
    schedule = ozo.zero_one_schedule(var_freeze_step=4) if schedule else None

    def pair(p, s, x, **kind):
        u, s = tx.update(jax.tree.map(lambda w: w * x.sum(), p), s, p, **kind)
        return optax.apply_updates(p, u), s

    def swapped(p, s, x, **kind):
        p, s = pair(p, s, x, **kind)
        return s, p, None

    pw = dp.to_workers(params)
    for step, message in (
        (pair, "must return .* got a tuple of 2"),
        (swapped, "returned as its first value a tree unlike the params"),
    ):
        with pytest.raises(ValueError, match=r"dp.jit's step " + message):
            dp.jit(step, schedule=schedule, donate=False)(pw, dp.init(tx, pw), jnp.ones((4, 2)))


def test_reset_compression_refuses_params_for_fresh_state():
    """A bad-input audit: the fresh params passed as fresh_state failed inside the move with
    "TypeError: tuple indices must be integers or slices, not str"."""
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones((5,))}
    tx = ozo.zero_one_adam(1e-2, axis_name=AXIS, var_freeze_step=2)
    old = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, 4))
    with pytest.raises(ValueError, match=r"fresh_state holds no optimizer state \(the params\?\)"):
        ozo.reset_compression(ozo.replicate(params, 4), old, ozo.replicate(params, 2))


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_reset_compression_refuses_params_in_the_users_layout(name):
    """A bad-input trial: params in the user's layout whose leaf's leading axis happened to be
    the old worker count passed, and 1-bit Adam's move took that leaf's first row as the
    params, (4, 3) -> (3,), failing only at the next update, blaming the gradients."""
    params = {"w": jnp.arange(12.0).reshape(4, 3)}
    tx = getattr(ozo, name)(1e-2, axis_name=AXIS)
    old = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, 4))
    fresh = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, 2))
    with pytest.raises(ValueError, match=r"takes the params in the worker layout of the saved"):
        ozo.reset_compression(params, old, fresh)
    moved, _ = ozo.reset_compression(ozo.replicate(params, 4), old, fresh)
    np.testing.assert_array_equal(np.asarray(moved["w"]), np.asarray(ozo.replicate(params, 2)["w"]))


def test_schedule_kind_names_a_step_of_the_wrong_type_or_size():
    """A bad-input audit: kind(jnp.asarray(3)) said "steps are numbered from 1" of a valid step
    (its type was the problem), and kind(2**33) walked the policies for hours."""
    schedule = ozo.zero_one_schedule(var_freeze_step=4)
    for step in (jnp.asarray(3), 3.0):
        with pytest.raises(ValueError, match=r"must be a Python or NumPy int.*int\(step\)"):
            schedule.kind(step)
    with pytest.raises(ValueError, match="beyond the optimizers' int32 step counters"):
        schedule.kind(2**33)
    assert schedule.kind(np.int64(3)) == schedule.kind(3)


def test_deepspeed_range_errors_name_the_config_key():
    """A bad-input audit: a value out of range in a DeepSpeed config was reported under the
    library's argument ("b2 must be in [0.0, 1.0)") instead of the key the user wrote."""
    for params, key in (
        ({"lr": -1e-3}, "lr"),
        ({"betas": [0.9, 1.5]}, r"betas\[1\]"),
        ({"eps": 0.0}, "eps"),
        ({"var_freeze_step": 0}, "var_freeze_step"),
        ({"betas": [1.0, 0.999]}, r"betas\[0\]"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"local_step_clipper": 0}, "local_step_clipper"),
        ({"var_update_scaler": 2**40}, "var_update_scaler"),
    ):
        with pytest.raises(ValueError, match=rf"^ZeroOneAdam param {key}: "):
            ozo.from_deepspeed_config({"type": "ZeroOneAdam", "params": params}, axis_name="w")
    # the mapping reads the argument the error carries, not its wording; the error survives a
    # trip between processes
    with pytest.raises(ValueError) as caught:
        ozo.zero_one_adam(1e-3, b2=1.5, axis_name="w")
    assert caught.value.argument == "b2"
    again = pickle.loads(pickle.dumps(caught.value))
    assert (type(again), again.argument, str(again)) == (
        type(caught.value),
        "b2",
        str(caught.value),
    )
    with pytest.raises(ValueError, match=r"^learning_rate is a schedule whose value"):
        ozo.from_deepspeed_config(
            {"type": "OneBitAdam", "params": {"lr": 1e-3}},
            axis_name="w",
            learning_rate=lambda c: -1.0,
        )


def test_minor_arguments_are_checked_at_construction():
    """A bad-input audit: compressed_steps="no" was taken as True, fast_axis_name="" accepted
    (axis_name="" is refused), and data_parallel / on_workers with the mesh in another place
    failed with "'dict' object has no attribute 'axis_names'"."""
    with pytest.raises(ValueError, match="compressed_steps must be True or False"):
        ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(4), compressed_steps="no")
    with pytest.raises(ValueError, match="fast_axis_name must be the name"):
        ozo.zero_one_adam(1e-3, axis_name="n", fast_axis_name="")
    mesh = ozo.worker_mesh(AXIS, 1)
    with pytest.raises(TypeError, match=r"data_parallel\(mesh, params, data_axis\).*got a dict"):
        ozo.data_parallel({"w": jnp.zeros(4)}, mesh)
    with pytest.raises(TypeError, match=r"on_workers\(fn, mesh, axis_name\).*got a function"):
        ozo.on_workers(mesh, lambda p: p)
    ozo.on_workers(lambda p: p, mesh.abstract_mesh)  # as jax.shard_map takes it
    ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(4), compressed_steps=0)  # 0 / 1 as bools
    with pytest.raises(ValueError, match="float_mean's axis_name must be the name"):
        jax.vmap(lambda x: ozo.float_mean(x, 3), axis_name=AXIS)(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"local_rows needs the worker layout.*\['s'\]"):
        ozo.local_rows({"s": jnp.ones(())})


def test_the_new_checks_refuse_nothing_legitimate():
    """A review of the checks above found them refusing what worked before: a weight decay
    schedule (optax.add_decayed_weights takes one), a step returning a list, a loop's own scalar
    named "count" beside a worker-layout state, a user-layout leaf that merely sits on the data
    axis, a compile_kind object with a .lower method."""
    decay = optax.linear_schedule(1e-2, 0.0, 100)
    ozo.zero_one_adam(1e-3, weight_decay=decay)
    ozo.onebit_adam(1e-3, weight_decay=decay)
    with pytest.raises(ValueError, match="weight_decay is a schedule whose value at step count 0"):
        ozo.zero_one_adam(1e-3, weight_decay=lambda c: -1.0 + 0 * c)
    params = {"w": jnp.ones((3, 2))}
    tx = ozo.zero_one_adam(1e-2, axis_name=AXIS)
    state4 = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, 4))
    for name in ("step", "count"):
        assert ozo.worker_count({name: np.asarray(5), "opt_state": state4}) == 4

    class Factory:  # a compile_kind keeping its programs' lowerings, say
        def __call__(self, kind):
            return jax.jit(lambda p: p)

        def lower(self):
            return None

    ozo.dispatch_by_kind(Factory(), ozo.zero_one_schedule(var_freeze_step=4))
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dp = ozo.data_parallel(mesh, {"w": P(None, "model")}, "data")
    x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, P("data", "model")))
    assert dp.to_workers({"w": x})["w"].shape == (2, 8, 4)  # re-placed, as before

    def step(p, s, batch):
        u, s = dtx.update(jax.tree.map(lambda w: w * batch.sum(), p), s, p)
        return [optax.apply_updates(p, u), s, None]  # a list

    one_d = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    dp1 = ozo.data_parallel(one_d, params, "data")
    dtx = dp1.optimizer(ozo.zero_one_adam(1e-2, axis_name="data"))
    pw = dp1.to_workers(params)
    p, s, _ = dp1.jit(step, donate=False)(pw, dp1.init(dtx, pw), jnp.ones((2, 3)))
    assert p["w"].shape == (2, 3, 2)


def test_building_an_optimizer_starts_no_backend():
    """A review: the schedule check ran the schedule on a device at construction, which started
    JAX's backend, so jax.distributed.initialize() after building the optimizer failed."""
    code = (
        "import optax, optax_zero_one as ozo\n"
        "from jax._src import xla_bridge\n"
        "ozo.zero_one_adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), "
        "weight_decay=optax.linear_schedule(1e-2, 0.0, 100), axis_name='w')\n"
        "ozo.onebit_adam(optax.cosine_decay_schedule(1e-3, 100), axis_name='w')\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        # the state's shapes before jax.distributed.initialize, NumPy params in a closure (a
        # review: the deferred schedule check ran the schedule there and started a backend)
        "import jax, numpy as np\n"
        "tx = ozo.zero_one_adam(optax.cosine_decay_schedule(1e-3, 100))\n"
        "p = {'w': np.ones(3, np.float32)}\n"
        "jax.eval_shape(lambda: tx.init(p))\n"
        "assert not xla_bridge.backends_are_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_schedule_built_before_any_backend_is_checked_at_init():
    """An optimizer built before any backend ran (a script's first lines) could not run its
    schedules then: a rate that is NaN at count 0 went unchecked into training. ``init`` checks
    the value once, as traced under vmap (the schedule's value is computed at trace time)."""
    code = (
        "import jax, jax.numpy as jnp, optax, optax_zero_one as ozo\n"
        "from jax._src import xla_bridge\n"
        "nan = lambda c: jnp.where(c == 0, jnp.nan, 1e-3)\n"
        "txs = [ozo.zero_one_adam(nan, axis_name='w'), ozo.onebit_adam(nan, axis_name='w'),\n"
        "       ozo.zero_one_adam(1e-3, weight_decay=lambda c: -1e-2 + 0 * c, axis_name='w')]\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "for tx, name in zip(txs, ['learning_rate', 'learning_rate', 'weight_decay']):\n"
        "    try:\n"
        "        jax.vmap(tx.init, axis_name='w')(jnp.zeros((2, 3)))\n"
        "    except ValueError as e:\n"
        "        assert f'{name} is a schedule whose value at step count 0' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('init did not check the schedule')\n"
        "good = ozo.zero_one_adam(optax.cosine_decay_schedule(1e-3, 100), axis_name='w')\n"
        "jax.vmap(good.init, axis_name='w')(jnp.zeros((2, 3)))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # init as the script's first computation (NumPy params: a review found the check skipped
    # there for good), eagerly or under jit (then the first update checks, at its trace)
    for init in ("tx.init(p)", "jax.jit(tx.init)(p)"):
        code = (
            "import jax, jax.numpy as jnp, numpy as np, optax_zero_one as ozo\n"
            "tx = ozo.zero_one_adam(lambda c: jnp.where(c == 0, jnp.nan, 1e-3))\n"
            "p = {'w': np.ones(3, np.float32)}\n"
            "try:\n"
            f"    s = {init}\n"
            "    jax.jit(tx.update)(p, s, p)\n"
            "except ValueError as e:\n"
            "    assert 'learning_rate is a schedule whose value at step count 0' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('the schedule was not checked')\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # the first inits of several threads at once (the check's bookkeeping raised KeyError)
    code = (
        "import threading, jax.numpy as jnp, optax, optax_zero_one as ozo\n"
        "tx = ozo.zero_one_adam(optax.cosine_decay_schedule(1e-3, 100))\n"
        "p, errors = {'w': jnp.ones(3)}, []\n"
        "def init():\n"
        "    try:\n"
        "        tx.init(p)\n"
        "    except Exception as e:\n"
        "        errors.append(e)\n"
        "threads = [threading.Thread(target=init) for _ in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors, errors\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_last_review_of_the_checks():
    """A review of the fixes above: a (nodes, per_node) pair of 0-d int arrays was refused
    where one such array passed, a jax.pmap'd step got through as compile_kind, compressed_steps
    took 1.0 or an array, and dp.to_workers stacked a second worker axis on a leaf whose spec
    had dropped a size-1 data axis (("node", "local") with one node)."""
    params = {"w": jnp.ones((3, 2))}
    tx = ozo.zero_one_adam(1e-2, axis_name=AXIS)
    state4 = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, 4))
    ozo.check_worker_count(state4, (jnp.asarray(4), jnp.asarray(1)))  # 4 nodes of one
    with pytest.raises(ValueError, match=r"num_workers must be the pair \(nodes, per_node\)"):
        ozo.check_worker_count(state4, (0, 4))
    with pytest.raises(ValueError, match="compile_kind must be a function from a step kind"):
        ozo.dispatch_by_kind(jax.pmap(lambda p: p), ozo.zero_one_schedule(var_freeze_step=4))
    for bad in (1.0, jnp.asarray(1), 2):
        with pytest.raises(ValueError, match="compressed_steps must be True or False"):
            ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(4), compressed_steps=bad)
    mesh = jax.make_mesh(
        (1, 4), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:4],
    )  # fmt: skip
    dp = ozo.data_parallel(mesh, params, ("node", "local"))
    workers = dp.to_workers(params)
    with pytest.raises(ValueError, match="is already sharded over the data axis"):
        dp.to_workers(workers)


def test_a_hand_built_zero_one_adam_whose_sync_starts_after_the_freeze_is_refused():
    # README's composition with start_step later than the variance freeze: nothing averaged
    # between the two, so the workers parted (synchronized params 0.13 apart after 12 steps),
    # with no error (a bad-input trial)
    variance = ozo.VarianceDoubling(2, 1)

    def composed(start_step):
        return ozo.flatten(
            ozo.local_step_sync(
                optax.chain(
                    ozo.scheduled_mean(AXIS, variance),
                    ozo.scale_by_frozen_variance_adam(0.9, 0.999, 1e-8, variance),
                    optax.scale_by_learning_rate(1e-2),
                ),
                ozo.LocalStepDoubling(1, 2),
                AXIS,
                start_step=start_step,
                rule=ozo.FrozenAdamSync(1e-2, 1e-8, variance),
            ),
            axis_name=AXIS,
        )

    params = jnp.zeros((N, 3))
    init = jax.vmap(composed(2).init, axis_name=AXIS)(params)  # at the freeze: fine
    assert jax.tree.leaves(init)
    with pytest.raises(ValueError, match=r"start_step \(5\) is after the variance freeze"):
        jax.vmap(composed(5).init, axis_name=AXIS)(params)


def test_scheduled_mean_refuses_gradients_it_cannot_average():
    # the block alone averaged int32 gradients in int32 (a mean of 0 and 1 read 0) and bool ones
    # to True, silently; complex ones failed inside the compression (a bad-input trial)
    tx = ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(4, 1))
    params = {"a": jnp.zeros((N, 3)), "b": jnp.zeros((N, 2))}

    def run(grads):
        def worker(p, g):
            return tx.update(g, tx.init(p), p)[0]

        return jax.vmap(worker, axis_name=AXIS)(params, grads)

    for dtype in (jnp.int32, jnp.bool_, jnp.complex64):
        grads = {"a": jnp.ones((N, 3), dtype), "b": jnp.ones((N, 2))}
        with pytest.raises(ValueError, match=r"scheduled_mean's input leaf \['a'\] has dtype"):
            run(grads)
    mean = run({"a": jnp.ones((N, 3)) * jnp.arange(N)[:, None], "b": jnp.ones((N, 2))})
    np.testing.assert_allclose(np.asarray(mean["a"]), (N - 1) / 2)


@pytest.mark.parametrize(
    "hierarchical",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # ~5 s each: in make test-slow
    ids=["flat", "hierarchical"],
)
@pytest.mark.parametrize("name", ["zero_one_adam", "onebit_adam"])
def test_gradients_that_do_not_vary_over_a_vmapped_axis_are_averaged(name, hierarchical):
    """A bad-input trial: under jax.vmap a gradient the same on every worker and unbatched
    (jnp.ones_like of the params) came back from JAX 0.10's all_to_all with the mapped axes twice,
    and the two-phase step failed in a slice inside the decoding (TypeError). The result must
    be that of the same gradient given per worker."""
    axes = dict(axis_name="node", fast_axis_name="local") if hierarchical else {}
    tx = getattr(ozo, name)(1e-2, **(axes or {"axis_name": AXIS}))
    params = {"a": jnp.zeros((3, 2)), "b": jnp.zeros((5,))}

    def worker(p, batched):
        g = jax.tree.map(lambda x: x + 1.0 if batched else jnp.ones_like(x), p)
        state = tx.init(p)
        for _ in range(3):  # variance steps, then compressed ones (in the graph)
            u, state = tx.update(g, state, p)
        return u

    def run(batched):
        one = lambda p: worker(p, batched)  # noqa: E731
        if hierarchical:
            mapped = jax.vmap(jax.vmap(one, axis_name="local"), axis_name="node")
            return jax.jit(mapped)(ozo.replicate(ozo.replicate(params, 2), 2))
        return jax.jit(jax.vmap(one, axis_name=AXIS))(ozo.replicate(params, N))

    for want, got in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_step_kinds_checks_its_step_count():
    """A bad-input trial: 1.5 and '10' failed in Python arithmetic, and a count past the int32
    counters was walked step by step before kind() refused it."""
    variance, local = ozo.VarianceDoubling(4), ozo.LocalStepDoubling()
    for bad in (1.5, "10", True):
        with pytest.raises(ValueError, match="num_steps must be a Python or NumPy int"):
            ozo.step_kinds(variance, local, bad)
    with pytest.raises(ValueError, match="beyond the optimizers' int32 step counters"):
        ozo.step_kinds(variance, local, 2**31)
    assert ozo.step_kinds(variance, local, np.int64(0)).shape == (0,)
    assert ozo.step_kinds(variance, local, 3).shape == (3,)


def test_checks_of_a_state_refuse_what_holds_no_state_of_this_library():
    """A bad-input trial: check_hints and check_restored passed on optax.adam's state and on
    the params, checking nothing."""
    params = {"a": jnp.zeros(3)}
    for check in (ozo.check_hints, ozo.check_restored):
        for wrong in (optax.adam(1e-3).init(params), params):
            with pytest.raises(ValueError, match="found no optimizer state of optax_zero_one"):
                check(wrong)
    for tx in (
        ozo.zero_one_adam(1e-3, axis_name=AXIS),
        optax.chain(ozo.onebit_mean(AXIS), optax.sgd(0.1)),  # no step counter: still ours
        ozo.diloco(optax.adamw(1e-3), optax.sgd(0.7), 4, AXIS),
    ):
        state = jax.vmap(tx.init, axis_name=AXIS)(ozo.replicate(params, N))
        ozo.check_hints(state)
        ozo.check_restored(state)


def test_to_workers_names_a_leaf_that_does_not_split_over_the_workers():
    """A bad-input trial: JAX's IndivisibleError about a NamedSharding, naming no leaf."""
    mesh = ozo.worker_mesh("w", 4)
    for leaf in (np.zeros((6, 2)), np.float32(1.0)):
        with pytest.raises(ValueError, match=r"to_workers: leaf \['x'\] has shape"):
            ozo.to_workers({"x": leaf}, mesh)
    assert ozo.to_workers({"x": np.zeros((8, 2))}, mesh)["x"].shape == (8, 2)
