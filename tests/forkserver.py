"""A warm interpreter that forks one fresh process per script run (tests only).

Importing a training framework costs seconds of CPU in every process (``import
pytorch_lightning`` about 8: torch, torch._dynamo, torchmetrics, transformers; ``import torch``
about 2.5), most of a short training run on a few rows. `Forkserver` imports its ``preload``
modules once, in a process of its own, and runs each script in a child forked from it, as
``multiprocessing``'s forkserver with ``set_forkserver_preload`` does:

* the child is a new process: its own pid and session, memory, working directory,
  environment (exactly the one asked for), stdin, stdout and stderr (the caller's own file
  descriptors, passed over the socket); it runs the script as ``__main__`` with
  ``sys.argv = [script, *args]`` and ends as an interpreter does (``atexit`` handlers,
  non-daemon threads joined), with the exit status a ``python SCRIPT ARGS`` has (1 and the
  traceback on an uncaught exception, ``-N`` when killed by signal N);
* its interpreter state at the start is that of a fresh ``python SCRIPT ARGS`` once it has
  imported the same modules (the global generators of ``random`` and numpy reseeded, as a
  new process seeds them): the server only imports and forks; it never runs a script, so
  nothing of one run reaches the next (state between runs goes through files only);
* a process the script starts itself (Lightning's DDP re-launch of ``sys.argv`` for rank 1,
  worker processes) is started by the script, as without the server;
* a caller that goes away (killed at a timeout) takes the child's whole session with it.

Two callers: `Forkserver.run` (the test process, for ``subprocess.run``) and
``python tests/forkserver.py --client SOCKET SCRIPT ARGS...``, a command another program
runs (``detdata replay-check -- CMD``) that imports nothing heavy, hands its stdin, stdout,
stderr, working directory and environment to a child of the server and exits with its status.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SERVER = Path(__file__).resolve()


class Forkserver:
    """A server importing ``preload`` once (in ``env``: what the modules see at import).
    ``run(script, args, cwd=, env=, timeout=)`` is ``subprocess.run([sys.executable, script,
    *args], cwd=, env=, capture_output=True, text=True, timeout=)`` in a child of it;
    ``client(script)`` the command line that runs ``script`` there from another program.
    `close` ends the server."""

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="forkserver-")
        self.socket = os.path.join(self._dir.name, "server.sock")
        command = [sys.executable, str(SERVER), "--serve", self.socket, json.dumps(preload)]
        command.append(str(os.getpid()))
        self._proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def client(self, script: Path) -> list[str]:
        """``[python, forkserver.py, --client, SOCKET, script]``: append the script's args."""
        return [sys.executable, str(SERVER), "--client", self.socket, str(script)]

    def run(
        self, script: Path, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """One run of ``script`` in a fresh child; its exit status, stdout and stderr. The
        ``timeout`` covers the server's imports too (the first run waits for them)."""
        deadline = time.monotonic() + timeout
        request = {"script": str(script), "args": args, "cwd": str(cwd), "env": env}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            with open(os.devnull, "rb") as null, _connect(self.socket, deadline) as conn:
                _send(conn, request, [null.fileno(), out.fileno(), err.fileno()])
                try:
                    code = _receive_status(conn, deadline)
                except subprocess.TimeoutExpired:
                    raise subprocess.TimeoutExpired([str(script), *args], timeout) from None
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        argv = [sys.executable, str(script), *args]
        return subprocess.CompletedProcess(argv, code, stdout, stderr)

    def close(self) -> None:
        """End the server (no run is in flight: each was waited for)."""
        self._proc.terminate()
        self._proc.wait(timeout=60)
        self._dir.cleanup()


def _connect(path: str, deadline: float) -> socket.socket:
    """A connection to the server, waiting for it to listen (its imports take seconds)."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forkserver", 0) from None
            time.sleep(0.1)


def _send(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """The request as one JSON line, with the child's stdin, stdout and stderr."""
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)


def _receive_status(conn: socket.socket, deadline: float | None) -> int:
    """The child's exit status, which the server sends when it has ended."""
    reply = b""
    while not reply.endswith(b"\n"):
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([conn], [], [], wait)[0]:
            raise subprocess.TimeoutExpired("forkserver", wait or 0)  # closing conn kills it
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError("the fork server closed the connection before the run ended")
        reply += chunk
    return int(json.loads(reply)["returncode"])


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not chunk:
            raise EOFError("the client left before its request was whole")
        data, fds = data + chunk, fds + got
    return json.loads(data), fds


def _child(request: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: become the asked-for process, run the script, return its exit
    status (the caller exits the interpreter with it)."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's own handler is not the script's
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # as a new process seeds it (random reseeds itself at a fork)
        sys.modules["numpy"].random.seed()
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(request["script"])
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _wait(pid: int, conn: socket.socket) -> int:
    """The child's exit status; a client that leaves first (killed at a timeout) takes the
    child's session with it."""
    pidfd = os.pidfd_open(pid)
    try:
        if pidfd not in select.select([pidfd, conn], [], [])[0]:
            for kill in (os.killpg, os.kill):  # (os.kill: killed before its setsid)
                with contextlib.suppress(ProcessLookupError):
                    kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def serve(path: str, preload: list[str], parent: int) -> int:
    """Import ``preload``, listen on ``path``, fork a child per request (one at a time); in
    the child, return its exit status (it ends as an interpreter does); in the server, run
    until terminated or until ``parent`` (the process that started it) is gone."""
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.rename(path + ".tmp", path)  # clients connect once the imports are done
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the test process is gone (killed): so is its server
                return 0
            continue
        conn, _ = listener.accept()
        with conn:
            try:
                request, fds = _receive_request(conn)
            except EOFError:
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                return _child(request, fds)
            for fd in fds:
                os.close(fd)
            code = _wait(pid, conn)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")


def client(path: str, script: str, args: list[str]) -> int:
    """Run ``script`` with ``args`` in a child of the server at ``path``, with this process's
    stdin, stdout, stderr, working directory and environment; its exit status."""
    request = {"script": script, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    with _connect(path, time.monotonic() + 600) as conn:
        _send(conn, request, [0, 1, 2])
        code = _receive_status(conn, None)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])))
    sys.exit(client(sys.argv[2], sys.argv[3], sys.argv[4:]))
