"""Step 3, compressed: PowerSGD (Vogels et al., NeurIPS 2019) for the bucketed DDP, the same
arithmetic as torch's powerSGD_hook, written out step by step.

    model = DistributedDataParallel(net, compress=PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=10))
    model = DistributedDataParallel(net, compress="powersgd")     # torch's defaults (rank 1, from step 1000)

Instead of all-reducing a gradient matrix M (rows x cols), each rank all-reduces two thin ones:

    P = M Q            rows x r      (Q: cols x r, orthonormal columns; random at first)
    all_reduce(P)      the sum of every rank's P; then its columns are made orthonormal
    Q = M^T P          cols x r
    all_reduce(Q) / world_size
    M ~ P Q^T          rank r: what every rank uses as the averaged gradient

so r (rows + cols) numbers travel instead of rows x cols. Per bucket, each gradient is viewed as
(its first dimension) x (the rest); one whose factors would not be `min_compression_rate` times
smaller (biases, BatchNorm: one column) goes uncompressed, all of them in one plain all_reduce.
Error feedback (`use_error_feedback`) keeps what the approximation lost on this rank and adds it
to the next step's gradient, so nothing is lost for good, only delayed; warm start (`warm_start`)
starts each step's power iteration from the last step's Q instead of a random one. For the first
`start_powerSGD_iter` steps it is plain DDP (the bucket divided by world_size, then all-reduced),
which is also when DDP settles its bucket layout.

`batched=True` is torch's batched_powerSGD_hook: the whole bucket as one square matrix (zero
padded), one P and one Q. torch 2.13's own batched_powerSGD_hook cannot run: it passes a 2-D Q to
an orthogonalization that takes only batches of matrices (AssertionError at its first compressed
step); ours orthogonalizes it as a batch of one, which is what the hook means. A bucket whose
side is less than the rank (fewer than rank^2 elements) gets rank = side, as the layerwise form
takes min(rows, cols, rank); torch's hook asserts there.

The options and their names are torch's PowerSGDState's; `numel_all_reduced` counts the elements
this rank all-reduced, plain and compressed (bytes = elements x 4 in float32).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Dict, List

import numpy as np
import torch

import collectives

from ..parts.rng import rng_state, set_rng_state


# the train CLI's --compress values that mean PowerSGD (batched: the whole bucket as one matrix)
CLI_NAMES = ("powersgd", "batched_powersgd")


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each matrix in a batch (batch x rows x r, r <= rows) orthonormal, in
    place: Gram-Schmidt for r <= 2 or half precision, else QR (as torch's hook chooses)."""
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"orthogonalize takes a batch of matrices with no more columns than rows, got {tuple(matrices.shape)}")
    r = matrices.shape[2]
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            column = matrices[:, :, i:i + 1]
            norm = torch.norm(column, dim=1, keepdim=True)
            column /= norm + epsilon if epsilon else norm
            if i + 1 < r:
                later = matrices[:, :, i + 1:]
                later -= torch.sum(column * later, dim=1, keepdim=True) * column
    else:
        r_factor = torch.empty(matrices.shape[0], r, r, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r_factor))


