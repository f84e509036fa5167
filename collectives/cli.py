"""What the project's command-line programs share: how they end, and how they show progress.

    @cli.command
    def main(argv=None) -> int: ...        # Ctrl-C, a failed rank: a clear message, no traceback

    print(f"\\rstep {k}/{n} {cli.eta(k, n, elapsed)}", end="", file=sys.stderr)

- Ctrl-C ends the progress line first, says "interrupted", and exits with 130 (the shell's
  code for SIGINT); the ranks are stopped by the pool on the way out.
- A `RankFailure` prints its message (which leads with the rank that failed first and why) and
  exits with 1, instead of the launcher's own traceback glued under it.
- An output that cannot be written (a full disk, /dev/full) is one line naming the flag and the
  path, and exit code 1 (output_files.py says how each kind of path is written).
- A standard output that its reader closed (`... | head`) ends the program quietly, with exit
  code 141 as a shell's program killed by SIGPIPE has; a broken pipe of the program's own (to a
  rank, a socket) is still an error with its traceback.
- Anything else is a bug in the program and keeps its traceback.
SIGTERM and SIGKILL need nothing here: the ranks watch their parent and end with it (launcher/pool.py).

Checks every program makes before its work, each a usage error (exit 2) naming the flag:

    cli.check_outputs(parser, {"--json": args.json, "--plot": args.plot})  # writable, room, matplotlib
    cli.check_memory(parser, "-e", need_bytes, "2 ranks x 3 buffers of 1 TiB")  # before allocating
    data = cli.load_json(parser, "--replot", path, keys=("rows",))  # missing, corrupt, wrong keys
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import shlex
import sys
from typing import Callable, Iterable, Optional

from .errors import RankFailure
from .machine import available_memory
from .output_files import OutputError, check_outputs, save_figure, write_json, write_output  # noqa: F401 (the programs' names)


def program_name(module: Optional[str] = None) -> str:
    """How the running program is typed: "python -m <its module>". `module`: a main's __module__,
    which is "__main__" under `python -m` (then the module comes from __main__'s spec, without a
    package's ".__main__"); None: the program that is running. A package's program.py whose
    package runs it (its __main__.py) is named as the package: `python -m pkg`."""
    if module in (None, "__main__"):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None and spec.name else None
        if module is None:  # a script run by its path
            return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if module.endswith(".__main__"):
        module = module[: -len(".__main__")]
    elif module.endswith(".program") and importlib.util.find_spec(module[: -len(".program")] + ".__main__"):
        module = module[: -len(".program")]
    return f"python -m {module}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with usage errors in one line, `prog: error: what is wrong (--help for
    usage)`, exit code 2, instead of the whole usage block first (15 lines for the benchmarks).
    prog defaults to "python -m <the running module>" (program_name), not the file's name."""

    def __init__(self, *args, **kwargs):
        if not args and "prog" not in kwargs:
            kwargs["prog"] = program_name()
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def _value_of(parser, args, flag: str):
    """args' value for `flag` as typed ("--batch-size", "-n"), found by the parser's own option."""
    for action in parser._actions:
        if flag in action.option_strings:
            return getattr(args, action.dest)
    raise KeyError(f"{parser.prog} has no option {flag}")


def check_at_least(parser, args, minimums) -> None:
    """`FLAG must be at least N, got V` (a usage error) for the first flag under its minimum;
    minimums: {flag as typed: least} (a flag left at None is not checked)."""
    for flag, least in minimums.items():
        value = _value_of(parser, args, flag)
        if value is not None and value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")


def check_positive(parser, args, flags, unit: str = "") -> None:
    """`FLAG must be a positive number[ of UNIT], got V` for the first flag that is not a finite
    number above 0 (nan, inf, 0, negative); a flag left at None is not checked."""
    for flag in ([flags] if isinstance(flags, str) else flags):
        value = _value_of(parser, args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a positive number{' of ' + unit if unit else ''}, got {value}")


def command_line(program: str, argv: Optional[Iterable[str]] = None) -> str:
    """The command that reruns this program: "python -m <program>" and its arguments, each quoted
    where the shell needs it (`--variants "shm native"`), so a result file's command can be pasted
    back. argv: the program's arguments (sys.argv[1:] when None)."""
    return " ".join(["python -m " + program, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def format_seconds(seconds: float) -> str:
    """3725 -> "1 h 2 min", 83 -> "1 min 23 s", 4.2 -> "4 s"."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds} s"


def eta(done: float, total: float, elapsed: float) -> str:
    """"~1 min 5 s left" from the work done so far and its time, assuming a steady rate."""
    if done <= 0 or total <= done:
        return "" if total <= done else "estimating time left"
    return f"~{format_seconds(elapsed / done * (total - done))} left"


def eta_by_size(done: list, left: list) -> str:
    """"~1 min 5 s left" for a sweep over sizes: each size is taken to cost a + b * bytes, with a
    (the latency) the fastest size so far and b from the largest size done. Counting the work in
    bytes alone is absurd at the start of a sweep (an 8-byte call that takes 40 us "predicts"
    days for 1 GiB); this is optimistic there instead and exact once the sizes are
    bandwidth-bound. `done`: (bytes, seconds) of every size measured; `left`: the bytes to come."""
    if not done:
        return "estimating time left" if left else ""
    if not left:
        return ""
    a = min(t for _, t in done)
    big_bytes, big_time = max(done)
    b = max(0.0, big_time - a) / big_bytes if big_bytes else 0.0
    return f"~{format_seconds(sum(a + b * n for n in left))} left"


def compile_cache_outside_tmp() -> None:
    """Keep torch's compile cache out of the temporary directory, unless the user placed it.

    Constructing any torch optimizer imports torch._dynamo, which creates
    /tmp/torchinductor_<user> (TORCHINDUCTOR_CACHE_DIR's default) although nothing here compiles.
    Every rank and every program of this project points it at ~/.cache/torchinductor instead
    (XDG_CACHE_HOME respected): one directory, reused, and nothing new in /tmp after a run.
    """
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "torchinductor"))


def check_memory(parser, flag: str, need: int, what: str, available: Optional[int] = None) -> None:
    """Refuse a size that cannot fit before anything is allocated (a rank killed by the OOM killer
    half-way through a sweep, or a machine swapping, is the alternative). `what` says how `need`
    was counted, e.g. "2 ranks x 3 buffers of 1 TiB"."""
    available = available_memory() if available is None else available
    if available is not None and need > available:
        parser.error(f"{flag}: {what} need ~{format_bytes(need)}, and this machine has {format_bytes(available)} available")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def load_json(parser, flag: str, path: str, keys: Iterable[str] = (), what: str = "result file"):
    """A JSON object from `path`, or a usage error naming the file: missing, unreadable, not JSON,
    or without the keys the program reads."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        parser.error(f"{flag} {path}: no such file")
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot read it ({exc.strerror or exc})")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        parser.error(f"{flag} {path}: not a JSON {what} ({exc})")
    if not isinstance(data, dict):  # a list or a string holding the key names must not pass as one
        kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        with_keys = f" with {', '.join(repr(k) for k in keys)}" if keys else ""
        parser.error(f"{flag} {path}: not a {what} (a JSON {kinds.get(type(data), 'value')} where an object{with_keys} "
                     "is expected)")
    missing = [k for k in keys if k not in data]
    if missing:
        parser.error(f"{flag} {path}: not a {what} (no {', '.join(repr(k) for k in missing)})")
    return data


def command(main: Callable[..., int]) -> Callable[..., int]:
    """Decorate a program's main(argv=None) -> exit code (see the module docstring)."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        compile_cache_outside_tmp()
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C); every rank was stopped", file=sys.stderr, flush=True)
            return 130
        except RankFailure as exc:
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)
            return 1
        except OutputError as exc:  # the work is done; only its file could not be written
            print(f"{program_name(main.__module__)}: {exc}", file=sys.stderr, flush=True)
            return 1
        except BrokenPipeError:
            if not stdout_reader_gone():
                raise
            # what is left in stdout's buffer would fail again as Python exits: send it nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 141

    return wrapped


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end is closed (`program | head` after
    head has read its lines): poll() reports an error on the writing end of such a pipe."""
    import select

    if not hasattr(select, "poll"):  # Windows: no way to ask here, so the error keeps its traceback
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # no stdout, or one without a file descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
