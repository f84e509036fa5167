"""Data, tensor, 2-D and pipeline parallelism of the small transformer side by side in one run: step
time and the bytes each rank sends per step.

    python -m benchmarks.tensor_parallel --world-size 4
    python -m benchmarks.tensor_parallel --world-size 4 --backend shm --json tp.json

Every variant trains the same global batch (--batch-size sequences per data-parallel rank of the
DP variant, so world_size x that in all) of the same model (ddp_from_scratch/workload/transformer.py):

    DP        the whole model on every rank, the project's bucketed DDP over all ranks
    TP        the model split over all ranks (ddp_from_scratch/tensor_parallel/model.py), each rank the whole batch
    TP x DP   a 2-D mesh, TP over --tp ranks, the bucketed DDP over the others, each DP group its share
    PP x DP   --pp pipeline stages (1F1B, --microbatches a step), the bucketed DDP over the replicas,
              gradients all-reduced once after the last microbatch (ddp_from_scratch/train/pp.py's step)

Each round every variant does one SGD step (forward, backward, gradients averaged, update), in a
shuffled order the same on every rank, after a barrier; a step's time is the slowest rank's; the
table gives medians over rounds. Bytes: the elements of every all_reduce a rank issues in a step,
times 4 (float32): TP's activations (counted by tensor_parallel.operators.counting) and DP's
gradient buckets (the parameters the rank holds), both as the payload each all_reduce carries.
PP's: the elements of every activation and gradient a rank sends its neighbour stages, and the
bubble's closed form (the share of its compute a pipeline idles). Beside them, the same messages'
time under the project's alpha-beta-gamma model, and the tokens per step below which TP, and a
pipeline, send fewer bytes than DP (ddp_from_scratch/tensor_parallel/messages.py).
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives
from collectives import cli
from collectives.launcher.start_methods import TRAINING, preload
from collectives.algorithms.cost import CostModel
from ddp_from_scratch.pipeline_parallel.mesh3d import Mesh3D
from ddp_from_scratch.pipeline_parallel.schedule import one_f_one_b
from ddp_from_scratch.pipeline_parallel.split import split
from ddp_from_scratch.pipeline_parallel.stage import Stage
from ddp_from_scratch.steps.ddp import DistributedDataParallel
from ddp_from_scratch.tensor_parallel.messages import (Shape, break_even_tokens, pipeline_break_even_tokens,
                                                   pipeline_messages, step_messages)
from ddp_from_scratch.tensor_parallel.mesh import Mesh2D
from ddp_from_scratch.tensor_parallel.model import TensorParallelTransformer
from ddp_from_scratch.tensor_parallel.operators import counting
from ddp_from_scratch.tensor_parallel.vocab import vocab_parallel_cross_entropy
from ddp_from_scratch.workload.transformer import TinyTransformer, token_batch


def _model(config) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(config["vocab"], config["hidden"], config["heads"], config["layers"])


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    n, b, seq, vocab = env.world_size, config["batch_size"], config["seq"], config["vocab"]
    backend = config["backend"]
    tp_all = Mesh2D(tp=n, backend=backend)  # TP over every rank
    mesh = Mesh2D(tp=config["tp"], backend=backend)  # TP x DP
    world = dist.new_group(backend=backend)
    # label: (model, sequences per rank, which batch this rank draws, the TP group whose logits are split)
    variants = {
        "DP": (DistributedDataParallel(_model(config), group=world), b, env.rank, None),
        "TP": (TensorParallelTransformer(_model(config), tp_all.tp), n * b, 0, tp_all.tp),
        "TP x DP": (DistributedDataParallel(TensorParallelTransformer(_model(config), mesh.tp), group=mesh.dp),
                    n * b // mesh.dp_size, mesh.coordinates(env.rank)[0], mesh.tp),
    }
    opts = {k: torch.optim.SGD(v[0].parameters(), lr=0.01) for k, v in variants.items()}
    pipe = _pipeline(config, n, b, seq, vocab, backend)
    opts["PP x DP"] = torch.optim.SGD(pipe["stage"].parameters(), lr=0.01)
    times = {k: [] for k in list(variants) + ["PP x DP"]}
    elements = {}
    order = random.Random(0)
    for rnd in range(config["rounds"] + 1):
        for label in order.sample(list(times), len(times)):
            if label == "PP x DP":
                dist.barrier()
                took = _pipeline_step(pipe, rnd, opts[label])
                if rnd:
                    times[label].append(took)
                else:
                    elements[label] = {"tp": 0, "dp": pipe["held"], "pp": pipe["sent"]}
                continue
            model, batch, shard, tp_group = variants[label]
            tokens, targets = token_batch(rnd, shard, batch, seq, vocab)
            dist.barrier()
            start = time.perf_counter()
            with counting() as tp_messages:
                logits = model(tokens)  # through the DDP wrapper where there is one: its hooks see the forward
                loss = (vocab_parallel_cross_entropy(logits, targets, tp_group) if tp_group is not None else
                        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
                loss.backward()
            opts[label].step()
            opts[label].zero_grad()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
            if rnd:
                times[label].append(took.item())
            else:
                held = sum(p.numel() for p in model.parameters())
                elements[label] = {"tp": sum(e for _, e in tp_messages), "dp": held if label != "TP" else 0, "pp": 0}
    return {"world_size": n, "tp": config["tp"], "pp": config["pp"], "microbatches": config["microbatches"],
            "times_s": times, "elements": elements}


def _pipeline(config, n, b, seq, vocab, backend) -> dict:
    """This rank's stage of the PP x DP variant: the model cut into --pp stages over its pipeline
    group, the bucketed DDP over its replicas."""
    mesh = Mesh3D(pp=config["pp"], backend=backend)
    p, m = config["pp"], config["microbatches"]
    module = split(_model(config).as_sequence(), p)[mesh.stage]
    ddp = DistributedDataParallel(module, group=mesh.dp) if mesh.dp_size > 1 else None
    stage = Stage(ddp or module, mesh.stage, p, group=mesh.pp,
                  loss_fn=lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    rows = n * b // mesh.dp_size  # the replica's share of the global batch
    tokens, _ = token_batch(0, mesh.dp_index, rows, seq, vocab)
    stage.agree_shapes(tokens[:rows // m] if mesh.stage == 0 else None)
    sent = 0  # a microbatch's activation forward, and its input's gradient back
    if mesh.stage < p - 1:
        sent += m * math.prod(stage.output_meta[mesh.stage][1])
    if mesh.stage > 0:
        sent += m * math.prod(stage.input_meta[mesh.stage][1])
    return {"mesh": mesh, "stage": stage, "ddp": ddp, "rows": rows, "schedule": one_f_one_b(p, m),
            "held": sum(q.numel() for q in module.parameters()) if ddp else 0, "sent": sent,
            "m": m, "seq": seq, "vocab": vocab}


def _pipeline_step(pipe, rnd: int, opt) -> float:
    mesh, stage, ddp, m = pipe["mesh"], pipe["stage"], pipe["ddp"], pipe["m"]
    tokens, targets = token_batch(rnd, mesh.dp_index, pipe["rows"], pipe["seq"], pipe["vocab"])
    start = time.perf_counter()
    with ddp.no_sync() if ddp else contextlib.nullcontext():
        stage.run(pipe["schedule"], list(tokens.tensor_split(m)) if mesh.stage == 0 else None,
                  list(targets.tensor_split(m)) if mesh.stage == mesh.pp_size - 1 else None)
    if ddp:
        ddp.sync_gradients()
    opt.step()
    opt.zero_grad()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def shape_of(config: dict, world_size: int) -> Shape:
    return Shape(config["vocab"], config["hidden"], config["heads"], config["layers"],
                 tokens=world_size * config["batch_size"] * config["seq"])


def tp_sizes(result: dict) -> dict:
    return {"DP": 1, "TP": result["world_size"], "TP x DP": result["tp"]}


def predicted(result: dict, config: dict, label: str):
    shape, n = shape_of(config, result["world_size"]), result["world_size"]
    if label == "PP x DP":
        return pipeline_messages(shape, n, result["pp"], result["microbatches"])
    return step_messages(shape, n, tp_sizes(result)[label])


def report(result: dict, config: dict) -> str:
    n = result["world_size"]
    shape, model = shape_of(config, n), CostModel.load()
    lines = [f"the small transformer (vocab {config['vocab']}, hidden {config['hidden']}, {config['heads']} heads, "
             f"{config['layers']} blocks, seq {config['seq']}) on {n} ranks, global batch "
             f"{n * config['batch_size']}, {config['backend']}; TP x DP is {result['tp']} x "
             f"{n // result['tp']}, PP x DP {result['pp']} x {n // result['pp']} with {result['microbatches']} "
             "microbatches (1F1B); medians over rounds, the slowest rank:",
             f"  {'variant':<8} {'s / step':>9} {'/ DP':>6} {'TP bytes / step':>16} {'DP bytes / step':>16} "
             f"{'PP bytes / step':>16} {'model TP s':>11} {'model DP s':>11} {'model PP s':>11} {'bubble':>7}"]
    dp = statistics.median(result["times_s"]["DP"])
    for label, t in result["times_s"].items():
        e = result["elements"][label]
        plan = predicted(result, config, label)
        s = plan.seconds(model)
        lines.append(f"  {label:<8} {statistics.median(t):>9.4f} {statistics.median(t) / dp:>6.2f} "
                     f"{e['tp'] * 4:>16,} {e['dp'] * 4:>16,} {e['pp'] * 4:>16,} {s['tp']:>11.4f} {s['dp']:>11.4f} "
                     f"{s['pp']:>11.4f} {plan.bubble:>7.3f}")
    lines.append("bytes: the payload of every all_reduce a rank issues in one step (float32), activations (TP) "
                 "and gradient buckets (DP), and the activations and gradients it sends its neighbour stages (PP); "
                 "PP's DP bytes: rank 0's stage's, its model the average stage's")
    lines.append(f"model: the alpha-beta-gamma time of those all_reduces as rings ({model.source or 'cost model'}); "
                 "TP's are all on the critical path, DP's overlap the backward")
    t0 = break_even_tokens(shape)
    lines.append(f"TP sends fewer bytes than DP below {t0:,.0f} tokens per step per TP group; this step has "
                 f"{shape.tokens:,} (ddp_from_scratch/tensor_parallel/messages.py)")
    lines.append(f"a pipeline stage sends fewer bytes than a DP rank below {pipeline_break_even_tokens(shape):,.0f} "
                 f"tokens per step per replica; this step has {shape.tokens // (n // result['pp']):,}; what it pays "
                 "instead is the bubble, compute idled, not messages")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to spawn (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="the TP size of the TP x DP mesh (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="the pipeline stages of PP x DP (default 2)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="PP x DP's microbatches a step (default twice --pp)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "shm"], help="for every group (default gloo)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per DP rank (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21, help="rounds (default 21); one more warms up")
    parser.add_argument("--json", default=None, help="also write every round's times here")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_at_least(parser, args, {"--world-size": 2, "--tp": 1, "--batch-size": 1, "--seq": 1, "--rounds": 1,
                                      "--vocab": 1, "--hidden": 1, "--heads": 1, "--layers": 1})
    cli.check_outputs(parser, {"--json": args.json})
    for flag, value in (("--tp", args.tp), ("--world-size", args.world_size)):
        for what, size in (("--heads", args.heads), ("--vocab", args.vocab), ("--hidden x 4", 4 * args.hidden)):
            if size % value:
                parser.error(f"{flag} {value} must divide {what} ({size}): the model is split over that many ranks")
    if args.world_size % args.tp:
        parser.error(f"--tp {args.tp} must divide --world-size {args.world_size}")
    cli.check_at_least(parser, args, {"--pp": 1, "--microbatches": 1})
    args.microbatches = args.microbatches or 2 * args.pp
    if args.world_size % args.pp:
        parser.error(f"--pp {args.pp} must divide --world-size {args.world_size}")
    if args.pp > args.layers + 2:
        parser.error(f"--pp {args.pp}: the model has {args.layers + 2} pieces to cut (the embedding, --layers "
                     f"{args.layers} blocks, the head), at least one a stage")
    if args.pp > args.microbatches:
        parser.error(f"--microbatches {args.microbatches}: 1F1B needs at least as many as --pp {args.pp}")
    replica = args.world_size * args.batch_size // (args.world_size // args.pp)
    if replica % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} must divide the {replica} sequences a pipeline replica "
                     "takes a step (--batch-size x --pp)")
    if args.hidden % args.heads:
        parser.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    config = {k: getattr(args, k) for k in ("tp", "pp", "microbatches", "backend", "batch_size", "seq", "vocab",
                                            "hidden", "heads", "layers", "rounds")}
    preload(*TRAINING)  # every rank builds an optimizer: the fork server imports what that needs, once
    result = collectives.run(measure, args.world_size, backend="gloo", args=(config,), timeout=3600)[0]
    print(report(result, config))
    if args.json:
        result["command"] = cli.command_line("benchmarks.tensor_parallel", argv)
        cli.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
