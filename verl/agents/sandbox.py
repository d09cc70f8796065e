"""Sandboxed Python execution: the mechanism behind the agents' ``python`` tool.

    result = run_python("print(2 ** 100)", SandboxLimits(wall_s=5))
    result.ok, result.reason, result.observation()      # True, "ok", "1267650600228229401496703205376"
    ok, why = sandbox_available()                       # check once before training starts

Each call runs ``python main.py`` (the trainer's own interpreter) in a fresh set of Linux namespaces built by
`verl/agents/_sandbox_init.py`:

- **Processes**: a new pid namespace whose init is killed by the kernel when the launcher dies, and which the
  init leaves as soon as the program exits: the kernel then kills everything left inside, so daemons, fork bombs
  and orphans never outlive the call. The wall-clock timeout kills the launcher's process group, which brings the
  namespace down the same way, and so does the trainer's own death (the launcher has PDEATHSIG). The program
  runs in its own session (and scheduler autogroup, niced to `nice`) with RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_NPROC and no core dumps.
- **Identity**: as root, the program runs as a host uid/gid of its own (2,000,000,000 + the launcher's pid), no
  supplementary groups, no capabilities, no_new_privs. As another user, a user namespace maps the program's uid
  onto the caller's own uid (it can do nothing on the host the caller could not) and execve drops its
  capabilities; no_new_privs as well. RLIMIT_NPROC then counts per user namespace (Linux >= 5.14).
- **Files**: a new root on a tmpfs: read-only, nosuid, nodev binds of /usr, /etc, /bin, /sbin, /lib* and the
  interpreter's prefixes (the venv and its base Python); a writable /tmp tmpfs of `disk_mb` (cwd, HOME, TMPDIR,
  holding main.py); a /proc of the new pid namespace; /dev/null, zero, full, random, urandom. The host's tree is
  detached (pivot_root): the checkout, /work, /home, /root, ~/.cache and every other path are not there at all,
  except the interpreter's own directories (e.g. a venv in ~/.cache/verl: that one directory, read-only, none of
  its siblings). Nothing is written on the host: /tmp lives in memory and goes with the namespace (the host
  holds one empty directory, $TMPDIR/verl-sandbox-<uid>, that every sandbox mounts its private root on).
- **Network**: a new network namespace with only a downed loopback (``network=True`` skips it and shares the
  host's network, abstract unix sockets included). SysV IPC and the hostname are private too.
- **Environment**: scrubbed: PATH, HOME=TMPDIR=/tmp, a UTF-8 locale, single-threaded BLAS; nothing inherited.

Not isolated: the kernel itself (no seccomp filter; a kernel exploit escapes), memory across processes (each
process is bounded by `memory_mb`, so the whole tree by `max_procs` x `memory_mb`; /tmp adds `disk_mb`), CPU
across processes (each `cpu_s`; the tree is bounded by `wall_s`), host-wide information in /proc (cpuinfo,
meminfo, the kernel version, /proc/sys) and the readable files of the bound directories (world-readable ones as
root; those readable by the caller in user-namespace mode). Where the namespaces cannot be created, every call
raises `VerlRuntimeError` naming why: the code never runs without its isolation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import marshal
import os
import re
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl.config.base import check_finite, require
from verl.errors import VerlRuntimeError

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "run_python_async", "sandbox_available"]

_LAUNCHER = str(Path(__file__).with_name("_sandbox_init.py"))
_UID_BASE = 2_000_000_000  # root mode: uid = base + launcher pid (pid_max <= 2**22), never a real account
_USERNS_UID = 65534  # user-namespace mode: the program's uid inside its namespace ("nobody")
_NS = {"NEWNS": 0x00020000, "NEWUTS": 0x04000000, "NEWIPC": 0x08000000, "NEWUSER": 0x10000000,
       "NEWPID": 0x20000000, "NEWNET": 0x40000000}
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_GRACE_S = 5.0  # after a kill, how long the namespace may take to disappear before the pipes are abandoned
_STATUS_MAX = 1 << 16
_POOL_SIZE = 64


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Limits of one sandboxed Python run (see verl.agents.sandbox for what is isolated)."""

    wall_s: float = 10.0
    """Wall-clock timeout in seconds; at expiry every process of the run is killed (reason "timeout")."""
    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds; reason "cpu_limit")."""
    memory_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS; a MemoryError gives reason "memory_limit")."""
    file_mb: int = 16
    """Largest file the program may write, in MiB (RLIMIT_FSIZE; reason "file_limit")."""
    disk_mb: int = 64
    """Size in MiB of the program's writable /tmp (a tmpfs in memory; a full one gives reason "disk_limit")."""
    max_procs: int = 32
    """Processes and threads the program may run at once (RLIMIT_NPROC; reason "process_limit")."""
    output_bytes: int = 8192
    """Bytes of stdout + stderr kept; a program that writes more is stopped and its output marked truncated."""
    network: bool = False
    """False: a fresh network namespace with no interfaces up (no network at all). True: the host's network."""
    nice: int = 10
    """Scheduling niceness (0-19; never below the trainer's) of the program and of its scheduler autogroup, so
    that many concurrent programs do not take CPU from the trainer (each sandbox is its own session, which Linux
    otherwise weighs like the trainer's whole process)."""

    def check(self) -> None:
        check_finite(self)
        for name in ("wall_s", "cpu_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        require(self.memory_mb >= 32, "memory_mb", self.memory_mb, "must be >= 32 (Python needs ~20 MiB to start)")
        for name in ("file_mb", "disk_mb", "max_procs", "output_bytes"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(0 <= self.nice <= 19, "nice", self.nice, "must be in [0, 19] (0: the trainer's priority)")


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    """How one sandboxed run ended."""

    ok: bool
    """The program exited 0 within every limit."""
    exit_code: int | None
    """Its exit code; -N if killed by signal N; None if the sandbox stopped it (timeout, output limit)."""
    stdout: str
    """Standard output (UTF-8, undecodable bytes replaced), at most `output_bytes` together with stderr."""
    stderr: str
    """Standard error, tracebacks included."""
    truncated: bool
    """More output was written than `output_bytes`; only the first bytes are kept."""
    reason: str
    """"ok", "error" (non-zero exit), "timeout", "cpu_limit", "memory_limit", "file_limit", "disk_limit",
    "process_limit", "output_limit" or "killed" (by another signal)."""
    wall_s: float
    """Wall-clock seconds of the whole call, sandbox start-up included."""
    detail: str = ""
    """One line explaining `reason` (empty when ok and complete)."""
    cpu_s: float = 0.0
    """CPU seconds used by the program's main process (0 when the sandbox stopped it)."""

    def observation(self) -> str:
        """The text the model sees: the output, then a one-line bracketed reason when the run was not ok."""
        text = self.stdout
        if self.stderr:
            text += ("" if not text or text.endswith("\n") else "\n") + self.stderr
        lines = [text.rstrip("\n")] if text.strip() else []
        if self.reason != "ok":
            lines.append(f"[{self.reason}: {self.detail}]")
        elif self.detail:
            lines.append(f"[{self.detail}]")
        return "\n".join(lines) if lines else "(no output)"


@dataclass(slots=True)
class _Run:
    """What the parent read from one launcher."""

    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    status: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    stopped: str | None = None  # "timeout" / "output_limit" when the parent killed the run
    launcher_rc: int | None = None


def _isolation_mode() -> str:
    """"root": namespaces plus a per-call host uid; "userns": an unprivileged user namespace."""
    return "root" if os.geteuid() == 0 else "userns"


def _namespace_flags(limits: SandboxLimits, mode: str) -> int:
    flags = _NS["NEWNS"] | _NS["NEWPID"] | _NS["NEWIPC"] | _NS["NEWUTS"]
    if not limits.network:
        flags |= _NS["NEWNET"]
    if mode == "userns":
        flags |= _NS["NEWUSER"]
    return flags


_state_lock = threading.Lock()
_root_dir: str | None = None
_layout_cache: tuple[list[list[str]], dict[str, str]] | None = None
_available: dict[tuple, str] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _mountpoint() -> str:
    """An empty host directory, one per user and kept, that every sandbox mounts its private root tmpfs on (each
    in its own mount namespace, so the host never sees anything in it and nothing needs cleaning up)."""
    global _root_dir
    if _root_dir is None:
        path = os.path.join(tempfile.gettempdir(), f"verl-sandbox-{os.geteuid()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():  # someone else's: use a private one
            path = tempfile.mkdtemp(prefix="verl-sandbox-")
        _root_dir = path
    return _root_dir


def _layout() -> tuple[list[list[str]], dict[str, str]]:
    """Read-only binds ([source, path inside]) and symlinks of the new root: system dirs + the interpreter."""
    global _layout_cache
    if _layout_cache is not None:
        return _layout_cache
    binds, links = [], {}
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):
            links[top] = os.readlink(top)
        elif os.path.isdir(top):
            binds.append([top, top])
    seen = [b[1] for b in binds]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    for p in sorted(prefixes, key=len):  # shortest first, so a venv inside its base Python is not bound twice
        real = os.path.realpath(p)
        inside = [s for s in seen + [os.path.realpath(x) for x in seen]
                  if p == s or p.startswith(s.rstrip("/") + "/") or real.startswith(s.rstrip("/") + "/")]
        if not inside and os.path.isdir(real):
            binds.append([real, p])
            seen.append(p)
    _layout_cache = (binds, links)
    return _layout_cache


def _spec(limits: SandboxLimits, mode: str, status_fd: int) -> dict:
    binds, links = _layout()
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
           "TMPDIR": "/tmp", "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    return {"ns_flags": _namespace_flags(limits, mode), "root": _mountpoint(), "binds": binds, "symlinks": links,
            "python": sys.executable, "env": env, "status_fd": status_fd, "caller_pid": os.getpid(),
            "uid_base": _UID_BASE, "uid": _USERNS_UID, "gid": _USERNS_UID, "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "disk_mb": limits.disk_mb,
            "max_procs": limits.max_procs, "nice": limits.nice}


def _kill(proc: subprocess.Popen) -> None:
    """Kill the launcher's group; the kernel then kills the namespace init (PDEATHSIG) and everything inside."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, status_r: int, limits: SandboxLimits, deadline: float) -> _Run:
    """Read stdout, stderr and the status pipe until all close, keeping at most `output_bytes` of output."""
    run = _Run()
    bufs = {proc.stdout.fileno(): run.out, proc.stderr.fileno(): run.err, status_r: run.status}
    kept = 0
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if run.stopped is not None:
                    break  # killed and still open after the grace period: give up on the pipes
                run.stopped, deadline = "timeout", time.monotonic() + _GRACE_S
                _kill(proc)
                continue
            for key, _ in sel.select(left):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                elif key.fd == status_r:
                    run.status += chunk[:_STATUS_MAX - len(run.status)]
                else:
                    take = min(len(chunk), limits.output_bytes - kept)
                    bufs[key.fd] += chunk[:take]
                    kept += take
                    if take < len(chunk):  # over the budget: stop reading and stop the program
                        run.truncated = True
                        for fd in (proc.stdout.fileno(), proc.stderr.fileno()):
                            if fd in sel.get_map():
                                sel.unregister(fd)
                        if run.stopped is None:
                            run.stopped, deadline = "output_limit", time.monotonic() + _GRACE_S
                            _kill(proc)
    try:
        run.launcher_rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(proc)
    return run


def _start(source: bytes, limits: SandboxLimits) -> tuple[subprocess.Popen, int]:
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _LAUNCHER, marshal.dumps(_spec(limits, _isolation_mode(), status_w)).hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:  # the launcher reads all of stdin before anything else, so this cannot deadlock with the output
        proc.stdin.write(source)
    except BrokenPipeError:
        pass  # the launcher died at once; its status says why
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    return proc, status_r


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as ``python main.py`` in a fresh sandbox and wait for it. Thread-safe.

    Raises `VerlRuntimeError` when the sandbox cannot be built here (the code is then not run at all).
    """
    limits = limits or SandboxLimits()
    limits.check()
    start = time.monotonic()
    source = code.encode("utf-8", errors="replace")
    if len(source) >= limits.disk_mb << 20:  # main.py lives in the program's /tmp
        return SandboxResult(ok=False, exit_code=None, stdout="", stderr="", truncated=False, reason="disk_limit",
                             wall_s=time.monotonic() - start, detail=f"the program's source ({len(source)} bytes) "
                             f"does not fit in its /tmp ({limits.disk_mb} MiB); it was not run")
    proc, status_r = _start(source, limits)
    try:
        run = _collect(proc, status_r, limits, start + limits.wall_s)
    finally:
        os.close(status_r)
        proc.stdout.close()
        proc.stderr.close()
    return _result(run, limits, time.monotonic() - start)


def _refusal(error: str) -> VerlRuntimeError:
    hint = ""
    if "unshare" in error:
        hint = (" The kernel or the container forbids new namespaces: run the trainer as root (a container needs "
                "CAP_SYS_ADMIN, e.g. docker --privileged or --security-opt seccomp=unconfined), or enable "
                "unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
                "kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0).")
    return VerlRuntimeError(f"the Python sandbox cannot start here: {error}.{hint} The code was not run "
                            "(the sandbox never runs code without its isolation).")


def _result(run: _Run, limits: SandboxLimits, wall: float) -> SandboxResult:
    lines = [x.split("\t") for x in run.status.decode(errors="replace").splitlines()]
    ends = [x for x in lines if x[0] == "end" and len(x) == 4]
    errors = [x[1] for x in lines if x[0] == "error" and len(x) == 2]
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in (run.out, run.err))
    if errors and run.stopped is None:  # the isolation or the interpreter's exec failed: the code never ran
        raise _refusal(errors[0])
    end = ends[0] if ends else None
    exit_code, cpu = (None, 0.0) if end is None else (os.waitstatus_to_exitcode(int(end[1])), float(end[2]))
    if run.stopped == "timeout":
        exit_code, reason, detail = None, "timeout", f"stopped after {limits.wall_s:g} s of wall-clock time"
    elif end is None and run.stopped == "output_limit":
        reason, detail = "output_limit", f"the program wrote more than {limits.output_bytes} bytes and was stopped"
    elif end is None:
        raise VerlRuntimeError(f"the Python sandbox's launcher exited with code {run.launcher_rc} without "
                               f"reporting the program's end; its output: {stderr[-2000:]!r}")
    else:
        reason, detail = _classify(exit_code, cpu, stderr, limits)
    if run.truncated and reason == "ok":
        detail = f"output truncated to its first {limits.output_bytes} bytes"
    return SandboxResult(ok=reason == "ok", exit_code=exit_code, stdout=stdout, stderr=stderr,
                         truncated=run.truncated, reason=reason, wall_s=wall, detail=detail, cpu_s=cpu)


