"""The training program's command line: every flag (build_parser), the run they describe
(TrainConfig, what every rank reads), and the checks that refuse a bad argument, dataset or
checkpoint before any rank starts (validate: the ResNet run's here, the transformer runs' in
transformer_args.py).

    args = build_parser().parse_args(argv)
    validate(args, parser, world_size)               # parser.error (exit 2) on anything wrong
    config = TrainConfig.from_args(args)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

import torch.nn.functional as F

from collectives import cli

from ..workload import cifar10
from .checkpoint import (CheckpointError, RunComplete, check_checkpoint_flags, check_resume, load_checkpoint,
                         run_settings)
from ..steps.ddp import rebuilt_bucket_count
from ..workload.models import MODELS, batch, check_batch_fits, check_batchnorm_fits
from ..steps.powersgd import CLI_NAMES as POWERSGD_CLI_NAMES
from ..parts.torch_hooks import POWERSGD_ON_GLOO
from ..pipeline_parallel.schedule import CHUNKED, SCHEDULES
from ..wrap import IMPLS, SHARDED_IMPLS, STAGES
from .compression import POWERSGD_DEFAULTS, check_powersgd_flags
from .transformer_args import (DEFAULT_AUX_LOSS, DEFAULT_CAPACITY_FACTOR, DEFAULT_CHUNKS, DEFAULT_EXPERTS_PER_RANK,
                               DEFAULT_SCHEDULE, EP_ONLY, HEADS, HIDDEN, LAYERS, PP_ONLY, SEQ, validate_transformer)

CIFAR_TRAIN_SIZE, CIFAR_TEST_SIZE = 50_000, 10_000
# Memory a rank holds per synthetic image while making the set (numpy's int64 noise, then the
# 3,072-byte image): 27,913 bytes measured at the peak (cifar10.SyntheticCIFAR10, 20,000 images)
SYNTHETIC_PEAK_BYTES = 28_000
SIZES = ("hidden", "heads", "layers", "seq")  # the transformer's sizes, from flags
TRAIN_DESCRIPTION = "Train ResNet-50 on CIFAR-10 with torch's DDP or one of ours, as the public DDP tutorials do."
DEFAULT_MODEL = "resnet50"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run, as every rank reads it: the flags of build_parser (their defaults and
    help are there). `TrainConfig.from_args(parser.parse_args(argv))`."""

    impl: str
    model: str
    data: str
    synthetic: bool
    train_size: Optional[int]
    test_size: Optional[int]
    epochs: int
    batch_size: int
    lr: float
    bucket_cap_mb: Optional[float]
    compress: Optional[str]
    powersgd_rank: int
    powersgd_start_iter: int
    amp: bool
    seed: int
    deterministic: bool
    checkpoint: Optional[str]
    checkpoint_every: Optional[int]
    stop_at_step: Optional[int]
    resume: bool
    auto_resume: bool
    tp: Optional[int]
    sequence_parallel: bool
    pp: Optional[int] = None
    schedule: Optional[str] = None
    microbatches: Optional[int] = None
    chunks: Optional[int] = None
    ep: Optional[int] = None
    experts: Optional[int] = None
    top_k: Optional[int] = None
    capacity_factor: Optional[float] = None
    aux_loss: Optional[float] = None
    cp: Optional[int] = None
    text: Optional[str] = None
    eval_every: Optional[int] = None
    sample: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    layers: Optional[int] = None
    seq: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        if given["pp"] is not None:
            given["microbatches"] = given["microbatches"] or 2 * given["pp"]
            given["schedule"] = given["schedule"] or DEFAULT_SCHEDULE
            given["chunks"] = (given["chunks"] or DEFAULT_CHUNKS) if given["schedule"] in CHUNKED else 1
        if given["ep"] is not None:
            given["experts"] = given["experts"] or DEFAULT_EXPERTS_PER_RANK * given["ep"]
            given["top_k"] = given["top_k"] or 1
            given["aux_loss"] = DEFAULT_AUX_LOSS if given["aux_loss"] is None else given["aux_loss"]
            given["capacity_factor"] = (DEFAULT_CAPACITY_FACTOR if given["capacity_factor"] is None
                                        else given["capacity_factor"] or None)  # 0: no capacity
        if given["model"] is None and given["tp"] is None and given["pp"] is None and given["ep"] is None and given["cp"] is None:
            given["model"] = DEFAULT_MODEL
        for name, default in POWERSGD_DEFAULTS.items():  # not given on the command line
            if given[name] is None:
                given[name] = default
        return cls(**given)

    @property
    def checkpoint_path(self) -> Optional[str]:
        return os.path.join(self.checkpoint, "checkpoint.pt") if self.checkpoint else None

    def end_of(self, epoch: int, steps: int) -> int:
        """Where `epoch` (of `steps` steps) ends for this run: its last step, or --stop-at-step
        when that falls within it (0 or less: the run stops before the epoch starts). The one
        place --stop-at-step is read."""
        return steps if self.stop_at_step is None else min(steps, self.stop_at_step - epoch * steps)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m ddp_from_scratch.train", description=TRAIN_DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--impl", choices=IMPLS + SHARDED_IMPLS, default="bucketed",
                   help="which DDP, or a sharded step: " + "; ".join(f"{n}: {STAGES[n].summary}" for n in SHARDED_IMPLS))
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun/srun")
    p.add_argument("--model", choices=list(MODELS), default=None,
                   help=f"ResNet-50 (10 classes) or a small CNN (default {DEFAULT_MODEL}; a --tp run trains its small "
                        "transformer instead, and takes no --model)")
    p.add_argument("--data", default="./data", help="folder with cifar-10-batches-py/ or cifar-10-python.tar.gz")
    p.add_argument("--synthetic", action="store_true",
                   help="a deterministic CIFAR-shaped stand-in instead of CIFAR-10; with --tp, --pp, --ep or --cp, "
                        "random tokens instead of text")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="with --tp, --pp, --ep or --cp: train on this file as bytes (a vocabulary of 256), its last "
                        "tenth held out (default: the Python documentation's text, pydoc_data.topics)")
    p.add_argument("--train-size", type=int, default=None, help="use only the first N training images")
    p.add_argument("--test-size", type=int, default=None, help="use only the first N test images")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train (in total, counting resumed ones)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step (that tutorial uses 256 per GPU; "
                        "'PyTorch parallel training DistributedDataParallel complete code example' 128 split over the workers)")
    p.add_argument("--lr", type=float, default=0.001, help="SGD learning rate (momentum 0.9), as in that tutorial")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket size for --impl bucketed / torch / zero1 (DDP's buckets), MiB (default: torch's, 25 with a 1 MiB first bucket); "
                        "for --impl zero2 or zero2-bucketed, reduce-scatter in buckets of this size during backward "
                        "(default: zero2, one reduce-scatter of the whole model after it; zero2-bucketed, a quarter "
                        "of the model)")
    p.add_argument("--compress", choices=["fp16", "bf16", *POWERSGD_CLI_NAMES], default=None,
                   help="compress the gradients all-reduced, for --impl bucketed (ours) and torch (torch's comm "
                        "hooks): to fp16 or bf16, or PowerSGD's low-rank approximation (per gradient, or batched: "
                        "each bucket as one square matrix)")
    p.add_argument("--powersgd-rank", type=int, default=None, metavar="R",
                   help="PowerSGD's matrix_approximation_rank: R (rows + cols) numbers sent per rows x cols gradient "
                        f"(with --compress powersgd; {POWERSGD_DEFAULTS['powersgd_rank']} if not given)")
    p.add_argument("--powersgd-start-iter", type=int, default=None, metavar="N",
                   help="PowerSGD's start_powerSGD_iter: plain all_reduce for the first N steps (with --compress "
                        f"powersgd; torch's default, {POWERSGD_DEFAULTS['powersgd_start_iter']}, if not given)")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast on CPU, fp16 + GradScaler on CUDA (the ResNet run); "
                        "bf16 autocast (the transformer runs)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, shuffling and augmentation")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (cuDNN's deterministic mode, torch.use_deterministic_algorithms with "
                        "warnings): on CUDA, runs otherwise differ in the losses' 3rd decimal from the 2nd step")
    p.add_argument("--checkpoint", default=None, help="folder for checkpoint.pt, written each epoch (the ResNet run); with --tp, --pp, --cp or --ep, "
                        "for each rank's shard and a manifest, written at the end (and every --checkpoint-every "
                        "steps); a --tp/--pp/--cp checkpoint resumes on any of their layouts")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="also write the checkpoint every K steps within an epoch (a restart loses at most K steps)")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="stop after global step N (counting every epoch's steps), writing the checkpoint: to split "
                        "a run over jobs shorter than it; --resume goes on from there")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint/checkpoint.pt")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue from --checkpoint/checkpoint.pt when it exists, else start: for workers that "
                        "torchrun --max-restarts restarts with the same arguments")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: train the small transformer on text (--text) or --synthetic tokens, split over N ranks, "
                        "with the bucketed DDP over the rest (ddp_from_scratch/train/tp.py); --train-size then "
                        "counts sequences")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: keep the activations between blocks split along the sequence")
    p.add_argument("--pp", type=int, default=None, metavar="N",
                   help="pipeline parallelism: train the small transformer on text or --synthetic tokens, cut into N stages "
                        "run by --schedule, with --tp inside each stage and the bucketed DDP over the rest "
                        "(ddp_from_scratch/train/pp.py)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                   help=f"with --pp: the pipeline schedule (default {DEFAULT_SCHEDULE})")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="with --pp: microbatches a step, dividing --batch-size (default twice --pp)")
    p.add_argument("--chunks", type=int, default=None, metavar="V",
                   help="with --pp and --schedule interleaved or zero-bubble: model chunks a rank, stages r, N + r, "
                        f"... (default {DEFAULT_CHUNKS})")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert parallelism: train the small transformer with a mixture-of-experts MLP in every "
                        "block on text or --synthetic tokens, its experts over N ranks, the rest data-parallel over all "
                        "(ddp_from_scratch/train/ep.py)")
    p.add_argument("--experts", type=int, default=None, metavar="E",
                   help=f"with --ep: experts in each MoE block, a multiple of --ep (default {DEFAULT_EXPERTS_PER_RANK} "
                        "a rank)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="with --ep: experts each token goes to (default 1)")
    p.add_argument("--capacity-factor", type=float, default=None, metavar="F",
                   help="with --ep: an expert takes at most ceil(F x seq x K / E) tokens of a sequence, the rest are "
                        f"dropped and counted; 0: no capacity (default {DEFAULT_CAPACITY_FACTOR})")
    p.add_argument("--aux-loss", type=float, default=None, metavar="W",
                   help=f"with --ep: the weight of the load-balancing loss added to the cross-entropy (default "
                        f"{DEFAULT_AUX_LOSS}; 0: off)")
    p.add_argument("--cp", type=int, default=None, metavar="N",
                   help="context parallelism: train the small transformer on text or --synthetic tokens, each sequence "
                        "cut over N ranks and attention by ring attention, with --tp inside and "
                        "data parallelism over the rest (ddp_from_scratch/train/cp.py)")
    p.add_argument("--hidden", type=int, default=None, metavar="H",
                   help=f"with --tp, --pp, --ep or --cp: the transformer's hidden size (default {HIDDEN})")
    p.add_argument("--heads", type=int, default=None, metavar="A",
                   help=f"with --tp, --pp, --ep or --cp: attention heads, dividing --hidden (default {HEADS})")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help=f"with --tp, --pp, --ep or --cp: transformer blocks (default {LAYERS})")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help=f"with --tp, --pp, --ep or --cp: tokens (bytes) a sequence, and the learned positions "
                        f"(default {SEQ})")
    p.add_argument("--eval-every", type=int, default=None, metavar="K",
                   help="with --tp, --pp, --ep or --cp: the validation loss every K steps, as well as at the end")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="with --tp, --pp, --ep or --cp: after training, write N bytes the model generates from the start "
                        "of the held-out text (in the summary, and on stderr)")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    return p


