"""The flat buffer is cut into leaves before its last elementwise stage (``core/_cut.py``).

Each leaf's cut replays the buffer's elementwise tail on its slices of the tail's inputs: the
same bits as cutting the whole result, with the division fused into each leaf's kernel instead
of written out whole (docs/benchmarks/overhead.md, "Reading it").
"""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_zero_one as ozo
from optax_zero_one.core import _cut, _graph

ROWS, COLS = 2, 40
CUTS = [(0, 8), (8, 20), (28, 12)]  # (first column, width) of three "leaves"


def pieces(take):
    return [take(jnp.int32(s), w) for s, w in CUTS]


def whole_then_cut(fn, args):
    buffer, rest = fn(*args)
    return pieces(lambda s, w: jax.lax.dynamic_slice_in_dim(buffer, s, w, axis=1)), rest


def ops_by_shape(fn, args, name):
    """The shapes of the ``name`` operations in the jaxpr of ``fn`` cut by ``call_and_cut``."""
    jaxpr = jax.make_jaxpr(lambda *a: _cut.call_and_cut(fn, a, pieces))(*args).jaxpr
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == name:
                found.append(eqn.outvars[0].aval.shape)
            for sub in jex.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    return found


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    m = jnp.asarray(rng.standard_normal((ROWS, COLS)), jnp.float32)
    v = jnp.asarray(rng.random((ROWS, COLS)) * 1e-3, jnp.float32)
    return m, v


def adam_direction(m, v, ok, lr):
    """The tail of the optimizers' flat updates: a guarded division scaled by the rate."""
    new_m = 0.9 * m + 0.1
    d = jnp.where(ok, new_m / (jnp.sqrt(v) + 1e-8), jnp.nan)
    return d * -lr, (new_m,)


@pytest.mark.parametrize("ok", [True, False])
def test_each_leaf_gets_the_bits_of_the_whole_buffer_cut_after(ok):
    m, v = arrays()
    args = (m, v, jnp.asarray(ok), jnp.float32(3e-3))
    got, rest = jax.jit(lambda *a: _cut.call_and_cut(adam_direction, a, pieces))(*args)
    want, want_rest = jax.jit(lambda *a: whole_then_cut(adam_direction, a))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(rest[0]), np.asarray(want_rest[0]))


def test_the_division_runs_on_each_leaf_not_on_the_whole_buffer():
    m, v = arrays()
    args = (m, v, jnp.asarray(True), jnp.float32(3e-3))
    assert sorted(ops_by_shape(adam_direction, args, "div")) == sorted((ROWS, w) for _, w in CUTS)
    # the momentum is also returned: it is computed once, whole, and sliced
    assert ops_by_shape(adam_direction, args, "add")[0] == (ROWS, COLS)


def test_a_buffer_that_is_also_returned_is_cut_as_it_is():
    def fn(m, v):
        d = m / (jnp.sqrt(v) + 1e-8)
        return d, (d,)

    m, v = arrays(1)
    got, rest = _cut.call_and_cut(fn, (m, v), pieces)
    want, _ = whole_then_cut(fn, (m, v))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert ops_by_shape(fn, (m, v), "div") == [(ROWS, COLS)]


def test_an_operation_that_is_not_elementwise_ends_the_tail():
    def fn(m, v):
        running = jnp.cumsum(m, axis=1)  # mixes columns: must see the whole buffer
        return running / (v + 1.0), ()

    m, v = arrays(2)
    got, _ = _cut.call_and_cut(fn, (m, v), pieces)
    want, _ = whole_then_cut(fn, (m, v))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sorted(ops_by_shape(fn, (m, v), "div")) == sorted((ROWS, w) for _, w in CUTS)
    assert ops_by_shape(fn, (m, v), "cumsum") == [(ROWS, COLS)]


