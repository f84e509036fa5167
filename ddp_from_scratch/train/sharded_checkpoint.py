"""The --tp, --pp and --cp runs' checkpoint: each rank writes its own shard, rank 0 a manifest
naming the layout, and a resume on any layout of these runs reads it (parts/shards.py writes and
checks the files).

    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8 --checkpoint ck --checkpoint-every 4
    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8 --checkpoint ck --resume         # bitwise
    python -m ddp_from_scratch.train --tp 1 --nproc 1 --batch-size 64 --checkpoint ck --resume   # resharded

A shard holds the rank's parameters and SGD momentum as flat vectors, beside each element's place
in the one-rank model's flat parameter vector (train/places.py), its bucketed DDPs' rebuilt
bucket layouts, and with --compress powersgd their error-feedback memories (which belong to the
buckets: a resume on another layout starts them afresh, as PowerSGD's first step does).

A resume on the layout that wrote it reads the rank's own shard. On another layout it reads every
shard, puts the one-rank model's parameters and momentum together from them (a replica's copy
lands where the first one did, with the same bits), and cuts this rank's out with its own
layout's places. On the layout that wrote it each rank gets back
exactly what it saved, buckets included, so the run ends bitwise equal to the unbroken one; on
another layout (one rank included) the parameters and momentum are the same numbers resharded,
and the losses go on within float32 rounding of the unbroken run's (the arithmetic differs as it
does between the layouts). What every layout must share is checked first
(transformer_args.settings_of: the model's sizes, the global batch of 64 sequences here (32 a
data-parallel rank by default), the data, lr, seed, --amp and --compress).

    whole = one_rank_vector("ck")       # the one-rank model's parameters from any layout's shards
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..parts import shards
from ..steps.powersgd import PowerSGD
from .places import assemble, take


class ShardedCheckpoint:
    """One rank's view of a run's checkpoint folder."""

    def __init__(self, env, config, layout: dict, settings: dict, params: Sequence[torch.Tensor],
                 places: Sequence[torch.Tensor], total: int, opt: torch.optim.Optimizer, ddps: Sequence = ()):
        self.env, self.config, self.layout, self.settings = env, config, layout, settings
        self.params, self.places, self.total, self.opt, self.ddps = list(params), list(places), total, opt, list(ddps)
        self.resumed: Optional[dict] = None  # {"step", "resharded", "from_layout"} after a resume

    def _momentum(self, p) -> torch.Tensor:
        buffer = self.opt.state.get(p, {}).get("momentum_buffer")
        return torch.zeros_like(p) if buffer is None else buffer

    def save(self, done: int) -> None:
        """Every rank its shard, then rank 0 the manifest once every shard is on disk."""
        state = {"places": torch.cat(self.places),
                 "parameters": torch.cat([p.detach().reshape(-1) for p in self.params]),
                 "momentum": torch.cat([self._momentum(p).reshape(-1) for p in self.params]),
                 "buckets": [d.bucket_layout_state() for d in self.ddps],
                 "powersgd": [d.compress.state_dict() if isinstance(d.compress, PowerSGD) else None for d in self.ddps],
                 "step": done}
        os.makedirs(self.config.checkpoint, exist_ok=True)
        digest = shards.save_shard(self.config.checkpoint, self.env.rank, self.env.world_size, state)
        digests = [digest]
        if self.env.world_size > 1:
            digests = [None] * self.env.world_size
            dist.all_gather_object(digests, digest)
        if self.env.rank == 0:
            shards.write_manifest(self.config.checkpoint, self.layout, done, digests, settings=self.settings)
        if self.env.world_size > 1:
            dist.barrier()  # no rank goes on (or ends) before the manifest names the shards

    def due(self, done: int, end: int) -> bool:
        every = self.config.checkpoint_every
        return bool(self.config.checkpoint) and (done == end or bool(every and done % every == 0))

    def resume(self) -> int:
        """Load the rank's parameters and momentum (resharded if the layout differs); the steps
        done. --auto-resume with no checkpoint yet starts at step 0. args.py checked the manifest,
        the settings and every shard's digest before any rank started."""
        folder = self.config.checkpoint
        if not (self.config.resume or self.config.auto_resume) or \
                not os.path.exists(os.path.join(folder, shards.MANIFEST)):
            return 0
        manifest = shards.read_manifest(folder)
        shards.check_settings(manifest, "transformer", self.settings, folder)
        same = manifest["layout"] == self.layout
        if same:  # this rank's own shard holds exactly its elements, in its order
            mine = shards.load_shard(folder, self.env.rank, manifest)
            sizes = [len(idx) for idx in self.places]
            params, momentum = mine["parameters"].split(sizes), mine["momentum"].split(sizes)
        else:  # every shard, put together in the one-rank order, then this rank's places cut out
            states = [shards.load_shard(folder, r, manifest) for r in range(len(manifest["shards"]))]
            where = f"{folder} ({manifest['layout'].get('world_size')} ranks)"
            params = take(assemble([(s["places"], s["parameters"]) for s in states], self.total,
                                   f"the parameters in {where}"), self.places)
            momentum = take(assemble([(s["places"], s["momentum"]) for s in states], self.total,
                                     f"the momentum in {where}"), self.places)
        with torch.no_grad():
            for p, value, buffer in zip(self.params, params, momentum):
                p.copy_(value.view_as(p))
                self.opt.state[p]["momentum_buffer"] = buffer.view_as(p).clone()
        if same:  # the buckets this rank reduced in, PowerSGD's memories: a resume on the same layout stays bitwise
            for d, buckets, powersgd in zip(self.ddps, mine["buckets"], mine.get("powersgd", [None] * len(self.ddps))):
                d.load_bucket_layout_state(buckets)
                if powersgd is not None:
                    d.compress.load_state_dict(powersgd)
        self.resumed = {"step": manifest["step"], "resharded": not same, "from_layout": manifest["layout"]}
        return manifest["step"]


def checkpoint_summary(checkpoint: Optional[ShardedCheckpoint], first: int, end: int) -> dict:
    return {"checkpoint": checkpoint.config.checkpoint if checkpoint else None, "start_step": first, "end_step": end,
            "resumed": checkpoint.resumed if checkpoint else None}


def one_rank_vector(folder: str, what: str = "parameters") -> torch.Tensor:
    """The one-rank model's flat parameters (or "momentum") put together from a checkpoint's shards."""
    manifest = shards.read_manifest(folder)
    states = [shards.load_shard(folder, r, manifest) for r in range(len(manifest["shards"]))]
    total = int(max(int(s["places"].max()) for s in states)) + 1
    return assemble([(s["places"], s[what]) for s in states], total, f"the {what} in {folder}")
