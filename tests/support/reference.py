"""Independent float64 NumPy references of the algorithms (``docs/algorithm.md``), for the tests.

This module is written from the specification alone (it imports nothing from
``optax_zero_one``), so that the library can be checked against it. It favours being
literal over being fast: the ``N`` data-parallel workers are simulated explicitly, each with
its own arrays, and the collectives (float all-reduce, all-to-all, all-gather) are explicit
Python loops over workers and chunks. Everything is float64.

Conventions:

- A pytree is a plain list of leaves (NumPy arrays of any shape, scalars included).
- Per-worker quantities are indexed ``[worker][leaf]``.
- Steps are numbered ``k = 1, 2, ...``; the learning rate of step ``k`` is
  ``schedule(k - 1)`` (the optax ``count`` before the update).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

LearningRate = float | Callable[[int], float]


def padded_size(n: int, num_workers: int) -> int:
    """Smallest multiple of ``8 N`` that is ``>= n`` (``0`` for ``n == 0``)."""
    if n < 0 or num_workers < 1:
        raise ValueError(f"bad arguments n={n}, num_workers={num_workers}")
    unit = 8 * num_workers
    return -(-n // unit) * unit


def _sign_plus(a: np.ndarray) -> np.ndarray:
    """Signs in {+1, -1}, with zero mapped to +1."""
    return np.where(a >= 0, 1.0, -1.0)


def _pack(signs: np.ndarray) -> np.ndarray:
    """Packs +-1 signs 8 per byte (bit 1 means +1), as they travel on the wire."""
    assert signs.size % 8 == 0, "every chunk must be a whole number of bytes"
    return np.packbits(signs > 0)


def _unpack(packed: np.ndarray) -> np.ndarray:
    """Inverse of ``_pack``."""
    return np.where(np.unpackbits(packed) == 1, 1.0, -1.0)


def _rms(a: np.ndarray) -> float:
    """``||a||_2 / sqrt(len(a))``."""
    return float(np.linalg.norm(a) / math.sqrt(a.size))


class CompressedMean:
    """The 1-bit compressed mean C with error feedback, for N workers over a list of leaves.

    Attributes:
        worker_error: ``[worker][leaf]``, shape ``(P_leaf,)``, the worker error ``e_w``.
        server_error: ``[worker][leaf]``, shape ``(P_leaf // N,)``, worker ``j``'s server
            error ``e_s`` for chunk ``j``.
        last_padded_outputs: ``[worker][leaf]``, shape ``(P_leaf,)``, the padded output each
            worker assembled in the last call (for ``N > 1`` and non-empty leaves; with
            ``N == 1`` it is the padded input).
    """

    def __init__(self, shapes: list[tuple[int, ...]], num_workers: int):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.padded = [padded_size(n, num_workers) for n in self.sizes]
        self.worker_error: list[list[np.ndarray]] = []
        self.server_error: list[list[np.ndarray]] = []
        self.last_padded_outputs: list[list[np.ndarray]] = []
        self.reset()

    def reset(self) -> None:
        """Zeros both error buffers (of every worker)."""
        n_workers = self.num_workers
        self.worker_error = [[np.zeros(p) for p in self.padded] for _ in range(n_workers)]
        self.server_error = [
            [np.zeros(p // n_workers) for p in self.padded] for _ in range(n_workers)
        ]

    def __call__(self, zs: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Compressed mean of ``zs[worker][leaf]``; returns one leaf-shaped array per leaf."""
        n_workers = self.num_workers
        assert len(zs) == n_workers, "one list of leaves per worker"
        for z in zs:
            assert len(z) == len(self.shapes), "one array per leaf"

        # Per worker, per leaf: the padded output that worker ends up with.
        padded_out: list[list[np.ndarray]] = [[] for _ in range(n_workers)]
        for leaf, (n, p) in enumerate(zip(self.sizes, self.padded, strict=True)):
            # Step 1: flatten and pad every worker's input with zeros to length P.
            z_pad = []
            for i in range(n_workers):
                flat = np.asarray(zs[i][leaf], dtype=np.float64).reshape(-1)
                assert flat.size == n, f"leaf {leaf}: expected {n} elements, got {flat.size}"
                z_pad.append(np.concatenate([flat, np.zeros(p - n)]))

            if n_workers == 1 or p == 0:
                # Nothing to communicate (N == 1) or nothing to send (empty leaf).
                for i in range(n_workers):
                    padded_out[i].append(z_pad[0].copy() if n_workers == 1 else np.zeros(0))
                continue

            chunk = p // n_workers

            # Step 2: on every worker, add its error, compress to scale * signs.
            worker_scales = []
            worker_packed_chunks = []  # [i][j]: worker i's packed signs of chunk j
            for i in range(n_workers):
                a = z_pad[i] + self.worker_error[i][leaf]
                s = _rms(a)  # RMS over the padded length P
                b = _sign_plus(a)
                self.worker_error[i][leaf] = a - s * b
                worker_scales.append(s)
                worker_packed_chunks.append(
                    [_pack(b[j * chunk : (j + 1) * chunk]) for j in range(n_workers)]
                )

            # Step 3, phase 1: all-to-all. Worker j receives chunk j from every worker i,
            # and every worker's scale.
            received = [
                [worker_packed_chunks[i][j] for i in range(n_workers)] for j in range(n_workers)
            ]
            received_scales = [list(worker_scales) for _ in range(n_workers)]

            # Step 4: worker j is the server of chunk j.
            server_scales = []
            server_packed = []
            for j in range(n_workers):
                total = np.zeros(chunk)
                for i in range(n_workers):
                    total += received_scales[j][i] * _unpack(received[j][i])
                c = total / n_workers
                c_prime = c + self.server_error[j][leaf]
                t = _rms(c_prime)  # RMS over the chunk length P / N
                b_prime = _sign_plus(c_prime)
                self.server_error[j][leaf] = c_prime - t * b_prime
                server_scales.append(t)
                server_packed.append(_pack(b_prime))

            # Step 5, phase 2: all-gather of every server's packed signs and scale; every
            # worker concatenates t_j * b'_j over j.
            for r in range(n_workers):
                gathered = [(server_scales[j], server_packed[j]) for j in range(n_workers)]
                padded_out[r].append(np.concatenate([t * _unpack(bp) for t, bp in gathered]))

        self.last_padded_outputs = padded_out
        return [
            padded_out[0][leaf][:n].reshape(shape)
            for leaf, (n, shape) in enumerate(zip(self.sizes, self.shapes, strict=True))
        ]


class HierarchicalMean:
    """The hierarchical mean for ``nodes x local`` workers (worker ``s * local + l`` is device
    ``l`` of node ``s``): exact inside each node, 1-bit compressed across nodes.

    Each leaf is padded to ``P`` for all ``N = nodes * local`` workers and cut into ``local``
    shares of ``P / local``. Device ``l`` of every node holds share ``l`` of its node's exact
    mean; share ``l`` is averaged over the nodes by its own :class:`CompressedMean` of ``nodes``
    workers (so every share of every leaf has its own scales and error buffers); every worker
    ends with the concatenated shares.

    Attributes:
        shares: ``[leaf][l]``: the :class:`CompressedMean` of share ``l`` (``None`` for an empty
            leaf).
    """

    def __init__(self, shapes: list[tuple[int, ...]], nodes: int, local: int):
        self.nodes, self.local = nodes, local
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.padded = [padded_size(n, nodes * local) for n in self.sizes]
        self.shares = [
            [CompressedMean([(p // local,)], nodes) for _ in range(local)] if p else None
            for p in self.padded
        ]

    def __call__(self, zs: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The mean of ``zs[worker][leaf]``, identical on every worker; one array per leaf."""
        out = []
        for leaf, (n, p, shape) in enumerate(zip(self.sizes, self.padded, self.shapes)):
            if p == 0:
                out.append(np.zeros(shape))
                continue
            node_means = []
            for s in range(self.nodes):
                rows = [
                    np.asarray(zs[s * self.local + j][leaf], np.float64).reshape(-1)
                    for j in range(self.local)
                ]
                node_means.append(np.concatenate([np.mean(rows, axis=0), np.zeros(p - n)]))
            width = p // self.local
            pieces = []
            for i, mean in enumerate(self.shares[leaf]):
                share = [[m[i * width : (i + 1) * width]] for m in node_means]
                mean(share)
                pieces.append(mean.last_padded_outputs[0][0])
            out.append(np.concatenate(pieces)[:n].reshape(shape))
        return out


# --------------------------------------------------------------------------------------
# Schedules (pure functions of the counters).


def variance_steps(var_freeze_step: int, var_update_scaler: int, num_steps: int) -> list[int]:
    """The steps ``k`` in ``1..min(num_steps, F)`` that are variance steps of 0/1 Adam."""
    var_interval, var_counter = 1, 0
    steps = []
    for k in range(1, min(num_steps, var_freeze_step) + 1):
        if k % var_interval == 0:
            steps.append(k)
            var_counter += 1
            if var_counter == var_update_scaler:
                var_counter = 0
                var_interval *= 2
    return steps


def sync_steps(
    var_freeze_step: int, local_step_scaler: int, local_step_clipper: int, num_steps: int
) -> list[int]:
    """The steps ``k`` in ``F+1..num_steps`` that are sync steps of 0/1 Adam."""
    local_interval, local_counter = 1, 0
    steps = []
    for k in range(var_freeze_step + 1, num_steps + 1):
        if k % local_interval == 0:
            steps.append(k)
        local_counter += 1
        if local_counter == local_step_scaler:
            local_counter = 0
            local_interval = min(local_step_clipper, 2 * local_interval)
    return steps


# --------------------------------------------------------------------------------------
# Optimizers.


def _copy_params(params: list[np.ndarray], num_workers: int) -> list[list[np.ndarray]]:
    return [[np.array(p, dtype=np.float64) for p in params] for _ in range(num_workers)]


def _zeros_like_params(params: list[np.ndarray], num_workers: int) -> list[list[np.ndarray]]:
    return [[np.zeros(np.shape(p)) for p in params] for _ in range(num_workers)]


def _as_grads(grads: list[list[np.ndarray]], num_workers: int, num_leaves: int):
    assert len(grads) == num_workers, "one list of gradient leaves per worker"
    out = []
    for g in grads:
        assert len(g) == num_leaves, "one gradient per leaf"
        out.append([np.asarray(x, dtype=np.float64) for x in g])
    return out


def _lr(learning_rate: LearningRate, k: int) -> float:
    """Learning rate of step ``k``: ``schedule(k - 1)``."""
    return float(learning_rate(k - 1)) if callable(learning_rate) else float(learning_rate)


def _float_mean(grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Full-precision all-reduce mean over workers, per leaf."""
    n_workers = len(grads)
    means = []
    for leaf in range(len(grads[0])):
        total = np.zeros_like(grads[0][leaf])
        for i in range(n_workers):
            total = total + grads[i][leaf]
        means.append(total / n_workers)
    return means


def _apply_mask(mask: list[np.ndarray] | None, leaves: list[np.ndarray]) -> list[np.ndarray]:
    if mask is None:
        return leaves
    return [mk * x for mk, x in zip(mask, leaves, strict=True)]


def _direction(m: np.ndarray, v: np.ndarray, eps: float) -> np.ndarray:
    """``m / (sqrt(v) + eps)``, 0 where ``v`` is 0: a coordinate no gradient has reached at a
    variance step does not move by its momentum (DeepSpeed divides by ``eps`` there: see
    docs/algorithm.md, "Where we differ from DeepSpeed")."""
    return np.where(v > 0, m / (np.sqrt(v) + eps), 0.0)


class ZeroOneAdam:
    """0/1 Adam over ``N`` simulated workers (``docs/algorithm.md``, "0/1 Adam")."""

    def __init__(
        self,
        params: list[np.ndarray],
        num_workers: int,
        learning_rate: LearningRate,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32_678,
        local_step_clipper: int = 16,
        mask: list[np.ndarray] | None = None,
    ):
        self.num_workers = num_workers
        self.learning_rate = learning_rate
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.mask = None if mask is None else [np.asarray(mk, dtype=np.float64) for mk in mask]
        self.num_leaves = len(params)

        self.x = _copy_params(params, num_workers)
        self.m = _zeros_like_params(params, num_workers)
        self.v = _zeros_like_params(params, num_workers)
        self.u = _zeros_like_params(params, num_workers)
        self.lrs = [0.0] * num_workers
        self.compressor = CompressedMean([np.shape(p) for p in params], num_workers)
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0
        self.step_count = 0
        self.last_kind = ""

    def _denominator(self, i: int, leaf: int) -> np.ndarray:
        return np.sqrt(self.v[i][leaf]) + self.eps

    def step(self, grads: list[list[np.ndarray]]) -> None:
        """One update; ``grads[worker][leaf]`` are the workers' local gradients."""
        n_workers, n_leaves = self.num_workers, self.num_leaves
        grads = _as_grads(grads, n_workers, n_leaves)
        k = self.step_count + 1
        lr = _lr(self.learning_rate, k)
        b1, b2, wd = self.b1, self.b2, self.weight_decay

        if k <= self.var_freeze_step:
            # Phase A: variance still adapting.
            if k % self.var_interval == 0:
                gbar = _float_mean(grads)
                for i in range(n_workers):
                    for leaf in range(n_leaves):
                        self.m[i][leaf] = b1 * self.m[i][leaf] + (1 - b1) * gbar[leaf]
                        self.v[i][leaf] = b2 * self.v[i][leaf] + (1 - b2) * gbar[leaf] ** 2
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
                self.last_kind = "variance"
            else:
                ghat = _apply_mask(self.mask, self.compressor(grads))
                for i in range(n_workers):
                    for leaf in range(n_leaves):
                        self.m[i][leaf] = b1 * self.m[i][leaf] + (1 - b1) * ghat[leaf]
                self.last_kind = "compressed"
            for i in range(n_workers):
                for leaf in range(n_leaves):
                    x = self.x[i][leaf]
                    d = _direction(self.m[i][leaf], self.v[i][leaf], self.eps) + wd * x
                    self.x[i][leaf] = x - lr * d
            if k == self.var_freeze_step:
                # Variance freezes; the error buffers will now hold accumulator errors.
                self.compressor.reset()
        else:
            # Phase B: variance frozen, local steps with no communication.
            for i in range(n_workers):
                for leaf in range(n_leaves):
                    self.m[i][leaf] = b1 * self.m[i][leaf] + (1 - b1) * grads[i][leaf]
                    x = self.x[i][leaf]
                    d = _direction(self.m[i][leaf], self.v[i][leaf], self.eps) + wd * x
                    self.x[i][leaf] = x - lr * d
                    self.u[i][leaf] = self.u[i][leaf] + lr * d
                self.lrs[i] += lr
            if k % self.local_interval == 0:
                for i in range(n_workers):
                    for leaf in range(n_leaves):
                        self.x[i][leaf] = self.x[i][leaf] + self.u[i][leaf]
                w = [
                    [self.u[i][leaf] * self._denominator(i, leaf) for leaf in range(n_leaves)]
                    for i in range(n_workers)
                ]
                what = _apply_mask(self.mask, self.compressor(w))
                for i in range(n_workers):
                    for leaf in range(n_leaves):
                        self.m[i][leaf] = what[leaf] / self.lrs[i]
                        self.x[i][leaf] = self.x[i][leaf] - _direction(
                            what[leaf], self.v[i][leaf], self.eps
                        )
                        self.u[i][leaf] = np.zeros_like(self.u[i][leaf])
                    self.lrs[i] = 0.0
                self.last_kind = "sync"
            else:
                self.last_kind = "local"
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)
        self.step_count = k


class OnebitAdam:
    """1-bit Adam over ``N`` simulated workers (``docs/algorithm.md``, "1-bit Adam")."""

    def __init__(
        self,
        params: list[np.ndarray],
        num_workers: int,
        learning_rate: LearningRate,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100_000,
        mask: list[np.ndarray] | None = None,
    ):
        self.num_workers = num_workers
        self.learning_rate = learning_rate
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.freeze_step = freeze_step
        self.mask = None if mask is None else [np.asarray(mk, dtype=np.float64) for mk in mask]
        self.num_leaves = len(params)

        self.x = _copy_params(params, num_workers)
        self.m = _zeros_like_params(params, num_workers)
        self.v = _zeros_like_params(params, num_workers)
        self.compressor = CompressedMean([np.shape(p) for p in params], num_workers)
        self.step_count = 0
        self.last_kind = ""

    def step(self, grads: list[list[np.ndarray]]) -> None:
        """One update; ``grads[worker][leaf]`` are the workers' local gradients."""
        n_workers, n_leaves = self.num_workers, self.num_leaves
        grads = _as_grads(grads, n_workers, n_leaves)
        k = self.step_count + 1
        lr = _lr(self.learning_rate, k)
        b1, b2, wd = self.b1, self.b2, self.weight_decay

        if k <= self.freeze_step:
            gbar = _float_mean(grads)
            for i in range(n_workers):
                for leaf in range(n_leaves):
                    self.m[i][leaf] = b1 * self.m[i][leaf] + (1 - b1) * gbar[leaf]
                    self.v[i][leaf] = b2 * self.v[i][leaf] + (1 - b2) * gbar[leaf] ** 2
            self.last_kind = "warmup"
        else:
            local_m = [
                [b1 * self.m[i][leaf] + (1 - b1) * grads[i][leaf] for leaf in range(n_leaves)]
                for i in range(n_workers)
            ]
            m_hat = _apply_mask(self.mask, self.compressor(local_m))
            for i in range(n_workers):
                for leaf in range(n_leaves):
                    self.m[i][leaf] = m_hat[leaf].copy()
            self.last_kind = "compressed"
        for i in range(n_workers):
            for leaf in range(n_leaves):
                x = self.x[i][leaf]
                d = _direction(self.m[i][leaf], self.v[i][leaf], self.eps) + wd * x
                self.x[i][leaf] = x - lr * d
        self.step_count = k


class DiLoCo:
    """DiLoCo over ``N`` simulated workers (Douillard et al., arXiv:2311.08105, Algorithm 1),
    written from the paper: every worker runs AdamW (optax's: bias-corrected moments, decoupled
    weight decay) on its own gradients; every ``sync_every`` steps the workers average their
    distance to the last synchronised point, ``delta = mean_i(xbar - x_i)`` (exactly, or through
    :class:`CompressedMean` with ``compressed``), and Nesterov momentum moves ``xbar``:
    ``t <- delta + mu t;  xbar <- xbar - lr_out (delta + mu t)``; every worker restarts there.
    """

    def __init__(
        self,
        params: list[np.ndarray],
        num_workers: int,
        inner_lr: float,
        outer_lr: float,
        outer_momentum: float,
        sync_every: int,
        compressed: bool = False,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        self.num_workers, self.num_leaves = num_workers, len(params)
        self.inner_lr, self.outer_lr, self.outer_momentum = inner_lr, outer_lr, outer_momentum
        self.sync_every = sync_every
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.x = _copy_params(params, num_workers)
        self.anchor = [np.array(p, dtype=np.float64) for p in params]
        self.m = _zeros_like_params(params, num_workers)
        self.v = _zeros_like_params(params, num_workers)
        self.trace = [np.zeros(np.shape(p)) for p in params]
        self.compressor = (
            CompressedMean([np.shape(p) for p in params], num_workers) if compressed else None
        )
        self.step_count = 0
        self.last_kind = ""

    def step(self, grads: list[list[np.ndarray]]) -> None:
        """One inner step on every worker (``grads[worker][leaf]``), then the outer step if due."""
        grads = _as_grads(grads, self.num_workers, self.num_leaves)
        k = self.step_count + 1
        b1, b2 = self.b1, self.b2
        for i in range(self.num_workers):
            for leaf in range(self.num_leaves):
                g, x = grads[i][leaf], self.x[i][leaf]
                self.m[i][leaf] = b1 * self.m[i][leaf] + (1 - b1) * g
                self.v[i][leaf] = b2 * self.v[i][leaf] + (1 - b2) * g**2
                m_hat = self.m[i][leaf] / (1 - b1**k)
                v_hat = self.v[i][leaf] / (1 - b2**k)
                d = m_hat / (np.sqrt(v_hat) + self.eps) + self.weight_decay * x
                self.x[i][leaf] = x - self.inner_lr * d
        self.last_kind = "local"
        if k % self.sync_every == 0:
            u = [
                [self.anchor[leaf] - self.x[i][leaf] for leaf in range(self.num_leaves)]
                for i in range(self.num_workers)
            ]
            delta = _float_mean(u) if self.compressor is None else self.compressor(u)
            for leaf in range(self.num_leaves):
                self.trace[leaf] = delta[leaf] + self.outer_momentum * self.trace[leaf]
                nesterov = delta[leaf] + self.outer_momentum * self.trace[leaf]
                self.anchor[leaf] = self.anchor[leaf] - self.outer_lr * nesterov
            self.x = [[a.copy() for a in self.anchor] for _ in range(self.num_workers)]
            self.last_kind = "sync"
        self.step_count = k


# --------------------------------------------------------------------------------------------
# The psum backend (``collective="psum"``): every worker uses the mean of the workers' scales.


class PsumReference:
    """``N`` explicit workers; the psum is a Python sum of their 0/1 signs and float32 scales."""

    def __init__(self, shapes, num_workers):
        self.n = num_workers
        self.sizes = [math.prod(s) for s in shapes]
        self.shapes = shapes
        self.errors = [[np.zeros(s) for s in self.sizes] for _ in range(num_workers)]
        self.scales = []

    def __call__(self, zs):
        """``zs[worker][leaf]`` -> the mean every worker receives, one array per leaf."""
        n, outs, self.scales = self.n, [], []
        for leaf, (size, shape) in enumerate(zip(self.sizes, self.shapes)):
            if n == 1 or size == 0:
                outs.append(np.asarray(zs[0][leaf], np.float64).reshape(shape))
                continue
            a = [np.asarray(zs[i][leaf], np.float64).reshape(-1) + self.errors[i][leaf]
                 for i in range(n)]  # fmt: skip
            wire = [np.float32(np.linalg.norm(x) / math.sqrt(size)) for x in a]  # float32 scales
            shared = math.fsum(float(s) for s in wire) / n  # their exact mean
            positive = [x >= 0 for x in a]
            count = sum(p.astype(np.int64) for p in positive)
            outs.append((shared * (2 * count - n) / n).reshape(shape))
            for i in range(n):
                self.errors[i][leaf] = a[i] - shared * np.where(positive[i], 1.0, -1.0)
            self.scales.append(shared)
        return outs
