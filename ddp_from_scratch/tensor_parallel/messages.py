"""When tensor or pipeline parallelism pays: the messages of one training step of the small
transformer under DP, TP, TP x DP and PP x DP, in closed form, and their time under the
alpha-beta-gamma model the project fits (collectives/algorithms/cost.py).

    from collectives.algorithms.cost import CostModel
    shape = Shape(vocab=256, hidden=64, heads=4, layers=2, tokens=512)   # tokens: batch x seq, the whole step
    plan = step_messages(shape, world_size=4, tp=4)                       # TP over 4 ranks
    plan.elements, plan.seconds(CostModel.load())

Per step, on p ranks, for L blocks of hidden size h, vocabulary V and T tokens in the global batch:

    DP      one all_reduce of the gradients, in buckets: P = 2Vh + L(12h^2 + 13h) + 2h elements
    TP      every rank the whole batch: (2L + 1) all_reduces of T h forward (the embedding, after
            each attention and MLP) and 3 of T (the cross-entropy), (2L + 1) of T h backward
    TP x DP TP over t ranks on T / (p / t) tokens, then DP over p / t ranks of the P / t
            elements each rank holds (its shards; the LayerNorms whole)
    PP x DP s stages, m microbatches of the T / d tokens of each of the d = p / s replicas: a stage
            sends its output forward and its input's gradient back, one point-to-point message
            of T h / (d m) elements a microbatch each way (an inner stage both, the first and
            the last one); then DP over d ranks of the stage's P / s elements (the cut balances
            parameters). And the bubble: (s-1)/(m+s-1) of the step's compute idles (1F1B).

A ring all_reduce of N elements sends 2 (p - 1) / p N per rank either way, so TP sends fewer bytes
than DP when (4L + 2) T h < P, roughly T < 3h for a deep model: the tokens of a step (per TP
group) fewer than three times the hidden size. Bytes are not all of it: TP's 4L + 5 messages a
step each cost the latency alpha and sit on the critical path (a layer waits for its all_reduce),
where DP's buckets are few and overlap the backward. TP pays when the model does not fit one
rank (it holds 1/t of the weights, gradients and optimizer state), or when activations are small
against weights: wide layers, few tokens per step.

A pipeline's stage sends 2 T h / d elements a step where a DP rank all-reduces about 2 P: it sends
fewer bytes than DP while the tokens per replica stay under P / h (pipeline_break_even_tokens),
and each message is one alpha, not on every layer as TP's are. What it pays instead is the
bubble: compute, not messages, which more microbatches shrink.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple

FLOAT32 = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    heads: int
    layers: int
    tokens: int  # batch x seq of the whole step (every DP rank's share together)

    def parameters(self) -> int:
        """The small transformer's parameters (workload/transformer.py): the embedding and the untied
        head V h each, per block two LayerNorms (4h), q, k, v and out (4(h^2 + h)) and the MLP
        (8h^2 + 5h), and the last LayerNorm (2h)."""
        v, h, layers = self.vocab, self.hidden, self.layers
        return 2 * v * h + layers * (12 * h * h + 13 * h) + 2 * h

    def whole_on_every_tp_rank(self) -> int:
        """What TP does not split: the LayerNorms' weights and biases, and the biases of the row-parallel
        layers (attention's out, the MLP's down-projection)."""
        return self.layers * (4 * self.hidden + 2 * self.hidden) + 2 * self.hidden


@dataclasses.dataclass
class StepMessages:
    """The all_reduces one rank issues in a step: (elements, ranks in the group) each."""
    tp_messages: List[Tuple[int, int]]
    dp_messages: List[Tuple[int, int]]
    pp_messages: List[int] = dataclasses.field(default_factory=list)  # elements of each send, the busiest stage's
    bubble: float = 0.0  # the share of the step's compute a pipeline idles

    @property
    def elements(self) -> dict:
        return {"tp": sum(n for n, _ in self.tp_messages), "dp": sum(n for n, _ in self.dp_messages),
                "pp": sum(self.pp_messages)}

    def seconds(self, model) -> dict:
        """Predicted seconds of each kind's messages under `model` (a
        collectives.algorithms.cost.CostModel): all_reduces as rings (as Gloo and shm's sums for
        these sizes), a pipeline's sends alpha + beta bytes each."""
        def total(messages):
            return sum(model.predict("all_reduce", "ring", n * FLOAT32, p) for n, p in messages)
        return {"tp": total(self.tp_messages), "dp": total(self.dp_messages),
                "pp": sum(model.alpha + model.beta * n * FLOAT32 for n in self.pp_messages)}