@dataclasses.dataclass
class PowerSGD:
    """PowerSGD's options (torch's PowerSGDState names) and its state across steps."""

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0
    batch_tensors_with_same_shape: bool = False
    batched: bool = False

    def __post_init__(self):
        if isinstance(self.matrix_approximation_rank, bool) or not isinstance(self.matrix_approximation_rank, int) \
                or self.matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGD: matrix_approximation_rank must be a whole number >= 1, "
                             f"got {self.matrix_approximation_rank!r}")
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(f"PowerSGD: start_powerSGD_iter must be at least 2 with error feedback or warm start "
                             f"(got {self.start_powerSGD_iter}): DDP settles its buckets in the first steps, and the "
                             "memories are kept per bucket")
        self.rng = np.random.RandomState(self.random_seed)  # Q's random starts: one seed drawn per bucket
        self.iter = 0  # steps done (counted at each step's last bucket)
        self.error: Dict[int, torch.Tensor] = {}  # bucket index -> what the approximation lost here
        self.p: Dict[int, torch.Tensor] = {}  # warm start: bucket index -> every P of the bucket, in one buffer
        self.q: Dict[int, torch.Tensor] = {}
        self.numel_all_reduced = 0

    @property
    def rank(self) -> int:
        return self.matrix_approximation_rank

    def state_dict(self) -> dict:
        """This rank's state across steps, for a checkpoint (tensors, numbers and dicts only): the
        step count, the random generator, and the memories (error feedback is this rank's own)."""
        return {"iter": self.iter, "rng": rng_state(self.rng), "error": dict(self.error), "p": dict(self.p),
                "q": dict(self.q)}

    def load_state_dict(self, state: dict) -> None:
        self.iter = state["iter"]
        set_rng_state(self.rng, state["rng"])
        self.error, self.p, self.q = dict(state["error"]), dict(state["p"]), dict(state["q"])

    def launch(self, bucket, group, world_size: int, last: bool):
        """Start reducing one bucket (its `buffer` holds this rank's gradients, undivided); a Work
        whose wait() leaves the averaged, decompressed gradients in the buffer."""
        if self.iter < self.start_powerSGD_iter:
            if last:
                self.iter += 1
            bucket.buffer.div_(world_size)  # then the sum: torch's allreduce hook order
            self.numel_all_reduced += bucket.buffer.numel()
            return collectives.all_reduce(bucket.buffer, group=group, async_op=True)
        return (_Square if self.batched else _Layerwise)(self, bucket, group, world_size, last)

    def _error_feedback(self, key: int, flat: torch.Tensor):
        """Add last step's loss to `flat`; a copy of the sum, to compute this step's loss from."""
        if not self.use_error_feedback:
            return None
        if key in self.error:
            flat.add_(self.error[key])
        else:
            self.error[key] = torch.zeros_like(flat)
        return flat.detach().clone()

    def _random_start(self, qs: List[torch.Tensor]) -> None:
        """Fill each Q with normal values from a seed this bucket draws (the CPU generator, whatever
        the device, so every rank draws the same), without touching torch's global generator."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=q.dtype))


class _Step:
    """One bucket's compressed reduction under way, as DDP waits for it: wait() finishes it."""

    def get_future(self):
        return None  # several collectives, no single completion to show on a timeline


class _Layerwise(_Step):
    """powerSGD_hook: each gradient worth compressing is its own matrix (or a batch of the ones of
    one shape, with batch_tensors_with_same_shape)."""

    def __init__(self, state: PowerSGD, bucket, group, world_size: int, last: bool):
        self.state, self.group, self.world_size, self.last, self.key = state, group, world_size, last, bucket.index
        self.buffer = bucket.buffer
        self.before = state._error_feedback(self.key, self.buffer)
        matrices, self.plain = [], []
        p_size = q_size = 0
        for grad in bucket.views:
            m = grad.view(grad.shape[0], -1)
            rows, cols = m.shape
            r = min(rows, cols, state.rank)
            if (rows + cols) * r * state.min_compression_rate < rows * cols:
                matrices.append(m)
                p_size, q_size = p_size + rows * r, q_size + cols * r
            else:
                self.plain.append(grad)
        self.plain_flat = torch.cat([g.view(-1) for g in self.plain]) if self.plain else self.buffer.new_empty(0)
        fresh = not state.warm_start or self.key not in state.p
        if fresh:
            self.p, self.q = self.buffer.new_empty(p_size), self.buffer.new_empty(q_size)
        else:
            self.p, self.q = state.p[self.key], state.q[self.key]
        if state.warm_start:  # kept for the next step's power iteration
            state.p[self.key], state.q[self.key] = self.p, self.q
        self.by_shape: Dict[torch.Size, List[torch.Tensor]] = defaultdict(list)
        for m in matrices:
            self.by_shape[m.shape].append(m)
        self.batches = [b for ms in self.by_shape.values() for b in self._batches(ms)]
        self.ps, self.qs = self._views(self.p, 1), self._views(self.q, 2)
        if fresh:
            state._random_start(self.qs)
        for q in self.qs:
            orthogonalize(q, state.orthogonalization_epsilon)
        for m, q, p in zip(self.batches, self.qs, self.ps):
            torch.bmm(m, q, out=p)  # P = M Q
        state.numel_all_reduced += self.plain_flat.numel() + p_size + q_size
        self.plain_work = collectives.all_reduce(self.plain_flat, group=group, async_op=True)

    def _batches(self, ms: List[torch.Tensor]):
        if self.state.batch_tensors_with_same_shape:
            return [ms[0].unsqueeze(0) if len(ms) == 1 else torch.stack(ms)]
        return [m.unsqueeze(0) for m in ms]

    def _views(self, memory: torch.Tensor, side: int) -> List[torch.Tensor]:
        """Each batch's P (side 1: rows x r) or Q (side 2: cols x r), in order, in one buffer."""
        out, at = [], 0
        for b in self.batches:
            n, length = b.shape[0], b.shape[side]
            r = min(b.shape[1], b.shape[2], self.state.rank)
            out.append(memory[at:at + n * length * r].view(n, length, r))
            at += n * length * r
        return out

    def wait(self) -> None:
        state, key = self.state, self.key
        self.plain_work.wait()
        self.plain_flat.div_(self.world_size)
        at = 0
        for g in self.plain:
            g.copy_(self.plain_flat[at:at + g.numel()].view_as(g))
            at += g.numel()
        collectives.all_reduce(self.p, group=self.group)
        for p in self.ps:
            orthogonalize(p, state.orthogonalization_epsilon)
        for m, p, q in zip(self.batches, self.ps, self.qs):
            torch.bmm(m.transpose(1, 2), p, out=q)  # Q = M^T P
        collectives.all_reduce(self.q, group=self.group)
        self.q.div_(self.world_size)
        for p, q, m in zip(self.ps, self.qs, self.batches):
            torch.bmm(p, q.transpose(1, 2), out=m)  # M ~ P Q^T
        if state.batch_tensors_with_same_shape:  # stacked copies: back into the bucket
            for b in self.batches:
                if b.shape[0] > 1:
                    for original, approx in zip(self.by_shape[b.shape[1:]], b):
                        original.copy_(approx)
        _finish(state, key, self.before, self.buffer, self.last)


