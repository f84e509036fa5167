"""The transformer runs' command line (--tp, --pp, --cp, --ep): their sizes, the layout a
checkpoint names, and the checks that refuse what a run cannot do before any rank starts. args.py
holds the parser and TrainConfig and calls validate_transformer for these runs.

    validate_transformer(args, parser, world_size)     # parser.error (exit 2) on anything wrong
    layout_of(config, world_size), settings_of(config, world_size)   # what a checkpoint records
"""

from __future__ import annotations

import os

from collectives import cli

from ..parts import shards
from ..steps.powersgd import CLI_NAMES as POWERSGD_CLI_NAMES
from .checkpoint import check_checkpoint_flags
from .compression import check_powersgd_flags, powersgd_options
from ..pipeline_parallel.schedule import CHUNKED, rounds_of
from ..workload.text import Text, TextError

DEFAULT_SCHEDULE, DEFAULT_CHUNKS = "1f1b", 2  # --pp's
# The transformer's sizes: the vocabulary is the 256 byte values; the rest are --hidden, --heads,
# --layers and --seq's defaults (the tensor-parallel benchmark's model)
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 32
DEFAULT_SEQUENCES = 512


def sizes(config) -> tuple:
    """(vocabulary, hidden, heads, layers, seq) of a transformer run's model."""
    return VOCAB, config.hidden or HIDDEN, config.heads or HEADS, config.layers or LAYERS, config.seq or SEQ


def global_batch(config, world_size: int) -> int:
    """Sequences a step, over every rank: --batch-size per data-parallel rank times their number."""
    return config.batch_size * world_size // ((config.tp or 1) * (config.pp or 1) * (config.cp or 1))


DEFAULT_EXPERTS_PER_RANK, DEFAULT_CAPACITY_FACTOR, DEFAULT_AUX_LOSS = 2, 1.25, 0.01  # --ep's (Switch's factor and weight)
EP_ONLY = ("experts", "top_k", "capacity_factor", "aux_loss")  # the flags that mean something only with --ep


def ep_layout(config, world_size: int) -> dict:
    """What an --ep checkpoint must match to resume: the layout and the settings that decide the result."""
    return {"run": "ep", "world_size": world_size, "ep": config.ep, "experts": config.experts, "top_k": config.top_k,
            "capacity_factor": config.capacity_factor, "aux_loss": config.aux_loss, "batch_size": config.batch_size,
            "train_size": config.train_size or DEFAULT_SEQUENCES, "lr": config.lr, "seed": config.seed,
            "model": list(sizes(config))}


def layout_of(config, world_size: int) -> dict:
    """How a --tp, --pp or --cp run lays its ranks out: what a resume on the same layout matches
    (a resume on another one reshards: train/sharded_checkpoint.py)."""
    return {"run": "transformer", "world_size": world_size, "tp": config.tp or 1, "pp": config.pp or 1,
            "cp": config.cp or 1, "dp": world_size // ((config.tp or 1) * (config.pp or 1) * (config.cp or 1)),
            "sequence_parallel": config.sequence_parallel, "schedule": config.schedule, "chunks": config.chunks,
            "microbatches": config.microbatches, "bucket_cap_mb": config.bucket_cap_mb}


def settings_of(config, world_size: int) -> dict:
    """What decides a transformer run's result whatever its layout: a resume on any layout must match them."""
    return {"model": list(sizes(config)), "global_batch": global_batch(config, world_size),
            "train_size": config.train_size or DEFAULT_SEQUENCES, "lr": config.lr, "seed": config.seed,
            "synthetic": config.synthetic, "text": config.text, "amp": config.amp, "compress": config.compress,
            **({"powersgd": powersgd_options(config)} if config.compress in POWERSGD_CLI_NAMES else {})}


