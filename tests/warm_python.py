"""`python FILE` for many files, each without paying for `import torch`: one interpreter imports
torch (and pytest) once, then forks a child per file, which runs it as `python FILE` would.

    with WarmPython() as python:
        out = python.run(["example.py"], cwd=folder, timeout=300)   # out.returncode, out.stdout, out.stderr
        out = python.run(["-m", "pytest", "-q", "test_x.py"], cwd=folder)

A fresh interpreter spends ~2.5 s of CPU on 2 cores importing torch, most of a short example's
cost. What the child runs still starts from nothing of its own: the file runs as `__main__` in a
module of its own (runpy, as `python FILE` does), with sys.argv and sys.path[0] set as that
command sets them, its standard output and error in files, in a session of its own (a timeout
kills everything it started), and its atexit handlers run at its end. What differs: modules the
warm interpreter imported are already in sys.modules, so a file that forgot an import of torch
still fails (its names are its own) but one that relies on importing torch first does not show
it. Ranks the file starts by forkserver or spawn are fresh processes as always.

The warm interpreter starts no thread of its own and runs no torch operation before it forks: it
is in the state of multiprocessing's fork server after its preload, which forks every pooled rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional

# What the warm interpreter imports once: what the examples and test files import first.
PRELOAD = ("torch", "torch.distributed", "collectives", "pytest", "hypothesis")

_SERVER = r"""
import importlib, json, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
requests, replies = sys.stdin, sys.stdout


def child(request):
    import atexit, runpy, traceback

    os.setsid()
    os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
"""


class WarmPython:
    """One warm interpreter; `run` one file (or `-m module`) at a time through it."""

    def __init__(self, preload=PRELOAD):
        self._preload = tuple(preload)
        self._server: Optional[subprocess.Popen] = None
        self._unread = b""  # what the server has written past the last line read

    def __enter__(self) -> "WarmPython":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen([sys.executable, "-c", _SERVER, *self._preload], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, bufsize=0)
            self._unread = b""
        return self._server

    def run(self, argv: List[str], cwd, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
        """What `subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
        timeout=timeout)` returns, from a fork of the warm interpreter. On a timeout the file's
        whole session is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
        server = self._start()
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": out, "stderr": err,
                       "env": dict(os.environ if env is None else env)}
            server.stdin.write((json.dumps(request) + "\n").encode())
            pid = self._line(server, None)["pid"]
            reply = self._reply(server, pid, timeout, argv)
            with open(out) as o, open(err) as e:
                stdout, stderr = o.read(), e.read()
        return subprocess.CompletedProcess([sys.executable, *argv], reply["returncode"], stdout, stderr)

    def _line(self, server: subprocess.Popen, timeout: Optional[float]) -> Optional[dict]:
        """The server's next reply, or None if none comes within `timeout` seconds. Read straight
        from the pipe: a buffered reader could hold the next reply already while select() waits."""
        import select

        fd = server.stdout.fileno()
        while b"\n" not in self._unread:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended (exit code {server.wait()})")
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        return json.loads(line)

    def _reply(self, server: subprocess.Popen, pid: int, timeout: float, argv) -> dict:
        reply = self._line(server, timeout)
        if reply is not None:
            return reply
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._line(server, None)  # the server reaps it and can take the next file
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None