def validate(args, parser, world_size: int, local_ranks: Optional[int] = None) -> None:
    """Refuse every bad argument, dataset and checkpoint before any rank starts (parser.error: exit 2).
    `local_ranks`: the ranks on this machine, which share its memory (default: world_size)."""
    cli.check_at_least(parser, args, {"--sample": 1, "--eval-every": 1, "--nproc": 1, "--batch-size": 1, "--epochs": 1, "--train-size": 1,
                                      "--test-size": 1, "--checkpoint-every": 1, "--stop-at-step": 1})
    if args.sequence_parallel and args.tp is None:
        parser.error("--sequence-parallel applies to a --tp run")
    if args.pp is None:
        given = [f"--{name}" for name in PP_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)}: appl{'ies' if len(given) == 1 else 'y'} to a --pp run")
    if args.ep is None:
        given = [f"--{name.replace('_', '-')}" for name in EP_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)}: appl{'ies' if len(given) == 1 else 'y'} to an --ep run")
    if args.tp is not None or args.pp is not None or args.ep is not None or args.cp is not None:
        return validate_transformer(args, parser, world_size, TrainConfig.from_args)
    given = [f"--{name}" for name in SIZES if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)}: appl{'ies' if len(given) == 1 else 'y'} to the transformer runs (--tp, --pp, "
                     "--ep, --cp); the ResNet run's model is --model")
    if args.sample is not None:
        parser.error("--sample applies to the transformer runs (--tp, --pp, --ep, --cp)")
    if args.eval_every is not None:
        parser.error("--eval-every applies to the transformer runs (--tp, --pp, --ep, --cp); the ResNet run evaluates on "
                     "the test set after every epoch")
    if args.text is not None:
        parser.error("--text applies to the transformer runs (--tp, --pp, --ep, --cp); the ResNet run reads CIFAR-10 "
                     "(--data)")
    args.model = args.model or DEFAULT_MODEL
    check_batch_fits(parser, args.model, args.batch_size, local_ranks or world_size)
    check_batchnorm_fits(parser, args.model, args.batch_size)
    cli.check_outputs(parser, {"--json": args.json})
    cli.check_positive(parser, args, "--lr")
    cli.check_positive(parser, args, "--bucket-cap-mb", "MiB")
    takers = ["torch"] + [n for n, s in STAGES.items() if "bucket_cap_mb" in s.takes]
    if args.bucket_cap_mb is not None and args.impl not in takers:
        parser.error(f"--bucket-cap-mb applies to --impl {', '.join(takers)}, not {args.impl}")
    if args.compress and args.impl not in ("bucketed", "torch"):
        parser.error(f"--compress applies to --impl bucketed and torch, not {args.impl}")
    powersgd = check_powersgd_flags(args, parser)
    resuming = [flag for flag, given in (("--resume", args.resume), ("--auto-resume", args.auto_resume),
                                         ("--stop-at-step", args.stop_at_step)) if given]
    if powersgd and args.impl == "torch" and resuming:
        parser.error(f"{resuming[0]} with --impl torch --compress {args.compress}: torch's DDP starts a resumed run "
                     "in its first-iteration bucket layout, where PowerSGD's per-bucket memories (laid out for the "
                     "rebuilt buckets) do not fit, so the run would not be the uninterrupted one; --impl bucketed "
                     "restores its layout and resumes bitwise")
    refusal = torch_powersgd_refusal(args, local_ranks or world_size)
    if refusal:
        parser.error(refusal)
    if args.amp and args.impl in SHARDED_IMPLS:
        parser.error(f"--amp applies to the DDP impls ({', '.join(IMPLS)}), not {args.impl}: the sharded steps' "
                     "optimizers are not torch optimizers that GradScaler can step")
    if not args.synthetic:
        try:  # every file, so a damaged one is named now, not by a rank an epoch later
            train_images = len(cifar10.load_arrays(args.data, train=True)[1])
            cifar10.load_arrays(args.data, train=False)
        except (cifar10.DatasetMissing, cifar10.DatasetCorrupt) as exc:
            parser.error(str(exc))
    else:
        train_images = CIFAR_TRAIN_SIZE
        made = (args.train_size or CIFAR_TRAIN_SIZE) + (args.test_size or CIFAR_TEST_SIZE)
        cli.check_memory(parser, "--train-size/--test-size", (local_ranks or world_size) * made * SYNTHETIC_PEAK_BYTES,
                         f"{local_ranks or world_size} rank(s) each making {made:,} synthetic images")
    if args.train_size is not None and args.train_size > train_images and not args.synthetic:
        parser.error(f"--train-size {args.train_size} is more than the {train_images} training images")
    images = args.train_size or train_images
    per_step = args.batch_size * world_size
    if images // world_size // args.batch_size == 0:
        parser.error(f"{images} training images make no full step of {args.batch_size} per rank on {world_size} "
                     f"rank(s): use at least {per_step} images (--train-size) or a smaller --batch-size")
    if check_checkpoint_flags(args, parser, "the folder checkpoint.pt is written to", "checkpoint.pt is written in it"):
        cli.check_outputs(parser, {"--checkpoint": os.path.join(args.checkpoint, "checkpoint.pt")})
        path = os.path.join(args.checkpoint, "checkpoint.pt")
        if args.resume or (args.auto_resume and os.path.exists(path)):
            try:
                check_resume(load_checkpoint(path), run_settings(TrainConfig.from_args(args), world_size), path,
                             args.epochs)
            except CheckpointError as exc:
                parser.error(str(exc))
            except RunComplete as exc:
                if args.auto_resume:  # torchrun's agent restarting a worker after the last epoch was saved
                    parser.exit(0, f"python -m ddp_from_scratch.train: --auto-resume: {exc}: the run is complete, "
                                   "nothing to do\n")
                parser.error(f"--resume: {exc}; raise --epochs to train further")


