"""The training program's expert-parallel run: the small transformer with a mixture-of-experts
MLP in every block (expert_parallel/model.py) on text or synthetic tokens (data.py), its experts over --ep ranks,
everything else data-parallel over all of them.

    python -m ddp_from_scratch.train --ep 2 --nproc 2 --synthetic                        # 4 experts over 2 ranks
    python -m ddp_from_scratch.train --ep 2 --nproc 4 --synthetic --experts 4 --top-k 2  # EP x DP, 2 x 2
    python -m ddp_from_scratch.train --ep 1 --nproc 1 --synthetic                        # the one-rank model, to compare

The ranks form a grid (collectives.RankGrid): each row of --ep consecutive ranks is an
expert-parallel group, holding the experts once between them; the ranks at the same place in
each row hold the same experts, a column. Every rank takes its own --batch-size rows of one
global batch of --batch-size x (world size) sequences (the same global batch whatever the
layout), and its tokens meet the experts by all_to_all inside its row (expert_parallel/dispatch.py).

The loss a rank backpropagates is its rows' cross-entropy plus --aux-loss times the blocks'
balance losses. After backward the gradients are averaged over the world, by two all_reduces:
the dense parameters (attention, router, LayerNorms, embedding, head) over all ranks; each
expert over its column, since its gradient already holds its whole row's tokens (the all_to_all
brought their gradients back to it); both divided by the world size. So a run's losses are the
one-rank model's on the same global batch within float32 rounding (the test checks this), and
each sequence is routed, capacity and drops included, as the one-rank model routes it.

The summary (the last line on stdout) lists every step's loss, balance loss and dropped token
slots (all ranks and blocks), the tokens each expert of the first block took in the last step, and
the bytes the all_to_alls moved a step.

    python -m ddp_from_scratch.train --ep 2 --nproc 4 --synthetic --checkpoint ck --checkpoint-every 4
    python -m ddp_from_scratch.train --ep 2 --nproc 4 --synthetic --checkpoint ck --resume

--checkpoint FOLDER: every rank writes its own shard (its parameters and momentum, and its experts
named by their index in the whole layer) and rank 0 a manifest naming the layout, the steps done
and each shard's digest (parts/shards.py), every --checkpoint-every steps and at the end (or at
--stop-at-step). --resume (or --auto-resume) on the same layout continues from the manifest's
step and ends bitwise equal to the unbroken run (the test checks this for EP x DP); a damaged,
foreign or other-layout checkpoint is refused in one line naming the file, before any rank starts.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives as C

from ..expert_parallel.model import MoETransformer, dense_parameters, expert_parameters, expert_parallel, expert_state
from ..parts import shards
from .transformer_args import DEFAULT_SEQUENCES, VOCAB, ep_layout, sizes
from .data import Batches, evaluation_due, validation_summary
from .progress import progress
from .gradients import average_gradients
from .sample import gathered_moe, write_sample
from .transformer import autocast_of


def _save(env, config, model, opt, layout: dict, done: int) -> None:
    """Each rank its shard (its model and optimizer state, its experts by their global index), then
    rank 0 the manifest, once every shard is on disk."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "experts": expert_state(model), "step": done}
    os.makedirs(config.checkpoint, exist_ok=True)  # the program made it already; a caller of train_ep may not have
    digest = shards.save_shard(config.checkpoint, env.rank, env.world_size, state)
    digests = [digest]
    if env.world_size > 1:
        digests = [None] * env.world_size
        dist.all_gather_object(digests, digest)
    if env.rank == 0:
        shards.write_manifest(config.checkpoint, layout, done, digests)
    if env.world_size > 1:
        dist.barrier()  # no rank goes on (or ends) before the manifest names the shards


def _resume(env, config, model, opt, layout: dict) -> int:
    """Load this rank's shard (args.py checked the manifest, layout and digests); the steps done.
    --auto-resume with no checkpoint yet starts at step 0."""
    if not os.path.exists(os.path.join(config.checkpoint, shards.MANIFEST)):
        return 0
    manifest = shards.read_manifest(config.checkpoint)
    shards.check_layout(manifest, layout, config.checkpoint)
    state = shards.load_shard(config.checkpoint, env.rank, manifest)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return manifest["step"]