_LIMIT_ERRORS = (  # the final line of a Python traceback → the limit behind it
    (re.compile(r"^[\w.]*MemoryError\b"), "memory_limit", "the program ran out of its {memory_mb} MiB of memory"),
    (re.compile(r"\[Errno 27\]"), "file_limit", "a file grew beyond the {file_mb} MiB limit"),
    (re.compile(r"\[Errno 28\]"), "disk_limit", "the program's /tmp ({disk_mb} MiB) is full"),
    (re.compile(r"\[Errno 11\] Resource temporarily unavailable|can't start new thread"), "process_limit",
     "more than {max_procs} processes/threads"),
)


def _classify(exit_code: int, cpu: float, stderr: str, limits: SandboxLimits) -> tuple[str, str]:
    """(reason, detail) of a program that ended by itself (or was killed by the kernel)."""
    if exit_code == 0:
        return "ok", ""
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
            return "cpu_limit", f"the program used more than {limits.cpu_s:g} s of CPU time and was stopped"
        if sig == signal.SIGXFSZ:
            return "file_limit", f"a file grew beyond the {limits.file_mb} MiB limit"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return "killed", f"the program was killed by signal {name}"
    last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    values = {"memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "disk_mb": limits.disk_mb,
              "max_procs": limits.max_procs, "nice": limits.nice}
    for pattern, reason, detail in _LIMIT_ERRORS:
        if pattern.search(last):
            return reason, detail.format(**values) + f" (exit code {exit_code})"
    return "error", f"exit code {exit_code}"


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _state_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_POOL_SIZE, thread_name_prefix="verl-sandbox")
        return _pool