def test_the_hinted_local_step_writes_no_direction_buffer():
    """0/1 Adam's local step writes two tree-sized flat buffers (the gradients gathered into
    the layout, the new momentum) and no third one holding ``m / (sqrt(v) + eps)``."""
    workers = 2
    tree = {"w": jnp.zeros((workers, 64, 32)), "b": jnp.zeros((workers, 32))}
    policy = ozo.VarianceDoubling(freeze_step=1, update_scaler=1)
    local = ozo.LocalStepDoubling(4, 4)
    tx = ozo.scale_by_zero_one_adam(
        1e-3, variance_policy=policy, local_step_policy=local, axis_name="w"
    )
    schedule = ozo.StepSchedule(policy, local)
    kind = next(schedule.kind(k) for k in range(1, 20) if schedule.kind(k).name == "local")
    state = jax.vmap(tx.init, axis_name="w")(tree)
    flat = jax.tree.leaves(state.inner_state)  # the flat buffers, (workers, N, C) each
    flat_shape = max((x.shape for x in flat), key=lambda s: np.prod(s))

    def step(p, s, g):
        u, s = tx.update(g, s, p, step_kind=kind)
        return optax.apply_updates(p, u), s

    fn = jax.jit(jax.vmap(step, axis_name="w"), donate_argnums=(0, 1))
    hlo = fn.lower(tree, state, tree).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    shape = "f32[" + ",".join(map(str, flat_shape)) + "]"
    written = [
        line
        for line in entry.splitlines()
        if f"= {shape}" in line and "parameter(" not in line and "bitcast(" not in line
    ]
    assert len(written) <= 2, "\n".join(written)


@pytest.mark.parametrize(
    "make",
    [
        lambda m, v: jnp.zeros_like(m),  # no input but a constant (optax.set_to_zero)
        lambda m, v: jnp.full_like(m, 2.0) * jnp.sum(v),  # a scalar reduced from the whole
        lambda m, v: jnp.where(v > 5e-4, m, -m).astype(jnp.bfloat16),  # masks, another dtype
    ],
)
def test_tails_without_array_inputs_or_with_reductions_keep_their_bits(make):
    def fn(m, v):
        jax.debug.callback(lambda x: None, jnp.sum(m))  # an operation with no output stays
        return make(m, v), ()

    m, v = arrays(3)
    got, _ = jax.jit(lambda *a: _cut.call_and_cut(fn, a, pieces))(m, v)
    want, _ = jax.jit(lambda *a: whole_then_cut(fn, a))(m, v)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_the_cut_offsets_take_each_backends_form():
    """``_graph.cut_offsets``: the layout's offsets, behind an optimisation barrier when lowered
    for CPU (one kernel per leaf shape there) and folded constants for GPU and TPU (faster to
    compile and to run on an H200); the same values either way."""
    from optax_zero_one.core import _graph

    starts = np.array([0, 8, 28])
    assert [int(x) for x in jax.jit(lambda: _graph.cut_offsets(starts))()] == [0, 8, 28]
    assert _graph.cut_offsets(np.array([], np.int32)) == []
    params = {"a": jnp.ones((8, 4)), "b": jnp.ones(3)}
    tx = ozo.flatten(optax.adam(1e-3))
    state = tx.init(params)
    traced = jax.jit(lambda g, s: tx.update(g, s, params)).trace(params, state)
    for platform, barrier in (("cpu", True), ("cuda", False), ("tpu", False)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("optimization_barrier" in text) == barrier, platform


def test_a_nested_call_with_two_outputs_or_a_buffer_constant_is_not_replayed():
    """A jitted helper in the tail that calls one with two outputs (sign and size), or that
    closes over a buffer-shaped constant: only the first output, and no constant, was sliced;
    the cut raised a KeyError or a shape error (a review). Such a call now ends the tail."""
    both = jax.jit(lambda x: (jnp.sign(x), jnp.abs(x)))
    soft_sign = jax.jit(lambda x: both(x)[0] * both(x)[1] / (1.0 + both(x)[1]))
    m, v = arrays(3)
    constant = np.asarray(v) + 1.0

    for fn in (
        lambda m, v: (-0.1 * soft_sign(m / (v + 1.0)), ()),
        lambda m, v: (jax.jit(lambda x: x * constant)(m), ()),
    ):
        got, _ = _cut.call_and_cut(fn, (m, v), pieces)
        want, _ = whole_then_cut(fn, (m, v))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_offsets_past_int32_are_an_error_not_a_wrap():
    """Column offsets were cast to int32 unchecked: past 2**31 - 1 they wrapped negative, and a
    slice clamps a negative start to 0 (a later leaf would read the first leaf's columns)."""
    np.testing.assert_array_equal(_graph.int32_starts([0, 2**31 - 1]), [0, 2**31 - 1])
    with pytest.raises(ValueError, match="past the int32 offsets"):
        _graph.int32_starts([0, 2**31])
