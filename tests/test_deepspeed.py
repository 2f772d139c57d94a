"""from_deepspeed_config: every key maps to the argument it names (checked by running the built
optimizer against one built by hand), DeepSpeed's defaults apply where keys are absent, and
unsupported keys or values are rejected with a message that names them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_zero_one as ozo

N, STEPS = 2, 40
AXIS = "w"
SHAPES = [(5, 3), (7,)]
MASK = [np.ones((5, 3)), np.array([1, 1, 0, 1, 0, 1, 1], float)]

# Every value differs from its default and from the others, so a swapped or dropped key changes
# the trajectory: with F = 14, kappa = 3, alpha = 4, H = 4 all four step kinds occur in 40 steps.
ZERO_ONE = {
    "lr": 0.02,
    "betas": [0.8, 0.99],
    "eps": 1e-6,
    "weight_decay": 0.05,
    "var_freeze_step": 14,
    "var_update_scaler": 3,
    "local_step_scaler": 4,
    "local_step_clipper": 4,
}
ZERO_ONE_ARGS = dict(
    b1=0.8,
    b2=0.99,
    eps=1e-6,
    weight_decay=0.05,
    var_freeze_step=14,
    var_update_scaler=3,
    local_step_scaler=4,
    local_step_clipper=4,
)
ONEBIT = {"lr": 0.02, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05, "freeze_step": 9}
ONEBIT_ARGS = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05, freeze_step=9)


def trajectory(tx, steps=STEPS):
    """Parameters and state after ``steps`` steps of N vmapped workers on noisy quadratics."""
    rng = np.random.default_rng(0)
    x = [jnp.asarray(np.repeat(rng.standard_normal(s)[None], N, 0), jnp.float32) for s in SHAPES]
    grads = [
        [jnp.asarray(rng.standard_normal((N, *s)), jnp.float32) for s in SHAPES]
        for _ in range(steps)
    ]

    def step(x, s, g):
        g = jax.tree.map(lambda a, b: a + 0.5 * b, x, g)  # gradient of 0.5 |x|^2 plus noise
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    state = jax.vmap(tx.init, axis_name=AXIS)(x)
    run = jax.jit(jax.vmap(step, axis_name=AXIS))
    for g in grads:
        x, state = run(x, state, g)
    return jax.device_get((x, state))


def assert_same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


def assert_differs(a, b):
    assert any(not np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))), (
        "expected different trajectories"
    )


@pytest.fixture(scope="module")
def zero_one_by_hand():
    return trajectory(ozo.zero_one_adam(0.02, axis_name=AXIS, mask=MASK, **ZERO_ONE_ARGS))


def test_zero_one_adam_keys_map_to_arguments(zero_one_by_hand):
    section = {"type": "ZeroOneAdam", "params": ZERO_ONE}
    assert_same(
        trajectory(ozo.from_deepspeed_config(section, axis_name=AXIS, mask=MASK)), zero_one_by_hand
    )
    # The comparison is sensitive to every schedule key: changing one changes the trajectory.
    for key, value in [
        ("var_freeze_step", 13),
        ("var_update_scaler", 4),
        ("local_step_scaler", 3),
        ("local_step_clipper", 2),
    ]:
        changed = {"type": "ZeroOneAdam", "params": {**ZERO_ONE, key: value}}
        out = trajectory(ozo.from_deepspeed_config(changed, axis_name=AXIS, mask=MASK))
        assert_differs(out, zero_one_by_hand)


def test_onebit_adam_keys_map_to_arguments():
    built = ozo.from_deepspeed_config(
        {"type": "OneBitAdam", "params": ONEBIT}, axis_name=AXIS, mask=MASK
    )
    out = trajectory(built)
    assert_same(out, trajectory(ozo.onebit_adam(0.02, axis_name=AXIS, mask=MASK, **ONEBIT_ARGS)))
    changed = ozo.from_deepspeed_config(
        {"type": "OneBitAdam", "params": {**ONEBIT, "freeze_step": 10}}, axis_name=AXIS, mask=MASK
    )
    assert_differs(out, trajectory(changed))


@pytest.mark.parametrize(
    "kind, by_hand",
    [
        # DeepSpeed's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0,
        # var_freeze_step 100000, var_update_scaler 16, local_step_scaler 32678,
        # local_step_clipper 16; freeze_step 100000.
        ("ZeroOneAdam", lambda: ozo.zero_one_adam(1e-3, axis_name=AXIS)),
        ("OneBitAdam", lambda: ozo.onebit_adam(1e-3, axis_name=AXIS)),
    ],
)
def test_missing_keys_take_deepspeeds_defaults(kind, by_hand):
    out = trajectory(ozo.from_deepspeed_config({"type": kind}, axis_name=AXIS), steps=20)
    assert_same(out, trajectory(by_hand(), steps=20))
    # var_update_scaler = 16: variance steps 1..16, then 18 and 20 at the doubled interval
    if kind == "ZeroOneAdam":
        (scheduled,) = [
            s
            for s in jax.tree.leaves(
                out[1], is_leaf=lambda s: isinstance(s, ozo.ScheduledMeanState)
            )
            if isinstance(s, ozo.ScheduledMeanState)
        ]
        assert np.all(scheduled.variance_policy.interval == 2)
        assert np.all(scheduled.variance_policy.counter == 2)


def test_backend_keys_are_ignored_and_type_is_case_insensitive(zero_one_by_hand):
    ignored = {
        "cuda_aware": True,
        "comm_backend_name": "mpi",
        "bias_correction": True,
        "amsgrad": False,
        "eps_inside_sqrt": False,
    }
    section = {"type": "zerooneadam", "params": {**ZERO_ONE, **ignored}}
    tx = ozo.from_deepspeed_config(section, axis_name=AXIS, mask=MASK)
    assert_same(trajectory(tx), zero_one_by_hand)
    for name in ("ZEROONEADAM", "OnebitAdam", "onebitadam"):  # DeepSpeed lower-cases the type
        ozo.from_deepspeed_config({"type": name, "params": {"bias_correction": False}})
    # a null params is DeepSpeed's defaults, as no params is
    for section in ({"type": "ZeroOneAdam", "params": None}, {"type": "ZeroOneAdam"}):
        tx = ozo.from_deepspeed_config(section, axis_name=AXIS)
        assert isinstance(tx, optax.GradientTransformationExtraArgs)


def test_flags_written_as_numbers_read_as_deepspeed_reads_them(zero_one_by_hand):
    """DeepSpeed tests these flags for truth, so a config may say 0 for false and 1 for true."""
    as_numbers = {"amsgrad": 0, "eps_inside_sqrt": 0, "bias_correction": 1}
    section = {"type": "ZeroOneAdam", "params": {**ZERO_ONE, **as_numbers}}
    tx = ozo.from_deepspeed_config(section, axis_name=AXIS, mask=MASK)
    assert_same(trajectory(tx), zero_one_by_hand)
    # step counts written as whole floats (1e5 in a JSON file) are the integers
    as_floats = {
        k: float(v) for k, v in ZERO_ONE.items() if k.endswith(("_step", "_scaler", "_clipper"))
    }
    assert as_floats
    section = {"type": "ZeroOneAdam", "params": {**ZERO_ONE, **as_floats}}
    assert_same(
        trajectory(ozo.from_deepspeed_config(section, axis_name=AXIS, mask=MASK)), zero_one_by_hand
    )
    for key, truthy in (("amsgrad", 1), ("eps_inside_sqrt", 1.0), ("amsgrad", "false")):
        with pytest.raises(ValueError, match=f"param {key}=.* is not supported"):
            ozo.from_deepspeed_config({"type": "ZeroOneAdam", "params": {key: truthy}})


def test_learning_rate_override_replaces_lr():
    schedule = optax.linear_schedule(0.0, 0.02, 10)
    params = {**ZERO_ONE, "lr": "auto"}  # an unresolved Hugging Face value is fine if replaced
    built = ozo.from_deepspeed_config(
        {"type": "ZeroOneAdam", "params": params}, axis_name=AXIS, learning_rate=schedule
    )
    assert_same(
        trajectory(built), trajectory(ozo.zero_one_adam(schedule, axis_name=AXIS, **ZERO_ONE_ARGS))
    )


def test_num_workers_and_axis_name_are_forwarded():
    params = [jnp.zeros(s) for s in SHAPES]
    section = {"type": "OneBitAdam", "params": {"freeze_step": 3}}
    state = ozo.from_deepspeed_config(section, axis_name=AXIS, num_workers=4).init(params)
    (errors,) = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, ozo.OnebitMeanState))
        if isinstance(s, ozo.OnebitMeanState)
    ]
    # error buffers laid out for 4 workers: each leaf padded to a multiple of 4 * lcm(4, 8) = 32
    layout = errors.worker_error.layout
    assert layout.num_workers == 4
    assert [e.shape for e in layout.padded_leaves(errors.worker_error.buffer)] == [(32,), (32,)]
    with pytest.raises(ValueError, match="outside a context that binds axis_name='w'"):
        ozo.from_deepspeed_config(section, axis_name=AXIS).init(params)


def test_hierarchical_and_psum_settings_are_forwarded():
    """fast_axis_name and collective have no DeepSpeed key and could not be given (a trial):
    the config's optimizer, built with them, is the hand-built one, bit for bit."""
    section = {"type": "ZeroOneAdam", "params": ZERO_ONE}
    by_config = ozo.from_deepspeed_config(section, axis_name=AXIS, collective="psum")
    by_hand = ozo.zero_one_adam(0.02, axis_name=AXIS, collective="psum", **ZERO_ONE_ARGS)
    assert_same(trajectory(by_config), trajectory(by_hand))
    two_phase = ozo.zero_one_adam(0.02, axis_name=AXIS, **ZERO_ONE_ARGS)
    assert_differs(trajectory(by_config), trajectory(two_phase))
    params = [jnp.zeros((2, 2, *s)) for s in SHAPES]  # 2 nodes x 2 workers
    for kind, own in (("ZeroOneAdam", ZERO_ONE), ("OneBitAdam", ONEBIT)):
        tx = ozo.from_deepspeed_config(
            {"type": kind, "params": own}, axis_name="node", fast_axis_name="local"
        )
        init = jax.vmap(jax.vmap(tx.init, axis_name="local"), axis_name="node")
        errors = [
            s
            for s in jax.tree.leaves(
                init(params), is_leaf=lambda s: isinstance(s, ozo.OnebitMeanState)
            )
            if isinstance(s, ozo.OnebitMeanState)
        ]
        # hierarchical buffers: one row per node of each worker's 1/L share
        assert errors and all(e.worker_error.shape[2] == 2 for e in errors)