async def run_python_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """`run_python` without blocking the event loop: each run waits on a thread of a shared pool of 64 (the
    threads only block on pipes; runs beyond 64 at once queue). A cancelled await leaves the run to finish
    within its `wall_s`."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), run_python, code, limits)


def sandbox_available(limits: SandboxLimits | None = None) -> tuple[bool, str]:
    """(True, what isolation is used) if a sandboxed program runs here with these limits, else (False, why).

    Runs one tiny program the first time per limits (~0.1 s); a success is remembered for the process.
    """
    limits = limits or SandboxLimits()
    if not sys.platform.startswith("linux"):
        return False, f"the Python sandbox needs Linux namespaces; this is {sys.platform}"
    mode = _isolation_mode()
    key = (mode, *(getattr(limits, f) for f in SandboxLimits.__slots__))
    with _state_lock:
        if key in _available:
            return True, _available[key]
    probe = SandboxLimits(**{f: getattr(limits, f) for f in SandboxLimits.__slots__})
    probe.wall_s, probe.cpu_s = max(limits.wall_s, 30.0), max(limits.cpu_s, 10.0)  # a loaded machine is no refusal
    try:
        result = run_python("import os, sys\nprint(os.getuid())", probe)
    except VerlRuntimeError as e:
        return False, str(e)
    if not result.ok:
        return False, f"a trivial program fails in the sandbox with these limits: {result.observation()}"
    flags = _namespace_flags(limits, mode)
    spaces = ", ".join(name.lower()[3:] for name, bit in _NS.items() if flags & bit)
    how = "a per-call unprivileged uid" if mode == "root" else "a user namespace mapping the caller's uid"
    desc = f"{mode} mode: {spaces} namespaces, {how}, a read-only root with a tmpfs /tmp"
    with _state_lock:
        _available[key] = desc
    return True, desc