def torch_powersgd_refusal(args, local_ranks: int) -> Optional[str]:
    """Why torch's PowerSGD hook cannot run these arguments, or None: on Gloo, with more than one
    bucket, it kills the run (torch_hooks.POWERSGD_ON_GLOO says how)."""
    from collectives.launcher.env import pick_backend

    if args.impl != "torch" or args.compress not in POWERSGD_CLI_NAMES:
        return None
    try:
        backend = pick_backend(local_ranks)
    except ValueError:  # a bad COLLECTIVES_BACKEND: the launcher names it
        return None
    if backend != "gloo":
        return None
    x, y = batch(0, 0, 2, 32)
    buckets = rebuilt_bucket_count(MODELS[args.model](), x, lambda out: F.cross_entropy(out, y),
                                             args.bucket_cap_mb)
    if buckets == 1:
        return None
    cap = "DDP's default buckets" if args.bucket_cap_mb is None else f"--bucket-cap-mb {args.bucket_cap_mb}"
    return (f"--impl torch --compress {args.compress} on Gloo: model {args.model} with {cap} makes {buckets} buckets, "
            f"and {POWERSGD_ON_GLOO}; use --impl bucketed (ours: the same arithmetic, bit for bit torch's hook), "
            "COLLECTIVES_BACKEND=shm, or a --bucket-cap-mb that holds the whole model in one bucket")