def validate_checkpoint(args, parser, config, world_size: int) -> None:
    """--checkpoint and its companions: the folder writable; a resume's manifest, layout or
    settings, and shards checked now, so a damaged or foreign checkpoint is one line before any
    rank starts."""
    if not check_checkpoint_flags(args, parser, "each rank writes its shard there, rank 0 the manifest",
                                  "the shards are written in it"):
        return
    cli.check_outputs(parser, {"--checkpoint": os.path.join(args.checkpoint, shards.MANIFEST)})
    has = os.path.exists(os.path.join(args.checkpoint, shards.MANIFEST))
    if not (args.resume or (args.auto_resume and has)):
        return
    try:
        manifest = shards.read_manifest(args.checkpoint)
        if config.ep is not None:
            shards.check_layout(manifest, ep_layout(config, world_size), args.checkpoint)
        else:
            shards.check_settings(manifest, "transformer", settings_of(config, world_size), args.checkpoint)
        shards.verify_shards(args.checkpoint, manifest)
    except shards.ShardError as exc:
        parser.error(str(exc))
    total = (config.train_size or DEFAULT_SEQUENCES) // global_batch(config, world_size) * config.epochs
    if manifest["step"] >= total:
        done = f"{args.checkpoint} has already trained {manifest['step']} of {total} steps (--epochs {config.epochs})"
        if args.auto_resume:
            parser.exit(0, f"python -m ddp_from_scratch.train: --auto-resume: {done}: the run is complete, nothing to "
                           "do\n")
        parser.error(f"--resume: {done}; raise --epochs to train further")


def validate_cp(args, parser, world_size: int) -> None:
    """Refuse what a --cp run cannot do, before any rank starts (parser.error: exit 2)."""
    cp, tp = args.cp, args.tp or 1
    if cp < 1 or world_size % (cp * tp):
        parser.error(f"--cp {cp}{f' x --tp {tp}' if tp > 1 else ''} = {cp * tp} must divide the {world_size} rank(s) "
                     "(--nproc, or the launcher's world size)")
    seq = args.seq or SEQ
    if seq % (2 * cp):
        parser.error(f"--cp {cp}: the transformer's {seq}-token sequences do not cut into 2 x {cp} equal pieces (the "
                     "head-tail layout; --seq sets their length)")
    if args.pp is not None and world_size % (cp * tp * args.pp):
        parser.error(f"--pp {args.pp} x --cp {cp}{f' x --tp {tp}' if tp > 1 else ''} = {args.pp * cp * tp} must divide "
                     f"the {world_size} rank(s) (--nproc, or the launcher's world size)")
    for flag, given, why in (("--ep", args.ep, "the MoE blocks' run is data-parallel only"),
                             ("--sequence-parallel", args.sequence_parallel,
                              "context parallelism already keeps every activation split along the sequence")):
        if given:
            parser.error(f"{flag} is not taken with --cp: {why}")


def validate_ep(args, parser, world_size: int) -> None:
    """Refuse what an --ep run cannot do, before any rank starts (parser.error: exit 2)."""
    ep = args.ep
    if ep < 1 or world_size % ep:
        parser.error(f"--ep {ep} must divide the {world_size} rank(s) (--nproc, or the launcher's world size)")
    if args.tp is not None or args.pp is not None:
        parser.error(f"--ep with {'--tp' if args.tp is not None else '--pp'}: expert parallelism here composes with "
                     "data parallelism only (the MoE blocks are not split over a TP group or cut into stages)")
    experts = args.experts if args.experts is not None else DEFAULT_EXPERTS_PER_RANK * ep
    if experts < 1 or experts % ep:
        parser.error(f"--experts {experts} must be a positive multiple of --ep {ep} (each rank holds experts/ep)")
    k = args.top_k if args.top_k is not None else 1
    if not 1 <= k <= experts:
        parser.error(f"--top-k {k} must be between 1 and the {experts} experts")
    if args.capacity_factor is not None and args.capacity_factor < 0:
        parser.error(f"--capacity-factor must be 0 (no capacity) or more, got {args.capacity_factor}")
    if args.aux_loss is not None and args.aux_loss < 0:
        parser.error(f"--aux-loss must be 0 or more, got {args.aux_loss}")
    if args.sequence_parallel:
        parser.error("--sequence-parallel applies to a --tp run")


