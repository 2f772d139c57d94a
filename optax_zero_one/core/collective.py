"""The fused 1-bit compressed mean over a named axis, and the float mean it replaces.

:func:`onebit_mean` is an Optax transform whose ``update`` returns the 1-bit compressed mean of
its input over the workers of ``axis_name`` (``docs/algorithm.md``, "The compressed mean"). The
whole tree travels as one byte payload: one ``all_to_all`` (row ``j`` of the worker-major buffer,
chunk ``j`` of every leaf packed 8 signs per byte, plus the per-leaf scales, goes to worker ``j``)
and one ``all_gather`` (every server's packed signs and scales), whatever the number of leaves.

The functional core, :func:`compressed_mean`, takes and returns the error buffers explicitly and
works on :class:`~optax_zero_one.core.flat.FlatTree` values, so that the optimizers call it on flat
buffers with no per-leaf work at all. A second backend, ``collective="psum"``
(:mod:`optax_zero_one.core.psum_mean`), does the same job in one integer all-reduce.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_zero_one.core import _checks, _graph, compression, flat, psum_mean
from optax_zero_one.core.comm import Comm, check_collective, check_hierarchy
from optax_zero_one.core.flat import FlatTree, Layout


class OnebitMeanState(NamedTuple):
    """State of :func:`onebit_mean`: this worker's error-feedback buffers.

    Attributes:
      worker_error: a :class:`~optax_zero_one.core.flat.FlatTree` of the input's layout: the error
        of this worker's compression, one entry per padded element (row ``j``: chunk ``j``).
        ``optax.EmptyState()`` when there is one worker.
      server_error: float ``(C,)``: the error of the chunk this worker serves
        (``optax.EmptyState()`` with one worker and with the ``"psum"`` backend, which has no
        server stage).

    A buffer that does not exist is an empty subtree, not a zero-size array: checkpointers
    (Orbax's among them) refuse to save zero-size arrays.
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step

    worker_error: Any
    server_error: Any

    def moved(self, every: Any, fresh: OnebitMeanState, move: Any) -> OnebitMeanState:
        """To another worker count (:func:`~optax_zero_one.reset_compression`): fresh zeros.
        A worker's residuals are its own and sized for the old count."""
        del every, move
        return fresh


def _server_width(layout: Layout, collective: str) -> int:
    """Entries of the server error: the buffer width, or none for the psum backend."""
    return 0 if collective == "psum" else layout.width


def _no_buffer() -> optax.EmptyState:
    """Where a state has no buffer: an empty subtree (a zero-size array cannot be saved)."""
    return optax.EmptyState()


def _shape(buffer: Any) -> tuple[int, ...] | None:
    """A buffer's shape, ``None`` where there is none (``optax.EmptyState()``)."""
    return None if isinstance(buffer, optax.EmptyState) else np.shape(buffer)


def init_errors(
    layout: Layout, collective: str = "two_phase", dtype: Any = jnp.float32, fast: int = 1
) -> OnebitMeanState:
    """Zero error buffers for ``layout`` (none when ``N == 1``).

    With ``fast = L > 1`` workers per node (a hierarchy, ``docs/hierarchical.md``) only the
    ``S = N / L`` nodes compress: a plain ``(S, C)`` worker error for this worker's share and a
    ``(C,)`` server error (neither with one node).
    """
    check_collective(collective)
    compressing = layout.num_workers // fast  # every worker, or the nodes
    if compressing == 1:
        return OnebitMeanState(_no_buffer(), _no_buffer())
    if fast > 1:
        width = layout.width
        return OnebitMeanState(jnp.zeros((compressing, width), dtype), jnp.zeros((width,), dtype))
    if collective == "psum":
        psum_mean.check_num_workers(layout.num_workers)
    server = _server_width(layout, collective)
    server_error = jnp.zeros((server,), dtype) if server else _no_buffer()
    return OnebitMeanState(flat.zeros(layout, dtype), server_error)


def init_state(params: Any, comm: Comm) -> OnebitMeanState:
    """The zero error buffers for ``params`` (a tree or a flat buffer) on the workers of
    ``comm``, as a transform's ``init`` makes them."""
    workers = comm.init_workers(params)
    if _checks.is_placeholder(params):  # no parameters: the state's structure only
        return _placeholder_errors(comm)
    fast = _checks.fast_size(comm.axes, comm.num_workers)
    # in the dtype the compressed mean computes in (float32, or float64 for float64 params
    # under jax_enable_x64: float32 buffers there made a conditional's branches disagree)
    dtype = flat.compute_dtype(params)
    return init_errors(flat.layout_of(params, workers), comm.collective, dtype, fast=fast)


def _placeholder_errors(comm: Comm) -> OnebitMeanState:
    """The error state's structure for ``optax.tree_map_params``, which initialises with a
    placeholder for the params and uses the result as a prefix of the real state: a leaf
    stands for a buffer (an array or a ``FlatTree``), and where the real state has no buffer
    (``optax.EmptyState()``) so does this one. Outside the workers' context without
    ``num_workers`` the worker count is not known: buffers are assumed (several workers; were
    there one, the prefix has a leaf where the state has an empty subtree, which still maps)."""
    stand_in = jnp.zeros((0,))  # never saved: a structure, not a state
    try:
        workers = _checks.resolve_num_workers(comm.axes, comm.num_workers)
        fast = _checks.fast_size(comm.axes, comm.num_workers)
    except ValueError:  # not known here
        workers, fast = None, None
    if workers is not None and workers // fast == 1:
        return OnebitMeanState(_no_buffer(), _no_buffer())
    if comm.collective == "psum" and not isinstance(comm.axes, tuple):
        return OnebitMeanState(stand_in, _no_buffer())
    return OnebitMeanState(stand_in, stand_in)


def _check_errors(layout: Layout, errors: OnebitMeanState, collective: str, fast: int) -> None:
    stored = flat.find_layout(errors)
    if stored is not None:
        layout.check(stored, "The compression state")
    if fast > 1:
        nodes = layout.num_workers // fast
        want = [None, None] if nodes == 1 else [(nodes, layout.width), (layout.width,)]
        fits = stored is None and [_shape(e) for e in errors] == want
        if not fits:
            raise ValueError(
                f"The compression state does not fit {nodes} nodes x {fast} workers per node "
                f"(shapes {[_shape(e) for e in errors]}, expected {want}). It was initialised "
                "for another split of the workers (or without fast_axis_name); re-initialise "
                "it, or restore a checkpoint made with the same axes."
            )
        return
    if layout.num_workers == 1:
        fits = stored is None and _shape(errors.worker_error) is None
    else:
        server = _server_width(layout, collective)
        fits = stored is not None and _shape(errors.server_error) == ((server,) if server else None)
    if not fits:
        raise ValueError(
            f"The compression state does not fit {layout.num_workers} workers and "
            f"collective={collective!r}. It was initialised for another number of workers or "
            "another collective; re-initialise it (or restore a checkpoint made with the same "
            "settings)."
        )


def compressed_mean(
    x: FlatTree, errors: OnebitMeanState, axis_name: _checks.Axes, collective: str = "two_phase"
) -> tuple[FlatTree, OnebitMeanState, jax.Array]:
    """The 1-bit compressed mean of ``x`` over ``axis_name``, with error feedback.

    Functional core of :func:`onebit_mean` (see there for the maths). Must be called where
    ``axis_name`` is bound; the mean is bitwise identical on every worker (all decode the same
    bytes).

    Args:
      x: this worker's values, zero in the padding of its layout.
      errors: the error buffers, as made by :func:`init_errors` for this layout.
      axis_name: the worker axis, or ``None`` for one worker (the identity), or a pair
        ``(slow, fast)``: the exact mean over ``fast``, compressed only over ``slow``
        (``docs/hierarchical.md``; two-phase backend only).
      collective: the backend, ``"two_phase"`` or ``"psum"`` (see :func:`onebit_mean`).

    Returns:
      ``(mean, new_errors, finite)``: the mean (zero in the padding), the new error buffers, and
      whether every scale, hence the mean, is finite (identical on every worker; read from the
      scales that travelled anyway, so it costs no pass over the mean).
    """
    check_collective(collective)
    layout = x.layout
    workers = _checks.axis_size(axis_name)
    slow, fast = _checks.split_axes(axis_name)
    check_hierarchy(fast, collective)
    if collective == "psum":
        psum_mean.check_num_workers(workers)
    if layout.num_workers != workers:
        raise ValueError(
            f"The values are laid out for {layout.num_workers} workers, but axis "
            f"{axis_name!r} has {workers}."
        )
    local = _checks.fast_size(axis_name)
    _check_errors(layout, errors, collective, local)
    if local > 1:
        if layout.width == 0:
            return x, errors, jnp.ones([], bool)
        mean, errors, finite = _hierarchical(x.buffer, errors, layout, slow, fast)
        return FlatTree(mean, layout), errors, finite
    axis_name = slow  # a fast axis of size 1 is the flat mean over the slow one
    if layout.num_workers == 1:
        return x, errors, _graph.all_finite(x.buffer)
    if layout.width == 0:
        return x, errors, jnp.ones([], bool)
    if collective == "psum":
        mean, worker_error, finite = psum_mean.compressed_mean(
            x.buffer, errors.worker_error.buffer, layout, axis_name
        )
        mean = _graph.vary_like(mean, x.buffer)
        return (
            FlatTree(mean, layout),
            OnebitMeanState(FlatTree(worker_error, layout), errors.server_error),
            finite,
        )
    mean, worker_error, server_error, finite = _two_phase(
        x.buffer, errors.worker_error.buffer, errors.server_error, layout, axis_name
    )
    return (
        FlatTree(mean, layout),
        OnebitMeanState(FlatTree(worker_error, layout), server_error),
        finite,
    )


def _two_phase(
    x: jax.Array, worker_error: jax.Array, server_error: jax.Array, layout: Layout, axis: str
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    gathered, worker_error, server_error = _serve(x, worker_error, server_error, layout, axis)
    mean, finite = _decode(gathered, layout, x)
    return mean, worker_error, server_error, finite


def _hierarchical(
    x: jax.Array, errors: OnebitMeanState, layout: Layout, slow: str, fast: str
) -> tuple[jax.Array, OnebitMeanState, jax.Array]:
    """The exact mean over ``fast``, 1-bit compressed over ``slow`` (``docs/hierarchical.md``).

    A reduce-scatter over the node leaves worker ``l`` of a node with rows ``l S .. l S + S - 1``
    of the node's mean (its share, 1/L of every leaf); the two-phase mean of the shares runs
    over ``slow``; an all-gather over ``fast`` of the servers' packed replies (not of the decoded
    floats: the same values for 1/32 of the bytes) lets every worker decode the whole mean.
    """
    local = lax.axis_size(fast)
    share = lax.psum_scatter(x, fast, scatter_dimension=0, tiled=True) / local
    if share.shape[0] == 1:  # one node: the exact mean, nothing compressed
        mean = lax.all_gather(share, fast, axis=0, tiled=True)
        return _graph.vary_like(mean, x), errors, _graph.all_finite(mean)
    gathered, worker_error, server_error = _serve(
        share, errors.worker_error, errors.server_error, layout, slow
    )
    gathered = lax.all_gather(gathered, fast, axis=0, tiled=True)  # row l S + j: share l, node j
    mean, finite = _decode(gathered, layout, x)
    return mean, OnebitMeanState(worker_error, server_error), finite


def _all_to_all(payload: jax.Array, axis: str) -> jax.Array:
    """``lax.all_to_all`` of the rows of ``payload`` over ``axis`` (tiled, row ``j`` to worker
    ``j``). Under ``jax.vmap``, JAX 0.10 returns a payload that does not vary over the axis
    (every worker's gradient the same and unbatched, e.g. ``jnp.ones_like`` of the params) with
    the mapped axes twice, ``(n, w, n, w)``, and the step failed deep inside the decoding (a
    bad-input trial); the payload (1/32 of the buffer's bytes) is made to vary there first.
    ``shard_map`` programs are unchanged; under ``pmap`` (no varying types in JAX 0.10 either)
    the select is lowered too, and XLA folds it away (the same compiled instructions, the same
    bits; a review)."""
    if not _graph.worker_axes(axis):  # under vmap: nothing types the payload as per worker
        payload = jnp.where(lax.axis_index(axis) >= 0, payload, jnp.zeros_like(payload))
    return lax.all_to_all(payload, axis, 0, 0, tiled=True)


def _serve(
    x: jax.Array, worker_error: jax.Array, server_error: jax.Array, layout: Layout, axis: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Phase 1 and the server stage over ``axis`` for ``x`` of ``n`` rows (the whole buffer, or
    a node's share): every server's packed chunk and scales, gathered ``(n, C/8 + 4L)``, and the
    new worker and server errors.

    The server stage runs on the blocks view (``(n, C/B, B)``; :func:`compression.compress_blocks`
    says why), phase 1 on the ``(n, C)`` buffer."""
    n, width = x.shape[0], layout.width
    in_chunk = layout.in_chunk()
    valid = in_chunk if in_chunk is True else layout.blocks(in_chunk)

    # Phase 1: compress locally; row j (chunk j of every leaf) and all scales go to worker j.
    signs, scales, worker_error = compression.compress(
        x + worker_error, layout, n * layout.chunks, in_chunk
    )
    scale_bytes = compression.scales_to_bytes(scales)
    payload = jnp.concatenate(
        [compression.pack_signs(signs), jnp.broadcast_to(scale_bytes, (n, scale_bytes.size))], 1
    )
    received = _all_to_all(payload, axis)  # row i: from worker i

    # Server stage: average the chunk this worker serves, compress it again.
    worker_scales = compression.bytes_to_scales(received[:, width // 8 :])  # (N, L)
    votes = compression.unpack_blocks(
        received[:, : width // 8], worker_scales.astype(x.dtype), layout
    )
    chunk = compression.ordered_sum(votes)[None] / n + layout.blocks(server_error)
    if valid is not True:
        chunk = jnp.where(valid, chunk, 0)
    signs2, scales2, server_error = compression.compress_blocks(chunk, layout, layout.chunks, valid)
    reply = jnp.concatenate(
        [compression.pack_blocks(signs2[0]), compression.scales_to_bytes(scales2)]
    )

    # Phase 2: every worker gathers every server's chunk.
    gathered = lax.all_gather(reply, axis, axis=0, tiled=False)  # (n, C/8 + 4L)
    return gathered, worker_error, server_error.reshape(width)


def _decode(gathered: jax.Array, layout: Layout, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The whole mean from every server's packed reply (``(N, C/8 + 4L)``), zero in the
    padding, typed like ``like``; and whether every scale is finite."""
    width = layout.width
    server_scales = compression.bytes_to_scales(gathered[:, width // 8 :])  # (N, L)
    decoded = layout.per_column(server_scales.astype(like.dtype)) * compression.unpack_signs(
        gathered[:, : width // 8], like.dtype
    )
    element = layout.is_element()
    mean = decoded if element is True else jnp.where(element, decoded, 0)
    mean = _graph.vary_like(mean, like)
    return mean, jnp.all(jnp.isfinite(server_scales))


def float_mean(x: Any, axis_name: _checks.Axes) -> Any:
    """Full-precision mean of ``x`` (a tree or a flat buffer) over ``axis_name``: one fused
    all-reduce; leaves in float32 (or wider, if a leaf is wider).

    Over a ``(slow, fast)`` pair a :class:`~optax_zero_one.core.flat.FlatTree` goes hierarchically:
    a reduce-scatter over ``fast``, an all-reduce of the 1/L share over ``slow``, an all-gather
    over ``fast``, so that the slow links carry 1/L of the buffer. Other trees take one
    all-reduce over both axes."""
    wide = jax.tree.map(lambda v: v.astype(jnp.promote_types(v.dtype, jnp.float32)), x)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not (
        len(names) in (1, 2) and all(isinstance(a, str) and a for a in names)
    ):
        raise ValueError(
            f"float_mean's axis_name must be the name (a str) of the worker axis, or a pair "
            f"(slow, fast) of names; got {axis_name!r}."
        )
    if axis_name is None:
        return wide
    workers = _checks.axis_size(axis_name)
    slow, fast = _checks.split_axes(axis_name)
    local = _checks.fast_size(axis_name)
    if isinstance(wide, FlatTree) and local > 1:
        share = lax.psum_scatter(wide.buffer, fast, scatter_dimension=0, tiled=True)
        total = lax.all_gather(lax.psum(share, slow), fast, axis=0, tiled=True)
        mean = FlatTree(total / workers, wide.layout)
    else:  # over every worker (a fast axis of size 1 adds nothing to the group)
        mean = lax.pmean(wide, axis_name if local > 1 else slow)
    return jax.tree.map(_graph.vary_like, mean, wide)


def flat_mask(mask: Any, layout: Layout, dtype: Any = jnp.float32) -> jax.Array | None:
    """A compression mask (a tree of 0/1 like the params, per leaf or per element) as a
    ``(N, C)`` (or per-column ``(1, C)``) multiplier; ``None`` for no mask."""
    if mask is None:
        return None
    leaves = jax.tree.leaves(mask)
    if all(np.ndim(m) == 0 for m in leaves):
        values = jnp.asarray([jnp.asarray(m, dtype) for m in leaves]) if leaves else None
        return None if values is None else layout.per_column(values)[None]
    full = [jnp.broadcast_to(jnp.asarray(m, dtype), s) for m, s in zip(leaves, layout.shapes)]
    return flat.to_flat(jax.tree.unflatten(layout.treedef, full), layout, dtype).buffer


def apply_mask(mask: jax.Array | None, x: FlatTree) -> FlatTree:
    """``mask * x`` for a mask made by :func:`flat_mask`."""
    return x if mask is None else FlatTree(x.buffer * mask.astype(x.buffer.dtype), x.layout)


def masked_compressed_mean(
    values: FlatTree, errors: OnebitMeanState, axis_name: _checks.Axes, collective: str, mask: Any
) -> tuple[FlatTree, OnebitMeanState, jax.Array]:
    """:func:`compressed_mean` as the transforms use it: error buffers zeroed if the mean is not
    finite (a step skipped together), then the mask applied. Returns ``(mean, errors, finite)``."""
    mean, errors, finite = compressed_mean(values, errors, axis_name, collective)
    errors = _graph.zero_unless(finite, errors)
    mean = apply_mask(flat_mask(mask, values.layout, values.buffer.dtype), mean)
    return mean, errors, finite


def onebit_mean(
    axis_name: str | None,
    num_workers: int | tuple[int, int] | None = None,
    collective: str = "two_phase",
    mask: Any = None,
    *,
    fast_axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""1-bit compressed mean over a named axis, with error feedback.

    Each worker ``i`` pads each leaf to ``P`` (a multiple of ``8 N``), adds its error
    and sends signs and one RMS scale per leaf; worker ``j`` averages chunk ``j`` and compresses
    it again with its own error; every worker gathers the result::

        a_i = z_i + e_i,   s_i = ||a_i|| / sqrt(P),   b_i = sign+(a_i),   e_i <- a_i - s_i b_i
        c_j = (1/N) sum_i s_i b_i[chunk j] + e'_j,  t_j = ||c_j|| / sqrt(P/N),
        out = concat_j t_j sign+(c_j),              e'_j <- c_j - t_j sign+(c_j)

    so that the running sum of outputs tracks the running sum of true means up to the bounded
    error buffers. Traffic per worker: one ``all_to_all`` and one ``all_gather`` of about
    ``P/8 (N-1)/N`` bytes each, for the whole tree (~2 bits per element, against ~64 for a
    float32 ring all-reduce). With one worker (or ``axis_name=None``) it is the identity.

    With ``collective="psum"`` the same job takes one integer all-reduce: all workers compress
    with the shared scale ``S = mean_i s_i`` (summed exactly in the same all-reduce) and the psum
    of their sign bits, packed in ``ceil(log2(N+1))``-bit fields, gives the exact mean
    ``S (2c - N) / N`` (``c``: the number of positive signs); no server error; at most 255
    workers (:mod:`optax_zero_one.core.psum_mean`).

    Chained before ``optax.sgd`` it is 1-bit SGD with error feedback; before ``optax.adam``,
    Adam on a 1-bit compressed gradient. Inside :func:`~optax_zero_one.flatten` (as the
    optimizers use it) the input is one flat buffer and the program does no per-leaf work.

    Args:
      axis_name: the named worker axis (bound by ``jax.shard_map``, ``jax.pmap`` or
        ``jax.vmap(axis_name=...)``), or ``None`` for a single worker.
      num_workers: the number of workers, needed only when ``init`` is called outside the
        mapped context (then replicate the state over the workers yourself).
      collective: ``"two_phase"`` (all-to-all then all-gather, DeepSpeed's scheme; the default)
        or ``"psum"`` (one integer all-reduce of sign counts under a shared scale).
      mask: optional tree of 0/1 like the input (a scalar or an array per leaf) that multiplies
        the mean, e.g. to keep rows that no gradient reaches at zero.
      fast_axis_name: a second worker axis, inside a node (fast links). Then ``axis_name`` is
        the axis across nodes and the mean is hierarchical: exact over ``fast_axis_name``
        (a float reduce-scatter), 1-bit only over ``axis_name`` on each worker's 1/L share,
        and an all-gather over ``fast_axis_name`` (``docs/hierarchical.md``). ``num_workers``
        is then a pair ``(nodes, workers per node)``. Two-phase backend only.

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
    comm = Comm.of(axis_name, fast_axis_name, num_workers, collective, mask)
    return onebit_mean_over(comm)


def onebit_mean_over(comm: Comm) -> optax.GradientTransformationExtraArgs:
    """:func:`onebit_mean` for a checked :class:`~optax_zero_one.core.comm.Comm` (what the
    compositions pass down)."""

    def init_fn(params: optax.Params) -> OnebitMeanState:
        _checks.check_float_leaves(params, "onebit_mean input")
        comm.check_mask(params)
        return _graph.worker_state(init_state(params, comm), comm.axes)

    def update_fn(updates: Any, state: OnebitMeanState, params: Any, **extra_args: Any) -> Any:
        del params
        workers = comm.update_workers(updates)
        _checks.check_float_leaves(updates, "the compressed mean's input")
        stored = flat.find_layout(state)
        if stored is not None and not isinstance(updates, FlatTree):
            stored.check_tree(updates, "updates", "the compression state")
        values, in_form = flat.as_flat(updates, workers)
        mean, new_state, _ = masked_compressed_mean(
            values, state, comm.axes, comm.collective, comm.mask
        )
        ok = extra_args.get(_graph.STEP_OK)  # a wrapper refused this step: buffers kept
        return in_form(mean), new_state if ok is None else _graph.keep_if(ok, new_state, state)

    return _checks.transformation(init_fn, update_fn, OnebitMeanState, "onebit_mean")