def pipeline_messages(shape: Shape, world_size: int, pp: int, microbatches: int,
                      bucket_bytes: int = 25 << 20) -> StepMessages:
    """The messages of one step of a pipeline of `pp` stages and `microbatches` microbatches, DP
    over world_size / pp replicas (pp 1: DP alone); the sends are the busiest stage's."""
    if pp < 1 or world_size % pp:
        raise ValueError(f"the pipeline's {pp} stages must divide the world size {world_size}")
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 microbatch, got {microbatches}")
    dp = world_size // pp
    per_microbatch = shape.tokens // (dp * microbatches) * shape.hidden
    directions = 0 if pp == 1 else 1 if pp == 2 else 2
    plan = step_messages(Shape(shape.vocab, shape.hidden, shape.heads, shape.layers, shape.tokens), dp, 1,
                         bucket_bytes, held=shape.parameters() // pp)
    plan.pp_messages = [per_microbatch] * (directions * microbatches)
    plan.bubble = (pp - 1) / (microbatches + pp - 1)
    return plan


def pipeline_break_even_tokens(shape: Shape) -> float:
    """The tokens per step (per DP replica) at which a pipeline stage's sends, 2 T h, and a DP
    rank's ring all_reduce, about 2 P, are the same bytes: T = P / h."""
    return shape.parameters() / shape.hidden


def step_messages(shape: Shape, world_size: int, tp: int, bucket_bytes: int = 25 << 20,
                  held: int = None) -> StepMessages:
    """The messages of one step with TP over `tp` ranks and DP over world_size / tp (tp 1: DP alone;
    tp = world_size: TP alone). DP's all_reduce goes in buckets of `bucket_bytes` (the bucketed
    DDP's default, 25 MiB), one message each, modelled as ceil(bytes / bucket_bytes) even pieces:
    the DDP packs whole parameters into its buckets, so with a small cap its count can differ (4
    buckets where this says 6, for the training program's model at 0.05 MiB). `held`: the
    elements a rank all-reduces, where not the model's (or its TP shard's): a pipeline stage's."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"the TP size {tp} must divide the world size {world_size}")
    dp = world_size // tp
    tp_msgs: List[Tuple[int, int]] = []
    if tp > 1:
        t, h, layers = shape.tokens // dp, shape.hidden, shape.layers  # each TP group's share of the batch
        tp_msgs = [(t * h, tp)] * (2 * layers + 1) + [(t, tp)] * 3 + [(t * h, tp)] * (2 * layers + 1)
    dp_msgs: List[Tuple[int, int]] = []
    if dp > 1:
        whole = shape.whole_on_every_tp_rank() if tp > 1 else 0
        held = (shape.parameters() - whole) // tp + whole if held is None else held
        buckets = max(1, math.ceil(held * FLOAT32 / bucket_bytes))
        dp_msgs = [(held // buckets + (1 if i < held % buckets else 0), dp) for i in range(buckets)]
    return StepMessages(tp_msgs, dp_msgs)


def break_even_tokens(shape: Shape) -> float:
    """The tokens per step (per TP group) at which TP's activations and DP's gradients are the same
    bytes: (4L + 2) T h + 3 T = P."""
    return shape.parameters() / ((4 * shape.layers + 2) * shape.hidden + 3)
