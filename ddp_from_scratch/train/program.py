"""The training program's entry point: parse, check every argument before any rank starts, then
run the chosen run on every rank (the launcher's, torchrun's or srun's) and print the summary.

    python -m ddp_from_scratch.train --help
"""

from __future__ import annotations

import json
import os
import sys

import collectives
from collectives import cli
from collectives.cli import command
from collectives.launcher.env import read_env
from collectives.launcher.start_methods import TRAINING, preload

from .args import TrainConfig, build_parser, validate
from .cp import train_cp
from .ep import train_ep
from .pp import train_pp
from .resnet import train
from .tp import train_tp


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    launched = read_env(os.environ)
    joined = launched["master_addr"] is not None
    validate(args, parser, launched["world_size"] if joined else args.nproc,
             launched["local_world_size"] if joined else args.nproc)
    config = TrainConfig.from_args(args)
    preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    loop = train_pp if config.pp is not None else train_cp if config.cp is not None else \
        train_tp if config.tp is not None else train_ep if config.ep is not None else train
    summary = collectives.run_or_join(loop, args.nproc, args=(config,), timeout=7 * 24 * 3600)
    if summary is None:  # a torchrun/srun rank other than 0: rank 0 reports
        return 0
    text = json.dumps(summary)
    print(text, flush=True)
    if args.json:
        try:
            cli.write_output(args.json, text + "\n", "--json")
        except OSError as exc:
            print(f"python -m ddp_from_scratch.train: could not write --json {args.json} ({exc.strerror or exc}); the "
                  "summary is the line above on stdout", file=sys.stderr)
            return 1
    return 0
