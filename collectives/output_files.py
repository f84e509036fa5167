"""Writing a program's output files (--json, --csv, --plot, checkpoints, traces) without ever
destroying what the path was.

    output_files.check_outputs(parser, {"--json": args.json})   # before the work: a usage error, exit 2
    output_files.write_output(args.json, text, "--json")         # after it: whole or not at all
    output_files.write_json(args.json, result)                   # the same, for a JSON object
    output_files.save_figure(fig, args.plot, "--plot")           # a matplotlib figure

What a path is decides how it is written:

- a regular file, or nothing yet: into a file beside it, then renamed over it, so a full disk,
  an error half-way or a kill leaves the old file (or none), never half of the new one, and no
  temporary file. A symbolic link is followed: its target is replaced and the link kept
  (summary.json -> runs/7/summary.json stays a link). The replaced file keeps its mode.
- this process's own standard output or error, or any open descriptor named as /dev/stdout,
  /dev/fd/N or /proc/self/fd/N: written through that descriptor, after Python's own buffers, so
  `--json /dev/stdout > out.txt` appends to what was printed instead of replacing out.txt.
- anything else that is not a regular file (a character device such as /dev/null, a FIFO):
  opened and written straight into. Renaming over it would replace the device node or the FIFO
  with a plain file, for every process on the machine.

A failure to write (a full disk, /dev/full, a folder removed during the run) raises OutputError,
whose message is one line naming the flag and the path; `cli.command` prints it and exits with 1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import stat
import sys
from typing import BinaryIO, Callable, Optional, Union

MIN_FREE_BYTES = 1 << 20  # an output's disk needs at least this much room before the work starts

Content = Union[str, bytes, Callable[[BinaryIO], None]]


class OutputError(OSError):
    """An output file could not be written: `could not write --json out.json (No space left on device)`."""

    def __init__(self, path: str, flag: Optional[str], cause: OSError):
        self.path, self.flag = path, flag
        reason = cause.strerror or str(cause)
        super().__init__(cause.errno, reason)
        self.message = f"could not write {flag + ' ' if flag else ''}{path} ({reason})"

    def __str__(self) -> str:
        return self.message


_FD = re.compile(r"/(?:proc/(self|\d+)/fd|dev/fd)/(\d+)")


def own_descriptor(path: str) -> Optional[int]:
    """The descriptor of this process that `path` names (/dev/stdout -> 1, /dev/fd/2 -> 2,
    /proc/self/fd/5 -> 5, following the links to get there), or None for any other path."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))  # /dev/fd/1 -> /proc/<pid>/fd/1
        m = _FD.fullmatch(p)
        if m:
            return int(m.group(2)) if m.group(1) in (None, "self", str(os.getpid())) else None
        if not os.path.islink(p):
            return None
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def _write_into(f: BinaryIO, content: Content) -> None:
    if callable(content):
        content(f)
    else:
        f.write(content.encode() if isinstance(content, str) else content)
    f.flush()


def write_output(path: str, content: Content, flag: Optional[str] = None) -> None:
    """Write `content` (text, bytes, or a function that writes into the open binary file, as
    torch.save does) to `path` as the module docstring says: a regular file atomically, a link's
    target, a descriptor through itself, a device or FIFO straight into it. Raises OutputError
    (naming `flag` and `path`) when it cannot be written; nothing is left behind then."""
    try:
        fd = own_descriptor(path)
        if fd is not None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            with os.fdopen(os.dup(fd), "wb") as f:  # a copy of the descriptor: closing it leaves fd open
                _write_into(f, content)
            return
        try:
            mode = os.stat(path).st_mode  # follows links
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            with open(path, "wb") as f:  # a device, a FIFO: never replaced
                _write_into(f, content)
            return
        _replace_file(os.path.realpath(path), content, mode)
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(path, flag, exc) from exc


def _replace_file(target: str, content: Content, mode: Optional[int]) -> None:
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            _write_into(f, content)
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def write_json(path: str, data, flag: Optional[str] = "--json", indent: Optional[int] = 1) -> None:
    """write_output of `data` as JSON (and a final newline)."""
    write_output(path, json.dumps(data, indent=indent) + "\n", flag)


def save_figure(fig, path: str, flag: Optional[str] = "--plot", **savefig_kwargs) -> None:
    """A matplotlib figure written by write_output, in the format the path's ending names (png when it names none)."""
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    buffer = io.BytesIO()  # a name without a known ending (a FIFO, /dev/null) gets matplotlib's default format
    fig.savefig(buffer, format=ext if ext in fig.canvas.get_supported_filetypes() else None, **savefig_kwargs)
    write_output(path, buffer.getvalue(), flag)


def check_outputs(parser, outputs) -> None:
    """Before any work: every output file ({flag: path} or [(flag, path)]; a None path: not asked
    for) can be written where asked, its disk is not full, and a .png can be drawn (matplotlib).
    Nothing is left behind, nothing is truncated, and a device, a FIFO or a link is only looked at."""
    for flag, path in (outputs.items() if isinstance(outputs, dict) else outputs):
        if not path:
            continue
        if os.path.isdir(path):
            parser.error(f"{flag} {path} is a folder; give a file name")
        if own_descriptor(path) is None:
            _check_path(parser, flag, path)
        if path.lower().endswith(".png"):
            if importlib.util.find_spec("matplotlib") is None:
                parser.error(f"{flag} {path}: drawing needs matplotlib: pip install -e '.[plot]'")


def _check_path(parser, flag: str, path: str) -> None:
    target = os.path.realpath(path)  # a link's target is what gets written
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        if not os.access(target, os.W_OK):  # opening a FIFO to try would wait for its reader
            parser.error(f"{flag} {path}: cannot write there (Permission denied)")
        return
    try:
        with open(target, "a"):  # "a": an existing file is not truncated by the check
            pass
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot write there ({exc.strerror or exc})")
    finally:
        if mode is None and os.path.exists(target):
            # every rank of a torchrun or srun job checks the same path: another may remove it first
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
    st = os.statvfs(folder)
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        parser.error(f"{flag} {path}: the disk is full ({st.f_bavail * st.f_frsize} bytes free in {folder})")
