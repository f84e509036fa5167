"""The transformer runs' one training loop (--tp, --pp, --cp; data parallelism alone is --tp 1 on
several ranks): the layout (tp.py, pp.py, cp.py) says how a step's forward, backward and gradient
average run on this rank; the loop around it is the same for all of them.

    python -m ddp_from_scratch.train --tp 2 --nproc 4                     # TP x DP on Python's documentation
    python -m ddp_from_scratch.train --tp 1 --nproc 1 --eval-every 64 --sample 200   # the one-rank model
    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8 --checkpoint ck --checkpoint-every 4 --amp

The model is the small transformer (workload/transformer.py) with learned positions, its sizes
from --hidden, --heads, --layers and --seq, built whole on every rank from --seed, then split by
the layout. Each step every data-parallel replica takes its rows of one global batch of
--batch-size x (replicas) sequences, drawn from (seed, step) alone (data.py), so every layout
sees the same batch at the same step and its losses are the one-rank model's within float32
rounding (the tests check this, layout by layout). Every --eval-every steps and at the end the
validation loss on the held-out text, the forward alone, the same on every layout. --amp runs
each forward (and its loss) under bfloat16 autocast; the parameters, gradients and optimizer stay
float32. --checkpoint writes each rank's shard and a manifest (sharded_checkpoint.py); --resume
goes on bitwise on the same layout, or resharded on another. --sample N: the rank's parameters
gathered into the one-rank model (places.py), which writes N bytes after a held-out prompt.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import List

import torch

from ..workload.transformer import TinyTransformer
from .data import Batches, evaluation_due, validation_summary
from .places import gather_whole, load_flat, size_of
from .progress import progress
from .sample import write_sample
from .sharded_checkpoint import ShardedCheckpoint, checkpoint_summary
from .transformer_args import DEFAULT_SEQUENCES, layout_of, settings_of, sizes


def autocast_of(config, device: str = "cpu"):
    """--amp: bfloat16 autocast for each forward; else nothing."""
    if not config.amp:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu",
                                  dtype=torch.bfloat16)


class Layout:
    """What a layout gives the loop (tp.py, pp.py, cp.py fill it in)."""

    data_size: int = 1  # replicas with their own rows of the global batch
    data_index: int = 0
    params: List[torch.Tensor]  # the rank's parameters, in the optimizer's order
    places: List[torch.Tensor]  # each one's elements in the one-rank flat vector (places.py)
    ddps: list = []  # our bucketed DDPs, whose bucket layouts a checkpoint keeps

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and the gradient average on this rank's rows; the global batch's mean loss."""
        raise NotImplementedError

    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The forward alone on this rank's rows of the validation batch; its global mean loss."""
        raise NotImplementedError

    def summary(self) -> dict:
        return {}


def train_transformer(env, config, make_layout) -> dict:
    """One rank of a --tp, --pp or --cp run (`make_layout(env, config, full, autocast)` splits the
    one-rank model `full`); the summary on every rank."""
    torch.manual_seed(config.seed)
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    vocab, hidden, heads, layers, seq = sizes(config)
    full = TinyTransformer(vocab, hidden, heads, layers, positions=seq)  # the same seed on every rank: the same weights
    autocast = autocast_of(config, env.device)
    layout = make_layout(env, config, full, autocast)
    opt = torch.optim.SGD(layout.params, lr=config.lr, momentum=0.9)
    batches = Batches(config)
    per_step = config.batch_size * layout.data_size
    steps = (config.train_size or DEFAULT_SEQUENCES) // per_step
    total = steps * config.epochs
    end = total if config.stop_at_step is None else min(total, config.stop_at_step)
    checkpoint = ShardedCheckpoint(env, config, layout_of(config, env.world_size), settings_of(config, env.world_size),
                                   layout.params, layout.places, size_of(full), opt, layout.ddps) \
        if config.checkpoint else None
    first = checkpoint.resume() if checkpoint else 0
    rows = slice(layout.data_index * config.batch_size, (layout.data_index + 1) * config.batch_size)
    losses, validation, step_seconds, start = [], [], [], time.perf_counter()
    for done in range(first, end):
        began = time.perf_counter()
        tokens, targets = batches(done, per_step)
        losses.append(layout.step(tokens[rows], targets[rows]))
        opt.step()
        opt.zero_grad()
        step_seconds.append(time.perf_counter() - began)  # this rank's, batch to update
        if evaluation_due(config, done + 1, end):
            tokens, targets = batches.validation(per_step)
            validation.append({"step": done + 1, "loss": layout.evaluate(tokens[rows], targets[rows])})
        if checkpoint and checkpoint.due(done + 1, end):
            checkpoint.save(done + 1)
        if env.rank == 0:
            progress(config, done, first, steps, losses[-1], per_step, start, label=batches.label,
                     validation=validation)
    seconds = time.perf_counter() - start
    if env.rank == 0:
        print(file=sys.stderr)
    written = None
    if config.sample:
        whole = load_flat(TinyTransformer(vocab, hidden, heads, layers, positions=seq),
                          gather_whole(layout.params, layout.places, size_of(full)))
        written = write_sample(whole, batches, config, env.rank)
    return {"model": "transformer", "sizes": {"vocab": vocab, "hidden": hidden, "heads": heads, "layers": layers},
            "tp": config.tp or 1, "pp": config.pp or 1, "cp": config.cp or 1, "dp": layout.data_size,
            "world_size": env.world_size, "backend": env.backend, "amp": config.amp, "compress": config.compress, "epochs": config.epochs,
            "batch_size_per_dp_rank": config.batch_size, "seq": seq, "steps": len(losses), "losses": losses,
            "parameters": size_of(full), **validation_summary(validation), "sample": written,
            **checkpoint_summary(checkpoint, first, end), "train_seconds": seconds, "step_seconds": step_seconds,
            "tokens_per_second": len(losses) * per_step * seq / seconds if seconds else None,
            **layout.summary(), **batches.summary()}
