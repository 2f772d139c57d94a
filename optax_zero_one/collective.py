"""The fused 1-bit compressed mean over a named axis, and the float mean it replaces.

:func:`onebit_mean` is an Optax transform whose ``update`` returns the 1-bit compressed mean of
its input tree over the workers of ``axis_name`` (``ALGORITHM.md``, "The 1-bit compressed mean
with error feedback"). The whole tree travels as one byte payload: one ``all_to_all`` (every
worker sends chunk ``j`` of every leaf, packed 8 signs per byte, plus its per-leaf scales, to
worker ``j``) and one ``all_gather`` (every server's packed signs and scales), whatever the
number of leaves.

The functional core, :func:`compressed_mean`, takes and returns the error buffers explicitly so
that the optimizers can call it on the step kinds that communicate; :func:`checked_mean` adds
the non-finite check they need.

A second backend, ``collective="psum"`` (:mod:`optax_zero_one.psum_mean`), does the same job in
one integer all-reduce of packed sign counts under a shared scale per leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_zero_one import _checks, compression, psum_mean

_COLLECTIVES = ("two_phase", "psum")


class OnebitMeanState(NamedTuple):
    """State of :func:`onebit_mean`: per-worker error-feedback buffers.

    Attributes:
      worker_error: a tree like the input; each leaf a flat float32 vector of the padded length
        ``P`` of that leaf (``"psum"`` backend: the leaf's own length; zero-size with one worker).
      server_error: a tree like the input; each leaf the float32 error of the chunk this worker
        serves, of length ``P / N`` (zero-size with one worker, and with the ``"psum"`` backend).
    """

    worker_error: optax.Updates
    server_error: optax.Updates


def axis_size(axis_name: str | None) -> int:
    """Number of workers on ``axis_name`` (``1`` for ``None``), with a clear error if unbound."""
    if axis_name is None:
        return 1
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here. Call the optimizer's update inside "
            f"jax.shard_map / jax.pmap / jax.vmap with axis_name={axis_name!r}, or pass "
            "axis_name=None for a single worker."
        ) from err


def resolve_num_workers(axis_name: str | None, num_workers: int | None) -> int:
    """The worker count at ``init``: the bound axis size, else ``num_workers``."""
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1
    ):
        raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}.")
    if axis_name is None:
        if num_workers not in (None, 1):
            raise ValueError(
                f"num_workers={num_workers} needs an axis_name to communicate over; with "
                "axis_name=None there is one worker."
            )
        return 1
    try:
        bound = lax.axis_size(axis_name)
    except NameError:
        if num_workers is None:
            raise ValueError(
                f"init was called outside a context that binds axis_name={axis_name!r}, so the "
                "number of workers is unknown. Either call init inside jax.shard_map / "
                "jax.pmap / jax.vmap(axis_name=...), or pass num_workers=N (then replicate "
                "the state over the workers yourself, e.g. with optax_zero_one.replicate)."
            ) from None
        return num_workers
    if num_workers is not None and num_workers != bound:
        raise ValueError(
            f"num_workers={num_workers} but axis {axis_name!r} has {bound} workers; they must "
            "agree (or leave num_workers=None)."
        )
    return bound


def check_float_leaves(tree: Any, what: str) -> None:
    """Rejects non-floating leaves of ``tree`` with a message naming the leaf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.asarray(leaf).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only real "
                "floating-point leaves (float32, bfloat16, float16, float64) can be compressed "
                "and optimised. Keep integer/complex arrays out of the optimised tree (e.g. "
                "with optax.masked or a separate partition)."
            )


def _error_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def check_collective(collective: str) -> None:
    """Raises ``ValueError`` unless ``collective`` names a backend of the compressed mean."""
    if collective not in _COLLECTIVES:
        raise ValueError(f"collective must be one of {_COLLECTIVES}, got {collective!r}.")


def _error_sizes(size: int, num_workers: int, collective: str) -> tuple[int, int]:
    if collective == "psum":
        return psum_mean.error_sizes(size, num_workers)
    p = compression.padded_size(size, num_workers) if num_workers > 1 else 0
    return p, p // num_workers