def test_the_papers_bert_configs_parse():
    """The optimizer sections of DeepSpeedExamples' BERT-Large seq-128 configs, verbatim."""
    zero_one = json.loads(
        '{"type": "ZeroOneAdam", "params": {"lr": 4e-4, "weight_decay": 0.01, '
        '"bias_correction": false, "var_freeze_step": 12500, "local_step_scaler": 32678, '
        '"cuda_aware": false, "comm_backend_name": "nccl"}}'
    )
    onebit = json.loads(
        '{"type": "OneBitAdam", "params": {"lr": 4e-4, "weight_decay": 0.01, '
        '"bias_correction": false, "freeze_step": 23000, "cuda_aware": false, '
        '"comm_backend_name": "nccl"}}'
    )
    for section in (zero_one, onebit, {**onebit, "legacy_fusion": False}):
        tx = ozo.from_deepspeed_config(section, axis_name=AXIS)
        assert isinstance(tx, optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"type": "ZeroOneAdam", "params": {"freeze_step": 10}}, "var_freeze_step"),
        ({"type": "OneBitAdam", "params": {"var_freeze_step": 10}}, "freeze_step"),
        ({"type": "ZeroOneAdam", "params": {"momentum": 0.9}}, "'momentum' is not supported"),
        ({"type": "OneBitAdam", "params": {"exp_avg_mask": None}}, "the mask= argument"),
        ({"type": "ZeroOneAdam", "params": {"amsgrad": True}}, "AMSGrad"),
        ({"type": "OneBitAdam", "params": {"eps_inside_sqrt": True}}, "never reads it"),
        ({"type": "ZeroOneAdam", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
        # DeepSpeed's engine refuses the key whatever its value
        ({"type": "OneBitAdam", "params": {"max_grad_norm": 0}}, "gradient_clipping"),
        ({"type": "ZeroOneAdam", "params": {"betas": {"b1": 0.9, "b2": 0.99}}}, "pair"),
        ({"type": "ZeroOneAdam", "params": {"lr": "auto"}}, "Resolve 'auto'"),
        # every key Hugging Face may leave as "auto" names the fix (betas and the step counts
        # said only what type they must be; a trial)
        ({"type": "ZeroOneAdam", "params": {"betas": "auto"}}, "pair.*Resolve 'auto'"),
        ({"type": "ZeroOneAdam", "params": {"var_freeze_step": "auto"}}, "integer.*Resolve"),
        ({"type": "OneBitAdam", "params": {"freeze_step": "auto"}}, "integer.*Resolve 'auto'"),
        ({"type": "ZeroOneAdam", "params": {"betas": [0.9]}}, "pair"),
        ({"type": "ZeroOneAdam", "params": {"var_freeze_step": 10.5}}, "integer"),
        ({"type": "ZeroOneAdam", "params": {"var_update_scaler": 0}}, "var_update_scaler"),
        ({"type": "ZeroOneAdam", "params": {"bias_correction": "yes"}}, "true or false"),
        ({"type": "Adam", "params": {}}, "not one this library implements"),
        ({"type": "OneBitLamb", "params": {}}, "not one this library implements"),
        ({"params": {}}, "no 'type'"),
        ({"optimizer": {"type": "ZeroOneAdam"}}, r"pass config\['optimizer'\]"),
        ({"type": "ZeroOneAdam", "lr": 1e-3}, "Unsupported keys in the optimizer section"),
        ({"type": "ZeroOneAdam", "params": [1, 2]}, "'params' must be a dict"),
    ],
)
def test_rejects_unsupported_keys_and_values(section, message):
    with pytest.raises(ValueError, match=message):
        ozo.from_deepspeed_config(section, axis_name=AXIS)