def train_ep(env, config) -> dict:
    """One rank of an --ep run; the summary on every rank."""
    torch.manual_seed(config.seed)
    w, ep = env.world_size, config.ep
    _, hidden, heads, blocks, seq = sizes(config)
    grid = C.RankGrid(w // ep, ep)  # rows: expert-parallel groups; columns: the same experts
    full = MoETransformer(VOCAB, hidden, heads, blocks, config.experts, config.top_k, config.capacity_factor)
    autocast = autocast_of(config, env.device)
    model = expert_parallel(full, grid.row) if ep > 1 else full
    dense, experts = list(dense_parameters(model)), list(expert_parameters(model))
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    batches = Batches(config)
    per_step = config.batch_size * w
    steps = (config.train_size or DEFAULT_SEQUENCES) // per_step
    total = steps * config.epochs
    end = total if config.stop_at_step is None else min(total, config.stop_at_step)
    layout = ep_layout(config, w)
    first = _resume(env, config, model, opt, layout) if config.resume or config.auto_resume else 0
    rows = slice(env.rank * config.batch_size, (env.rank + 1) * config.batch_size)
    losses, aux_losses, dropped, moved, validation, start = [], [], [], [], [], time.perf_counter()

    def evaluate(done):  # the cross-entropy alone (the balance loss is a training term), averaged over every rank
        tokens, targets = batches.validation(per_step)
        with torch.no_grad(), autocast():
            mean = F.cross_entropy(model(tokens[rows]).reshape(-1, VOCAB), targets[rows].reshape(-1)).float()
        if w > 1:
            C.all_reduce(mean)
        validation.append({"step": done, "loss": mean.item() / w})

    for done in range(first, end):
        tokens, targets = batches(done, per_step)
        with autocast():
            logits = model(tokens[rows])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1))
            aux = model.aux_loss()
        (loss + config.aux_loss * aux).backward()
        if w > 1:
            average_gradients(dense, None, w)  # over every rank
            average_gradients(experts, grid.col, w)  # over the ranks holding the same experts
        opt.step()
        opt.zero_grad()
        layers = model.moe_layers()
        logged = torch.stack([loss.detach().float(), aux.detach().float(),
                              sum(layer.last.dropped.sum() for layer in layers).float(),
                              torch.tensor(float(sum(layer.last.sent_rows for layer in layers)))])
        if w > 1:
            C.all_reduce(logged)
        losses.append(logged[0].item() / w)
        aux_losses.append(logged[1].item() / w)
        dropped.append(int(logged[2].item()))
        moved.append(int(logged[3].item()) * 4 * hidden * 4)  # dispatch + combine, forward and backward, float32
        if evaluation_due(config, done + 1, total):
            evaluate(done + 1)
        if config.checkpoint and ((config.checkpoint_every and (done + 1) % config.checkpoint_every == 0)
                                  or done + 1 == end):
            _save(env, config, model, opt, layout, done + 1)
        if env.rank == 0:
            slots = per_step * seq * config.top_k * blocks
            progress(config, done, first, steps, losses[-1], per_step, start,
                     f" (balance {aux_losses[-1]:.3f}, dropped {dropped[-1]} of {slots} slots)", batches.label,
                     validation)
    seconds = time.perf_counter() - start
    if env.rank == 0:
        print(file=sys.stderr)
    load = model.moe_layers()[0].last.routed.clone()
    if w > 1:
        C.all_reduce(load)
    written = None
    if config.sample:
        whole = gathered_moe(model, (VOCAB, hidden, heads, blocks, config.experts, config.top_k,
                                     config.capacity_factor), grid.row) if ep > 1 else model
        written = write_sample(whole, batches, config, env.rank)
    return {"model": "moe-transformer", "ep": ep, "dp": w // ep, "world_size": w, "backend": env.backend,
            "experts": config.experts, "top_k": config.top_k, "capacity_factor": config.capacity_factor,
            "aux_loss_weight": config.aux_loss, "epochs": config.epochs, "batch_size_per_rank": config.batch_size,
            "seq": seq, "amp": config.amp, "steps": len(losses), "losses": losses, "aux_losses": aux_losses,
            "dropped_slots": dropped, "tokens_per_expert_last_step": load.tolist(),
            "all_to_all_bytes_per_step": moved, "start_step": first, "end_step": end,
            "checkpoint": config.checkpoint, "train_seconds": seconds, **validation_summary(validation),
            "sample": written,
            "tokens_per_second": len(losses) * per_step * seq / seconds if seconds else None,
            **batches.summary()}