def init_errors(tree: Any, num_workers: int, collective: str = "two_phase") -> OnebitMeanState:
    """Zero error buffers for ``tree``, ``num_workers`` workers and the ``collective`` backend
    (zero-size when ``N == 1``)."""
    check_collective(collective)

    def buffer(leaf: Any, which: int) -> jax.Array:
        size = _error_sizes(leaf.size, num_workers, collective)[which]
        return jnp.zeros((size,), _error_dtype(leaf.dtype))

    return OnebitMeanState(
        jax.tree.map(lambda leaf: buffer(leaf, 0), tree),
        jax.tree.map(lambda leaf: buffer(leaf, 1), tree),
    )


def _check_errors(
    leaves: list[Any], errors: OnebitMeanState, num_workers: int, collective: str
) -> None:
    for leaf, ew, es in zip(
        leaves, jax.tree.leaves(errors.worker_error), jax.tree.leaves(errors.server_error)
    ):
        pw, ps = _error_sizes(leaf.size, num_workers, collective)
        if ew.shape != (pw,) or es.shape != (ps,):
            raise ValueError(
                f"The compression state does not fit {num_workers} workers and "
                f"collective={collective!r}: a leaf of {leaf.size} elements needs error buffers "
                f"of {pw} and {ps} elements, the state has {ew.shape[0]} and {es.shape[0]}. The "
                "state was initialised for another number of workers or another collective; "
                "re-initialise it (or restore a checkpoint made with the same settings)."
            )


def compressed_mean(
    tree: Any, errors: OnebitMeanState, axis_name: str | None, collective: str = "two_phase"
) -> tuple[Any, OnebitMeanState]:
    """The 1-bit compressed mean of ``tree`` over ``axis_name`` with error feedback.

    Functional core of :func:`onebit_mean` (see there for the maths). Must be called where
    ``axis_name`` is bound; identical on every worker.

    Args:
      tree: a pytree of floating arrays, this worker's values.
      errors: the error buffers, as made by :func:`init_errors` for this worker count.
      axis_name: the worker axis, or ``None`` for one worker (the identity).
      collective: the backend, ``"two_phase"`` or ``"psum"`` (see :func:`onebit_mean`).

    Returns:
      ``(mean, new_errors)``: the compressed mean, a tree like ``tree`` with its dtypes.
    """
    mean, new_errors, _ = _compressed_mean(tree, errors, axis_name, collective)
    return mean, new_errors


def checked_mean(
    tree: Any, errors: OnebitMeanState, axis_name: str | None, collective: str = "two_phase"
) -> tuple[Any, OnebitMeanState, jax.Array]:
    """:func:`compressed_mean` plus whether the mean is finite; if it is not, the old errors.

    Every worker gets the same flag. It is read from the scales that travelled anyway (a NaN or
    Inf anywhere in any worker's input makes every server's scale of that leaf non-finite), so it
    costs no extra pass over the mean and no extra round.

    Returns:
      ``(mean, errors, finite)``: ``errors`` are the new buffers where ``finite``, else ``errors``
      unchanged (restored in place by a loop that runs only when needed).
    """
    mean, new_errors, finite = _compressed_mean(tree, errors, axis_name, collective)
    restored = _checks.run_if(~finite, lambda _: errors, new_errors, like=tree)
    return mean, restored, finite