class _Square(_Step):
    """batched_powerSGD_hook: the whole bucket, zero padded to side x side, one P and one Q."""

    def __init__(self, state: PowerSGD, bucket, group, world_size: int, last: bool):
        self.state, self.group, self.world_size, self.last, self.key = state, group, world_size, last, bucket.index
        self.buffer = bucket.buffer
        n = self.buffer.numel()
        side = math.ceil(math.sqrt(n))
        self.padded = self.buffer.new_zeros(side * side)
        self.padded[:n] = self.buffer
        self.before = state._error_feedback(self.key, self.padded)
        self.matrix = self.padded.view(side, side)
        r = min(side, state.rank)  # a bucket of fewer than rank^2 elements: every column it has
        if not state.warm_start or self.key not in state.p:
            self.p, self.q = self.buffer.new_empty(side, r), self.buffer.new_empty(side, r)
            state._random_start([self.q])
        else:
            self.p, self.q = state.p[self.key], state.q[self.key]
        if state.warm_start:  # kept for the next step's power iteration
            state.p[self.key], state.q[self.key] = self.p, self.q
        orthogonalize(self.q.unsqueeze(0))  # torch's hook passes no epsilon here
        torch.matmul(self.matrix, self.q, out=self.p)
        state.numel_all_reduced += 2 * side * r
        self.p_work = collectives.all_reduce(self.p, group=group, async_op=True)

    def wait(self) -> None:
        state, key = self.state, self.key
        self.p_work.wait()
        orthogonalize(self.p.unsqueeze(0))
        torch.matmul(self.matrix.t(), self.p, out=self.q)
        collectives.all_reduce(self.q, group=self.group)
        self.q.div_(self.world_size)
        torch.matmul(self.p, self.q.t(), out=self.matrix)
        self.buffer.copy_(self.padded[:self.buffer.numel()])
        _finish(state, key, self.before, self.padded, self.last)


def _finish(state: PowerSGD, key: int, before, now: torch.Tensor, last: bool) -> None:
    """After a bucket: keep what the approximation lost (error feedback), count the step at its
    last bucket. Without warm start P and Q live in the bucket's step alone: torch's hook clears
    its dicts of every bucket here, which would pull them from under a bucket still in flight."""
    if state.use_error_feedback:
        state.error[key] = before - now
    if last:
        state.iter += 1


def compressed_numel(rows: int, cols: int, rank: int) -> int:
    """Elements all-reduced for one compressed rows x cols gradient: r (rows + cols), r = min(rows, cols, rank)."""
    return min(rows, cols, rank) * (rows + cols)