# The flags of the ResNet run that a transformer run refuses, and why
NOT_TAKEN = {
    "test_size": "it counts CIFAR-10 test images; a transformer run validates on the last tenth of its text "
                 "(--eval-every)",
}


def validate_sizes(args, parser) -> None:
    """--hidden, --heads, --layers and --seq: positive, and the heads dividing the hidden size."""
    cli.check_at_least(parser, args, {"--hidden": 1, "--heads": 1, "--layers": 1, "--seq": 1})
    hidden, heads = args.hidden or HIDDEN, args.heads or HEADS
    if hidden % heads:
        parser.error(f"--hidden {hidden} does not split into --heads {heads}: give a hidden size the heads divide")


def validate_tp(args, parser, world_size: int, run: str = "--tp") -> None:
    """Refuse what a --tp run (or, with run="--pp", "--cp" or "--ep", that run) cannot do,
    before any rank starts (parser.error: exit 2)."""
    tp = args.tp or 1
    if tp < 1 or world_size % tp:
        parser.error(f"--tp {tp} must divide the {world_size} rank(s) (--nproc, or the launcher's world size)")
    validate_sizes(args, parser)
    seq = args.seq or SEQ
    for what, size, flag in (("heads", args.heads or HEADS, "--heads"), ("hidden size", args.hidden or HIDDEN, "--hidden"),
                             ("vocabulary", VOCAB, None)):
        if size % tp:
            parser.error(f"--tp {tp} does not divide the transformer's {size} {what}: "
                         + (f"use a {flag} that --tp divides" if flag else "use 1, 2 or 4"))
    if args.sequence_parallel and seq % tp:
        parser.error(f"--sequence-parallel: --tp {tp} does not divide the {seq}-token sequences (each rank holds a slice)")
    if args.text is not None and args.synthetic:
        parser.error("--text and --synthetic: give one (the transformer runs train on a text, or on synthetic tokens)")
    if not args.synthetic:
        try:  # the file read now, so a missing or short one is one line before any rank starts
            Text.load(args.text, seq)
        except TextError as exc:
            parser.error(str(exc))
    if run == "--ep" and (args.impl != "bucketed" or args.bucket_cap_mb is not None):
        given = f"--impl {args.impl}" if args.impl != "bucketed" else f"--bucket-cap-mb {args.bucket_cap_mb}"
        parser.error(f"{given}: not taken with --ep (it averages its gradients itself, in two flat all_reduces: the "
                     "dense parameters over every rank, each expert over the ranks holding it)")
    if args.impl != "bucketed":
        parser.error(f"{run} puts the bucketed DDP on the data-parallel dimension: --impl {args.impl} is not taken "
                     f"with {run}")
    if args.sequence_parallel and tp == 1:
        parser.error("--sequence-parallel splits the sequence over the TP group: give --tp 2 or more")
    for name, why in NOT_TAKEN.items():
        if getattr(args, name, None) is not None:
            parser.error(f"--{name.replace('_', '-')}: not taken with {run}: {why}")
    check_powersgd_flags(args, parser)
    dp = world_size // (tp * (args.pp or 1) * (args.cp or 1))
    if args.compress and run in ("--cp", "--ep"):
        parser.error(f"--compress: not taken with {run}: it compresses the bucketed DDP's all_reduces, and a {run} "
                     "run averages its gradients in flat all_reduces of its own (train/gradients.py)")
    if args.compress and dp == 1:
        parser.error(f"--compress {args.compress}: this layout has 1 data-parallel rank, so no gradient is "
                     "all-reduced to compress (--nproc must be more than --tp x --pp)")
    sequences = args.train_size or DEFAULT_SEQUENCES
    if sequences // (args.batch_size * dp) == 0:
        parser.error(f"{sequences} sequences make no full step of {args.batch_size} per DP rank on {dp} DP rank(s): "
                     f"use at least {args.batch_size * dp} (--train-size) or a smaller --batch-size")