def _compressed_mean(
    tree: Any, errors: OnebitMeanState, axis_name: str | None, collective: str
) -> tuple[Any, OnebitMeanState, jax.Array]:
    """:func:`compressed_mean` and a scalar bool: whether every scale (hence the mean) is finite."""
    check_collective(collective)
    num_workers = axis_size(axis_name)
    if collective == "psum":
        psum_mean.check_num_workers(num_workers)
    leaves, treedef = jax.tree.flatten(tree)
    if jax.tree.structure(errors.worker_error) != treedef:
        raise ValueError(
            "The tree passed to the compressed mean does not have the structure of its state: "
            f"got {treedef}, state has {jax.tree.structure(errors.worker_error)}."
        )
    _check_errors(leaves, errors, num_workers, collective)
    check_float_leaves(tree, "the compressed mean's input")  # a complex part would be dropped
    if num_workers == 1:
        return tree, errors, _checks.all_finite(tree)
    if collective == "psum":
        mean, worker_error, finite = psum_mean.compressed_mean(tree, errors.worker_error, axis_name)
        mean = jax.tree.map(lambda m, x: vary_like(m, x), mean, tree)
        return mean, OnebitMeanState(worker_error, errors.server_error), finite
    n = num_workers
    worker_errors = jax.tree.leaves(errors.worker_error)
    server_errors = jax.tree.leaves(errors.server_error)
    live = [i for i, leaf in enumerate(leaves) if leaf.size > 0]
    if not live:
        return tree, errors, jnp.ones([], bool)

    # Phase 1: compress locally; chunk j of every leaf plus all scales go to worker j.
    new_worker_errors = list(worker_errors)
    packed, scales, widths = [], [], []
    for i in live:
        leaf, p = leaves[i], worker_errors[i].shape[0]
        flat = leaf.reshape(-1).astype(worker_errors[i].dtype)
        flat = jnp.pad(flat, (0, p - leaf.size))
        signs, scale, new_worker_errors[i] = compression.compress(flat, worker_errors[i])
        packed.append(compression.pack_signs(signs.reshape(n, p // n)))
        scales.append(scale[0].astype(jnp.float32))
        widths.append(p // n // 8)
    scale_bytes = compression.scales_to_bytes(jnp.stack(scales))
    payload = jnp.concatenate([*packed, jnp.broadcast_to(scale_bytes, (n, scale_bytes.size))], 1)
    received = lax.all_to_all(payload, axis_name, 0, 0, tiled=True)  # row i: from worker i

    # Server stage: average the chunk this worker serves, compress it again.
    worker_scales = compression.bytes_to_scales(received[:, -scale_bytes.size :])  # (N, L)
    new_server_errors = list(server_errors)
    out_packed, out_scales, offset = [], [], 0
    for k, (i, width) in enumerate(zip(live, widths)):
        signs = compression.unpack_signs(received[:, offset : offset + width])  # (N, P/N)
        offset += width
        es = server_errors[i]
        chunk_mean = _ordered_sum(worker_scales[:, k : k + 1].astype(es.dtype) * signs) / n
        signs2, scale2, new_server_errors[i] = compression.compress(chunk_mean, es)
        out_packed.append(compression.pack_signs(signs2))
        out_scales.append(scale2[0].astype(jnp.float32))
    reply = jnp.concatenate([*out_packed, compression.scales_to_bytes(jnp.stack(out_scales))])

    # Phase 2: every worker gathers every server's chunk and decodes the whole mean.
    gathered = lax.all_gather(reply, axis_name, axis=0, tiled=False)  # (N, B)
    server_scales = compression.bytes_to_scales(gathered[:, -scale_bytes.size :])  # (N, L)
    outputs, offset = list(leaves), 0
    for k, (i, width) in enumerate(zip(live, widths)):
        leaf = leaves[i]
        signs = compression.unpack_signs(gathered[:, offset : offset + width])  # (N, P/N)
        offset += width
        values = (server_scales[:, k : k + 1] * signs).reshape(-1)[: leaf.size]
        outputs[i] = values.reshape(leaf.shape).astype(leaf.dtype)

    new_errors = OnebitMeanState(
        jax.tree.unflatten(treedef, new_worker_errors),
        jax.tree.unflatten(treedef, new_server_errors),
    )
    finite = jnp.all(jnp.isfinite(server_scales))
    return jax.tree.unflatten(treedef, outputs), new_errors, finite


def _ordered_sum(x: jax.Array) -> jax.Array:
    """Sum over the leading (worker) axis in a fixed order, worker 0 first.

    An explicit chain of additions rather than a reduction: XLA may associate a reduction
    differently under ``vmap`` than under ``shard_map``/``pmap``, and the servers' sums must be
    bitwise identical whichever way the workers are mapped.
    """
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total


def float_mean(tree: Any, axis_name: str | None) -> Any:
    """Full-precision mean of ``tree`` over ``axis_name``: one fused float32 all-reduce.

    Leaves are averaged in float32 (or wider, if the leaf is wider) and returned in that dtype.
    """
    if axis_name is None:
        return jax.tree.map(lambda x: x.astype(_error_dtype(x.dtype)), tree)
    axis_size(axis_name)  # clear error if unbound
    wide = jax.tree.map(lambda x: x.astype(_error_dtype(x.dtype)), tree)
    return jax.tree.map(lambda m, x: vary_like(m, x), lax.pmean(wide, axis_name), wide)


def vary_like(out: jax.Array, like: jax.Array) -> jax.Array:
    """Marks ``out`` as varying over every mesh axis ``like`` varies over (``shard_map``'s
    type check; a no-op under ``vmap`` and ``pmap``).

    A ``pmean`` result is typed as replicated over the reduced axis; where it meets per-worker
    values (a loop carry, a select) it must carry the same type, including axes of a larger mesh
    that the optimizer does not reduce over (e.g. a ``"model"`` axis).
    """
    return _checks.vary_over(out, _checks.varying_axes(like))


def onebit_mean(
    axis_name: str | None,
    num_workers: int | None = None,
    collective: str = "two_phase",
) -> optax.GradientTransformationExtraArgs:
    r"""1-bit compressed mean over a named axis, with error feedback.

    Each worker ``i`` pads each leaf to ``P`` (a multiple of ``N * lcm(N, 8)``), adds its error
    and sends signs and one RMS scale per leaf; worker ``j`` averages chunk ``j`` and compresses
    it again with its own error; every worker gathers the result::

        a_i = z_i + e_i,   s_i = ||a_i|| / sqrt(P),   b_i = sign+(a_i),   e_i <- a_i - s_i b_i
        c_j = (1/N) sum_i s_i b_i[chunk j] + e'_j,  t_j = ||c_j|| / sqrt(P/N),
        out = concat_j t_j sign+(c_j),              e'_j <- c_j - t_j sign+(c_j)

    so that the running sum of outputs tracks the running sum of true means up to the bounded
    error buffers. Traffic per worker: one ``all_to_all`` and one ``all_gather`` of about
    ``P/8 (N-1)/N`` bytes each, for the whole tree (~2 bits per element, against ~64 for a
    float32 ring all-reduce). With one worker (or ``axis_name=None``) it is the identity.

    With ``collective="psum"`` the same job takes one integer all-reduce: every worker
    compresses with error feedback as above but all use the shared scale ``S = mean_i s_i``
    (summed exactly in the same all-reduce), so the psum of the workers' sign bits, packed in
    ``ceil(log2(N+1))``-bit fields of uint32 words, gives the exact mean ``S (2c - N) / N``
    (``c``: the number of positive signs) and each worker keeps ``e_i <- a_i - S sign+(a_i)``;
    no server error. ``sum(outputs) = sum(true means) - mean_i(e_i)``. About ``32 / floor(32 /
    ceil(log2(N+1)))`` bits per element in one round (4 for ``N = 8``, 8 for ``N >= 64``) and
    more accurate per call; at most 255 workers. Details in :mod:`optax_zero_one.psum_mean`.

    Chained before ``optax.sgd`` it is 1-bit SGD with error feedback.

    Args:
      axis_name: the named worker axis (bound by ``jax.shard_map``, ``jax.pmap`` or
        ``jax.vmap(axis_name=...)``), or ``None`` for a single worker.
      num_workers: the number of workers, needed only when ``init`` is called outside the
        mapped context (then replicate the state over the workers yourself).
      collective: the collective backend; ``"two_phase"`` (all-to-all then all-gather, the
        DeepSpeed-compatible scheme, the default) or ``"psum"`` (one integer all-reduce of
        sign counts under a shared scale, up to 255 workers).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`OnebitMeanState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_zero_one as ozo
      >>> tx = optax.chain(ozo.onebit_mean("w"), optax.sgd(0.1))
      >>> def step(params, grads):
      ...     state = tx.init(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates)
      >>> out = jax.vmap(step, axis_name="w")(jnp.zeros((4, 10)), jnp.ones((4, 10)))

    References:
      Tang et al., 1-bit Adam, arXiv:2102.02888; Lu et al., 0/1 Adam, arXiv:2202.06009.
    """
    if axis_name is not None and not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a str or None, got {axis_name!r}.")
    check_collective(collective)

    def init_fn(params: optax.Params) -> OnebitMeanState:
        check_float_leaves(params, "onebit_mean input")
        return init_errors(params, resolve_num_workers(axis_name, num_workers), collective)

    def update_fn(
        updates: optax.Updates,
        state: OnebitMeanState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OnebitMeanState]:
        del params, extra_args
        if num_workers is not None and axis_name is not None:
            resolve_num_workers(axis_name, num_workers)
        return compressed_mean(updates, state, axis_name, collective)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
