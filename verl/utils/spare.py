"""Warm spare workers: a worker that torchrun restarts starts in a fraction of a second instead of ~5 s.

Most of a worker's start is importing torch, transformers and the trainer (`python -X importtime -m
verl.trainer.main_ppo`: ~4.7 s of ~5 s on this machine's 2 cores). Under `torchrun --max-restarts=N`, each local
rank's first worker therefore forks a *spare* right after those imports, before it reads its config or joins the
process group: a process outside torchrun's worker group (its own session, its stdio on /dev/null) that waits on
a unix socket. When torchrun restarts the group, the new worker process
(`python -m verl.trainer.main_ppo`, which imports nothing heavy before `hand_over`) connects to its rank's spare and
hands over its arguments, environment, working directory and stdio; the spare forks a child that runs the trainer
with them (its modules already imported), and the new worker stays as that child's proxy: it forwards signals
to it and exits with its exit code, and the child kills itself the moment the proxy dies (their connection
closes). So torchrun still sees one process per rank, and a rank killed is a rank ended. The spare waits for the
next restart and exits with torchrun's agent. VERL_SPARE=0 turns it off; CUDA builds of torch do without (`supported`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable

__all__ = ["hand_over", "start_spare", "started_by_spare", "supported"]

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
_in_child = False  # this process is a spare's child: it neither hands over nor starts another spare


def _enabled() -> bool:
    return (os.environ.get("VERL_SPARE", "1") != "0" and not _in_child and "LOCAL_RANK" in os.environ
            and _int("TORCHELASTIC_MAX_RESTARTS") > 0)


def _int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def _path() -> str:
    """The rank's socket: one per torchrun agent (the workers' parent) and local rank."""
    return os.path.join(tempfile.gettempdir(), f"verl-spare-{os.getppid()}-{os.environ['LOCAL_RANK']}.sock")


def hand_over(argv: list[str]) -> None:
    """In a worker torchrun restarted: when its rank's spare is waiting, the trainer runs there with `argv` and
    this process exits with its exit code (never returns); otherwise returns at once (the worker starts as usual)."""
    if not _enabled() or _int("TORCHELASTIC_RESTART_COUNT") == 0 or not os.path.exists(_path()):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_path())
        msg = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [len(msg).to_bytes(8, "little") + msg], [0, 1, 2])
        pid = int.from_bytes(_exactly(sock, 8), "little")
    except OSError:
        sock.close()  # a stale socket, or the spare died: start as usual (start_spare replaces it)
        return
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _frame: _signal(pid, s))
    try:
        code = int.from_bytes(_exactly(sock, 4), "little", signed=True)
    except OSError:
        code = 1  # the child died without a word (killed): the rank failed
    os._exit(code)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the other side closed the connection")
        data += chunk
    return data


def supported() -> bool:
    """Spares need a CPU build of torch: with CUDA (or ROCm) the trainer's GPU state would start in a fork of a
    process that loaded the GPU runtime, which this has not been tested on; those builds start as usual."""
    import torch
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def start_spare(run: Callable[[list[str]], int]) -> None:
    """In a worker torchrun may restart, once the heavy imports are done: forks this rank's spare (when none is
    waiting), which later runs `run(argv)` for each restarted worker that hands over."""
    if not _enabled() or not supported():
        return
    path, agent = _path(), os.getppid()
    if os.path.exists(path):
        os.unlink(path)  # hand_over could not use it: a spare that died
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # before the fork: a restart right after this finds it
    listener.listen(8)
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle:
        listener.close()
        os.waitpid(middle, 0)
        return
    try:  # a double fork: the spare belongs to no worker, in a session of its own
        os.setsid()
        if os.fork():
            os._exit(0)
        _serve(listener, path, agent, run)
    finally:
        os._exit(0)


def _serve(listener: socket.socket, path: str, agent: int, run: Callable[[list[str]], int]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)  # holds no pipe of the job open (a reader waiting for its end would wait for the spare)
    os.close(null)
    listener.settimeout(0.5)
    try:
        while _alive(agent):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                _reap()
                continue
            if os.fork() == 0:
                listener.close()
                _child(conn, run)
            conn.close()
            _reap()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _child(conn: socket.socket, run: Callable[[list[str]], int]) -> None:
    """A restarted worker's trainer, in a fork of the spare, with the proxy's arguments, environment and stdio."""
    global _in_child
    _in_child = True
    code = 1
    try:
        conn.settimeout(None)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        size = int.from_bytes(data[:8], "little")
        data = data[8:]
        while len(data) < size:
            data += _exactly(conn, size - len(data))
        msg = json.loads(data)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        conn.sendall(os.getpid().to_bytes(8, "little"))
        threading.Thread(target=_die_with_proxy, args=(conn,), daemon=True, name="verl-spare-proxy").start()
        code = int(run(msg["argv"]) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's own failure: shown, and the rank fails
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(code.to_bytes(4, "little", signed=True))
        except (OSError, ValueError):
            pass
        os._exit(code)


def _die_with_proxy(conn: socket.socket) -> None:
    """The proxy is the process torchrun watches and kills: when it is gone, so is this one, at once."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def started_by_spare() -> bool:
    """This process is a restarted worker's trainer running in a spare's fork."""
    return _in_child

