"""--compress for the training program's runs: what our bucketed DDP is given, and the checks of
the PowerSGD flags, shared by the ResNet run (args.py) and the --tp/--pp runs (transformer_args.py).

    DistributedDataParallel(module, compress=compress_of(config))    # None, "fp16", "bf16" or a PowerSGD
    check_powersgd_flags(args, parser)                               # parser.error on a flag --compress does not take
"""

from __future__ import annotations

from collectives import cli

from ..steps.powersgd import CLI_NAMES as POWERSGD_CLI_NAMES, PowerSGD

POWERSGD_DEFAULTS = {"powersgd_rank": 1, "powersgd_start_iter": 1000}  # torch's PowerSGDState's


def powersgd_options(config) -> dict:
    return {"matrix_approximation_rank": config.powersgd_rank, "start_powerSGD_iter": config.powersgd_start_iter}


def compress_of(config):
    """--compress for our bucketed DDP: None, "fp16", "bf16", or a PowerSGD with the run's options."""
    if config.compress in POWERSGD_CLI_NAMES:
        return PowerSGD(**powersgd_options(config), batched=config.compress == "batched_powersgd")
    return config.compress


def check_powersgd_flags(args, parser) -> bool:
    """--powersgd-rank and --powersgd-start-iter only with --compress powersgd (or batched), each in
    range; whether the run compresses by PowerSGD."""
    powersgd = args.compress in POWERSGD_CLI_NAMES
    given = [f"--{name.replace('_', '-')}" for name in POWERSGD_DEFAULTS if getattr(args, name) is not None]
    if not powersgd and given:
        parser.error(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --compress powersgd or "
                     f"batched_powersgd, not {'--compress ' + args.compress if args.compress else 'a run without --compress'}")
    if powersgd:
        cli.check_at_least(parser, args, {"--powersgd-rank": 1})
    if powersgd and args.powersgd_start_iter is not None and args.powersgd_start_iter < 2:
        parser.error(f"--powersgd-start-iter must be at least 2 (error feedback and warm start keep memories per "
                     f"bucket, and DDP settles its buckets in the first steps), got {args.powersgd_start_iter}")
    return powersgd