PP_ONLY = ("schedule", "microbatches", "chunks")  # the flags that mean something only with --pp


def validate_pp(args, parser, world_size: int) -> None:
    """Refuse what a --pp run cannot do, before any rank starts (parser.error: exit 2)."""
    pp, tp, cp = args.pp, args.tp or 1, args.cp or 1
    if pp < 1:
        parser.error(f"--pp must be at least 1, got {pp}")
    if pp * tp * cp > world_size or world_size % (pp * tp * cp):
        parser.error(f"--pp {pp}{f' x --tp {tp}' if tp > 1 else ''}{f' x --cp {cp}' if cp > 1 else ''} = {pp * tp * cp} "
                     f"must divide the {world_size} rank(s) (--nproc, or the launcher's world size)")
    if args.sequence_parallel:
        parser.error("--sequence-parallel is not taken with --pp (a stage's activations travel whole)")
    m = args.microbatches if args.microbatches is not None else 2 * pp
    if m < 1:
        parser.error(f"--microbatches must be at least 1, got {m}")
    schedule = args.schedule or DEFAULT_SCHEDULE
    if args.chunks is not None and schedule not in CHUNKED:
        parser.error(f"--chunks applies to --schedule {' and '.join(CHUNKED)}, not {schedule}")
    v = (args.chunks if args.chunks is not None else DEFAULT_CHUNKS) if schedule in CHUNKED else 1
    if v < 1:
        parser.error(f"--chunks must be at least 1, got {v}")
    layers = args.layers or LAYERS
    pieces = layers + 2  # the embedding, each block, the last LayerNorm with the head
    if pp * v > pieces:
        parser.error(f"--pp {pp}{f' x --chunks {v}' if v > 1 else ''}: the transformer has {pieces} pieces to cut "
                     f"into {pp * v} stages (the embedding, {layers} blocks, the head), at least one a stage")
    if args.batch_size % m:
        parser.error(f"--microbatches {m} does not divide --batch-size {args.batch_size} (the sequences a DP rank "
                     "takes a step)")
    if schedule == "1f1b" and m < pp:
        parser.error(f"--schedule 1f1b needs at least as many microbatches as stages: --microbatches {m} for "
                     f"--pp {pp} (use gpipe, or more microbatches)")
    if schedule in CHUNKED and m % rounds_of(pp, m):
        parser.error(f"--schedule {schedule} runs the microbatches in rounds of about one a stage: "
                     f"--microbatches {m} on --pp {pp} make {rounds_of(pp, m)} rounds, which must divide them")
    if args.impl != "bucketed":
        parser.error(f"--pp puts the bucketed DDP on the data-parallel dimension: --impl {args.impl} is not taken "
                     "with --pp")




def validate_transformer(args, parser, world_size: int, config_of) -> None:
    """Every check of a --tp, --pp, --cp or --ep run (parser.error: exit 2). `config_of(args)`: the TrainConfig."""
    if args.cp is not None:
        validate_cp(args, parser, world_size)
    elif args.ep is not None:
        validate_ep(args, parser, world_size)
    run = ("--pp" if args.pp is not None else "--cp" if args.cp is not None else "--tp" if args.tp is not None
           else "--ep")
    if args.model is not None:
        parser.error(f"--model {args.model}: a {run} run trains the small transformer, not a CNN; leave out --model")
    cli.check_outputs(parser, {"--json": args.json})
    cli.check_positive(parser, args, "--lr")
    cli.check_positive(parser, args, "--bucket-cap-mb", "MiB")
    if args.pp is not None:
        validate_pp(args, parser, world_size)
    validate_tp(args, parser, world_size, run)
    validate_checkpoint(args, parser, config_of(args), world_size)
