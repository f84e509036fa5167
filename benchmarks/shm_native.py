"""The shm backend's native path against its Python path, Gloo, a floor and DeepSpeed's
shared-memory all_reduce, side by side in one run: float32 sum all_reduce, 8 B to 64 MiB.

    python -m benchmarks.shm_native --world-size 2 --json shm-native-2.json
    python -m benchmarks.shm_native --world-size 4
    python -m benchmarks.shm_native --world-size 2 --busy 1 -e 4M   # a process busy on one core beside the ranks
    python -m benchmarks.shm_native -b 256K -e 2M --setting COLLECTIVES_SHM_WORKER_NICE=0   # a setting against its default

The variants are groups over the same ranks: "gloo"; "shm python" and "shm native"
(COLLECTIVES_SHM_PATH, read as a group is made); "shm direct", collectives.shm.all_reduce on the
"shm native" group (the same engine call, made without torch's dispatch: collectives/shm/direct.py);
"floor", a native group whose all_reduce returns a finished Future at once and moves nothing
(torch's dispatch of dist.all_reduce, the Backend and its Future: what any backend of this design
costs through dist.all_reduce); and "deepspeed", deepspeed.comm's
inference_all_reduce (its C++ shared-memory op), where DeepSpeed can be imported (the optional
extra: pip install -e ".[deepspeed]"; else a line says why it is left out). Each --setting
VAR=VALUE adds a group made with that setting (collectives/shm/config.py), a variant named
"native VAR=VALUE" beside the default one ("python VAR=VALUE" where the setting moves the group
to the Python path).

Each round the sizes come in a shuffled order and, for each size, the variants in a shuffled
order (the same on every rank); a variant's turn is a barrier on its group, then back-to-back
calls, timed together: as many as fit in --budget-ms at the fastest pace the cell has had so far
(the first round's WARMUP_TURNS turns, a warm-up not counted, then each timed turn; at least 1,
at most --iters; the same number on every rank: calls_per_turn). A cell is the median over
rounds of the slowest rank's microseconds per call; the JSON keeps the count of each cell's last
turn. Before its first turn every variant all-reduces rank + 1 once and counts the elements that
are not the closed form n (n + 1) / 2 (#wrong).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import collectives
import collectives.shm as shm
from collectives import cli, machine
from collectives.shm import backend_of, new_group_with
from collectives.shm.config import ShmConfig, parse_settings

from .parts.sweep import check_sweep, parse_size, shm_setting, size_list

VARIANTS = ("gloo", "shm python", "shm native", "shm direct", "floor", "deepspeed")
WARMUP_TURNS = 3  # the first round's turns of each cell, of WARMUP_CALLS calls each
WARMUP_CALLS = 3


def calls_per_turn(paces, budget_ms: float, iters: int) -> int:
    """How many back-to-back calls a cell's next turn makes: as many of `iters` as fit in budget_ms
    at the fastest pace (seconds per call, the slowest rank's) the cell has had so far, at least one.

    The fastest, not the first or the mean: under load one warm-up turn that lost its core for a
    few milliseconds would otherwise leave its cell at one call a turn for the whole run, and a
    turn of one call times the ranks' uneven wake-up from the barrier along with the call. With
    the count set once by the first warm-up call, 2 ranks of the 2-core VM with a process busy
    beside them had `shm direct` at 1.7 times `shm native` at 32 KiB, in 37 rounds of 40 of one
    run, and at 0.7 times in the next run; the two make the same engine call
    (collectives/shm/direct.py)."""
    pace = min(paces)
    return max(1, min(iters, int(budget_ms / 1e3 / pace) if pace > 0 else iters))


def _shm_group(path: str):
    return new_group_with({"COLLECTIVES_SHM_PATH": path})


def _deepspeed():
    """deepspeed.comm's inference_all_reduce on the world, or (None, why not)."""
    try:
        import deepspeed.comm as ds
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to leave it out
        return None, f"deepspeed cannot be imported ({type(exc).__name__}: {exc}); pip install -e \".[deepspeed]\""
    try:
        os.environ["LOCAL_SIZE"] = str(dist.get_world_size())  # its shared-memory op runs only when it says so
        ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        probe = torch.full((4,), float(dist.get_rank() + 1))
        ds.inference_all_reduce(probe)
    except Exception as exc:  # noqa: BLE001
        return None, f"deepspeed's inference_all_reduce failed here ({type(exc).__name__}: {exc})"
    return ds.inference_all_reduce, ""


def _deepspeed_files() -> list:
    try:
        return [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith("deepspeed_")]
    except OSError:
        return []


def _busy(k: int):
    """k processes that each keep one core busy (a loop in Python), until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def variant_name(setting: str) -> str:
    """A --setting's column: the path its group runs on, then the setting ("native
    COLLECTIVES_SHM_WORKER_NICE=0"; "python COLLECTIVES_SHM_PATH=python", not "native ...")."""
    path = ShmConfig.from_env({"COLLECTIVES_SHM_PATH": "native", **parse_settings(setting)}).path
    return f"{path} {setting}"


def measure(env, config) -> dict:
    torch.set_num_threads(1)
    n = env.world_size
    groups = {"gloo": dist.new_group(backend="gloo"), "shm python": _shm_group("python"),
              "shm native": _shm_group("native"), "floor": _shm_group("native")}
    backend_of(groups["floor"]).state.engine.moves_nothing = True
    named = {}
    for setting in config["settings"]:  # a group each, made with the setting: on the native path unless it says
        named[variant_name(setting)] = setting
        groups[variant_name(setting)] = new_group_with({"COLLECTIVES_SHM_PATH": "native", **parse_settings(setting)})
    calls = {name: (lambda t, g=g: dist.all_reduce(t, group=g)) for name, g in groups.items()}
    calls["shm direct"] = lambda t, g=groups["shm native"]: shm.all_reduce(t, group=g)
    turn_group = {**groups, "shm direct": groups["shm native"]}  # each variant's barrier (else the world's)
    ds_call, ds_why = _deepspeed() if "deepspeed" in config["variants"] else (None, "not asked for")
    if ds_call is not None:
        calls["deepspeed"] = ds_call
    calls = {k: v for k, v in calls.items() if k in config["variants"] or k in named}
    wrong = {}
    for name, call in calls.items():
        if name == "floor":
            continue
        t = torch.full((1000,), float(env.rank + 1))
        call(t)
        wrong[name] = int((t != n * (n + 1) / 2).sum())
    sizes = size_list(config["minbytes"], config["maxbytes"], config["stepfactor"], with_end=True)  # the largest always
    buffers = {nbytes: torch.zeros(max(1, nbytes // 4)) for nbytes in sizes}
    times = {name: {nbytes: [] for nbytes in sizes} for name in calls}
    shm_of = {name: backend_of(turn_group[name]) for name in calls if name in turn_group and name != "gloo"}
    waits = {name: {nbytes: [0, 0, 0, 0] for nbytes in sizes} for name in shm_of}  # calls, spun, cut, slept
    order = random.Random(0)
    counts: dict = {}
    paces: dict = {}
    busy = _busy(config["busy"]) if env.rank == 0 and config["busy"] else []
    try:
        for rnd in range(config["rounds"] + 1):
            for nbytes in order.sample(sizes, len(sizes)):
                for name in order.sample(list(calls), len(calls)):
                    call, t = calls[name], buffers[nbytes]
                    # the same on every rank: from the slowest rank's paces so far (the first round's
                    # warm-up turns, then every timed turn), so one slow warm-up does not last
                    seen = paces.setdefault((name, nbytes), [])
                    if rnd:
                        turns, k = 1, calls_per_turn(seen, config["budget_ms"], config["iters"])
                    else:
                        turns, k = WARMUP_TURNS, min(WARMUP_CALLS, config["iters"])
                    for _ in range(turns):
                        dist.barrier(group=turn_group.get(name))
                        before = _wait_counts(shm_of.get(name))
                        start = time.perf_counter()
                        for _ in range(k):
                            call(t)
                        per = (time.perf_counter() - start) / k
                        if rnd and name in shm_of:
                            after = _wait_counts(shm_of[name])
                            cell = waits[name][nbytes]
                            cell[0] += k
                            for i in range(3):
                                cell[i + 1] += after[i] - before[i]
                        slowest = torch.tensor([per], dtype=torch.float64)
                        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # on the Gloo world, outside what is timed
                        seen.append(slowest.item())
                    if rnd:
                        times[name][nbytes].append(seen[-1] * 1e6)
                        counts[(name, nbytes)] = k
            if env.rank == 0:
                print(f"[round {rnd}/{config['rounds']}]", file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    totals = torch.tensor([c for per in waits.values() for cell in per.values() for c in cell], dtype=torch.int64)
    dist.all_reduce(totals)  # every rank's waits together
    it = iter(totals.tolist())
    waits = {name: {str(s): dict(zip(("calls", "spun", "cut", "slept"), (next(it) for _ in range(4))))
                    for s in sizes} for name in waits}
    return {"world_size": n, "sizes": sizes, "waits": waits, "times_us": {k: {str(s): v for s, v in per.items()}
                                                           for k, per in times.items()},
            "calls_per_turn": {name: {str(s): counts[(name, s)] for s in sizes} for name in calls},
            "wrong": wrong, "deepspeed_left_out": "" if ds_call is not None else ds_why,
            "busy": config["busy"], "cores": machine.cpus()}


def _wait_counts(group_backend) -> tuple:
    """(spun, cut, slept) of this rank's waits on an shm group so far (ProcessGroupShm.spins and
    .sleeps); zeros for a variant without one."""
    if group_backend is None:
        return (0, 0, 0)
    spins = group_backend.spins()
    return (spins["spun"], spins["cut"], group_backend.sleeps()["slept"])


def wait_report(result: dict) -> str:
    """Per shm variant and size, over every rank's timed calls: the waits at a barrier that spun,
    those whose spin reading the machine cut short, and the futex sleeps, each per rank and call."""
    lines = ["waits per rank and call (every rank's timed calls): spun / cut short / slept in the kernel"]
    for name, per in result.get("waits", {}).items():
        cells = []
        for s in result["sizes"]:
            w = per[str(s)]
            calls = max(1, w["calls"])
            cells.append(f"{_size(s)} {w['spun'] / calls:.2f}/{w['cut'] / calls:.2f}/{w['slept'] / calls:.2f}")
        lines.append(f"  {name}: " + ", ".join(cells))
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def report(result: dict) -> str:
    names = list(result["times_us"])
    med = {k: {int(s): statistics.median(v) for s, v in per.items()} for k, per in result["times_us"].items()}
    head = ["bytes"] + [f"{k} us" for k in names]
    ratios = [("shm native", k) for k in ("gloo", "shm python", "deepspeed") if k in med and "shm native" in med]
    ratios += [("shm direct", "deepspeed")] if "shm direct" in med and "deepspeed" in med else []
    ratios += [("shm direct", "shm native")] if "shm direct" in med and "shm native" in med else []
    head += [f"{a.split()[-1]} / {b}" for a, b in ratios]
    rows = []
    for s in result["sizes"]:
        row = [_size(s)] + [f"{med[k][s]:.1f}" for k in names]
        row += [f"{med[a][s] / med[b][s]:.3f}" for a, b in ratios]
        rows.append(row)
    busy = f", {result['busy']} process(es) busy beside them" if result["busy"] else ""
    lines = [f"float32 sum all_reduce on {result['world_size']} ranks, {result['cores']} cores{busy}: microseconds per "
             "call, the slowest rank's, median over rounds (variants alternated within each round)"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    if "floor" in med and "shm native" in med:
        s0 = result["sizes"][0]
        lines.append(f"{_size(s0)}: shm native costs {med['shm native'][s0] - med['floor'][s0]:.2f} us over the floor "
                     "(the same call on a group whose all_reduce returns at once)")
    if "shm direct" in med:
        s0 = result["sizes"][0]
        lines.append(f"{_size(s0)}: shm direct takes {med['shm direct'][s0]:.2f} us (collectives.shm.all_reduce: the "
                     "native call without torch's dispatch)")
    if result["world_size"] + result["busy"] >= result["cores"]:
        lines.append(f"every core holds a rank{' or a busy process' if result['busy'] else ''} "
                     f"({result['world_size'] + result['busy']} on {result['cores']} cores): any other thread "
                     "(a group's loop, a worker, the system) takes some rank's core while the others wait for it, "
                     "so medians jump between neighbouring sizes from run to run; leave a core free for steady "
                     "figures (benchmarks/RESULTS.md, \"When every core holds a rank\")")
    lines.append("#wrong (rank + 1 all-reduced once, against n (n + 1) / 2): "
                 + ", ".join(f"{k} {v}" for k, v in result["wrong"].items()))
    if result["deepspeed_left_out"]:
        lines.append(f"deepspeed left out: {result['deepspeed_left_out']}")
    return "\n".join(lines)


def build_parser():
    parser = cli.ArgumentParser(prog="python -m benchmarks.shm_native", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                        help="largest size (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=8, help="multiply the size by this (default 8)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="what to time (default: all; deepspeed where it can be imported)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7); the first one more warms up")
    parser.add_argument("--iters", type=int, default=500, help="calls per turn at most (default 500)")
    parser.add_argument("--budget-ms", type=float, default=10.0, help="the calls of a turn take about this long (default 10)")
    parser.add_argument("--busy", type=int, default=0, help="processes to keep busy beside the ranks (default 0)")
    parser.add_argument("--setting", action="append", default=[], metavar="VAR=VALUE", type=shm_setting,
                        help="also time a native group made with this COLLECTIVES_SHM_* setting (repeatable; A=1,B=2 for one group with both)")
    parser.add_argument("--json", default=None, help="also write every round's times here")
    parser.add_argument("--waits", action="store_true",
                        help="also print, per shm variant and size, how its barrier waits went: spun, cut short, slept")
    return parser


@cli.command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_sweep(args, parser)
    cli.check_at_least(parser, args, {"--world-size": 2, "--rounds": 1, "--iters": 1, "--stepfactor": 2,
                                      "--busy": 0})
    cli.check_positive(parser, args, ["--budget-ms"])
    cli.check_outputs(parser, {"--json": args.json})
    config = {k: getattr(args, k) for k in ("minbytes", "maxbytes", "stepfactor", "rounds", "iters", "budget_ms",
                                            "busy")}
    config["variants"] = list(dict.fromkeys(args.variants))
    config["settings"] = list(dict.fromkeys(args.setting))
    before = set(_deepspeed_files())
    try:
        result = collectives.run(measure, args.world_size, backend="gloo", args=(config,), timeout=3600)[0]
    finally:
        left = [f for f in _deepspeed_files() if f not in before]
        for f in left:  # DeepSpeed leaves its buffer (69 MB a rank) in /dev/shm after every run
            os.unlink(f)
    print(report(result))
    if args.waits:
        print(wait_report(result))
    if left:
        print(f"removed what DeepSpeed left in /dev/shm: {len(left)} files ({', '.join(map(os.path.basename, left))})")
    if args.json:
        result["command"] = cli.command_line("benchmarks.shm_native", argv)
        cli.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
