"""The Python sandbox (verl.agents.sandbox): normal use, one test per hostile snippet, the refusal path.

Every hostile test asserts the outcome the model sees, that this (the "trainer") process survives with no child
processes left behind, and that a host directory the snippet attacks is unchanged. Small limits keep each run
well under a second except the CPU-limit one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from verl.agents import sandbox
from verl.agents.sandbox import SandboxLimits, SandboxResult, run_python, run_python_async, sandbox_available
from verl.errors import VerlConfigError, VerlRuntimeError

# nice=0 (the test process's own priority) keeps the suite quick on a loaded machine; test_program_is_niced
# checks the default's mechanism.
SMALL = dict(wall_s=20.0, cpu_s=1.0, memory_mb=160, file_mb=1, disk_mb=4, max_procs=8, output_bytes=4096, nice=0)
REPO = Path(__file__).resolve().parents[2]


def limits(**kw) -> SandboxLimits:
    return SandboxLimits(**{**SMALL, **kw})


def _children() -> set[int]:
    """Live child processes of this process (every thread's)."""
    kids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            kids |= {int(p) for p in (task / "children").read_text().split()}
        except FileNotFoundError:
            pass
    return kids


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _running(marker: str) -> bool:
    for p in Path("/proc").iterdir():
        try:
            if marker.encode() in (p / "cmdline").read_bytes():
                return True
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            pass
    return False


@pytest.fixture
def host(tmp_path):
    """A host directory with a secret in it; after the test: unchanged, no child process left, no mount left."""
    (tmp_path / "secret.txt").write_text("TOKEN=hunter2")
    before, kids = _tree(tmp_path), _children()
    yield tmp_path
    assert _tree(tmp_path) == before
    assert _children() <= kids, "a sandbox process outlived its call"
    assert os.listdir(sandbox._mountpoint()) == [], "the sandbox root leaked onto the host"


def run(code: str, **kw) -> SandboxResult:
    return run_python(code, limits(**kw))


# ---------------------------------------------------------------- normal use

def test_output_ok():
    r = run("print('hello', 6 * 7)")
    assert (r.ok, r.reason, r.exit_code, r.stdout, r.stderr, r.truncated) == (True, "ok", 0, "hello 42\n", "", False)
    assert r.observation() == "hello 42"
    assert run("x = 1").observation() == "(no output)"


def test_exception_gives_traceback_in_stderr():
    r = run("def f():\n    raise ValueError('boom')\nprint('before')\nf()")
    assert (r.ok, r.reason, r.exit_code, r.stdout) == (False, "error", 1, "before\n")
    assert "Traceback (most recent call last)" in r.stderr and 'File "/tmp/main.py", line 4' in r.stderr
    assert r.stderr.rstrip().endswith("ValueError: boom")
    assert r.observation().endswith("ValueError: boom\n[error: exit code 1]")


def test_timeout_keeps_partial_output():
    r = run("import time\nprint('started', flush=True)\ntime.sleep(60)", wall_s=1.0)
    assert (r.ok, r.reason, r.exit_code, r.stdout) == (False, "timeout", None, "started\n")
    assert r.observation() == "started\n[timeout: stopped after 1 s of wall-clock time]"


def test_output_truncated_and_marked():
    r = run("import sys\nsys.stdout.write('a' * 3000)\nsys.stderr.write('b' * 3000)", output_bytes=4096)
    assert r.truncated and len(r.stdout) + len(r.stderr) == 4096
    assert r.reason in ("ok", "output_limit")  # whether it exited before the parent stopped it is a race
    assert "[output" in r.observation().splitlines()[-1]


def test_fresh_private_tmp_each_call():
    r = run("import os\nopen('note.txt', 'w').write('x')\n"
            "print(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], sorted(os.listdir('.')))")
    assert r.stdout == "/tmp /tmp /tmp ['main.py', 'note.txt']\n"
    assert run("import os\nprint(sorted(os.listdir('/tmp')))").stdout == "['main.py']\n"


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    r = run("import os\nprint(sorted(os.environ))")
    assert "HF_TOKEN" not in r.stdout and "PYTHONPATH" not in r.stdout
    assert "'HOME'" in r.stdout and "'PATH'" in r.stdout


def test_trainer_interpreter_packages_importable():
    r = run("import numpy as np\nprint(int(np.arange(10).sum()))", memory_mb=512)
    assert (r.reason, r.stdout) == ("ok", "45\n")


def test_verl_checkout_not_importable():
    r = run("import verl")
    assert r.reason == "error" and "ModuleNotFoundError" in r.stderr


def test_concurrent_threads():
    out: dict[int, SandboxResult] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, run(f"print({i} ** 2)"))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in out.items()} == {i: f"{i ** 2}\n" for i in range(8)}


def test_concurrent_asyncio():
    async def main():
        return await asyncio.gather(*(run_python_async(f"print({i} + 1)", limits()) for i in range(6)))
    results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i + 1}\n" for i in range(6)]


def test_program_is_niced():
    r = run("import os\nprint(os.getpriority(os.PRIO_PROCESS, 0), open('/proc/self/autogroup').read().split()[-1])",
            nice=7)
    assert r.stdout == f"{max(7, os.getpriority(os.PRIO_PROCESS, 0))} 7\n", r.observation()


def test_oversized_program_is_not_run():
    r = run("x = 1\n" + "#" * (5 << 20), disk_mb=4)
    assert (r.ok, r.reason, r.exit_code) == (False, "disk_limit", None)
    assert "does not fit in its /tmp (4 MiB); it was not run" in r.observation()


def test_limits_are_checked():
    with pytest.raises(VerlConfigError, match="wall_s"):
        run_python("pass", SandboxLimits(wall_s=0))
    with pytest.raises(VerlConfigError, match="memory_mb"):
        SandboxLimits(memory_mb=4).check()


def test_sandbox_available_describes_isolation():
    ok, how = sandbox_available(limits())
    assert ok, how
    assert "pid" in how and "net" in how and "read-only root" in how


# ---------------------------------------------------------------- hostile snippets

def test_infinite_loop_cpu_limit(host):
    r = run("while True:\n    pass", cpu_s=1.0, wall_s=120.0)  # a loaded machine: one CPU second, slowly
    assert (r.ok, r.reason, r.exit_code) == (False, "cpu_limit", -signal.SIGXCPU)
    assert r.observation() == "[cpu_limit: the program used more than 1 s of CPU time and was stopped]"


def test_sleeping_forever_wall_timeout(host):
    r = run("import time\nwhile True:\n    time.sleep(1)", wall_s=1.0)
    assert (r.reason, r.exit_code) == ("timeout", None)


def test_fork_bomb(host):
    r = run("import os\nwhile True:\n    os.fork()", max_procs=8)
    assert r.reason == "process_limit", r.observation()
    assert "BlockingIOError" in r.stderr and "more than 8 processes" in r.observation()


def test_thread_bomb(host):
    r = run("import threading, time\nwhile True:\n"
            "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()", max_procs=8)
    assert r.reason == "process_limit", r.observation()


def test_memory_bomb(host):
    r = run("blocks = []\nwhile True:\n    blocks.append(bytearray(10 ** 7))", memory_mb=160)
    assert r.reason == "memory_limit", r.observation()
    assert r.observation().endswith("MemoryError\n[memory_limit: the program ran out of its 160 MiB of memory "
                                    "(exit code 1)]")


def test_read_files_outside(host):
    """The host tree is detached: the checkout, /work, the trainer's /proc entries, /sys and ~/.cache's contents
    do not exist; of ~/.cache only the path down to the interpreter's venv (bound read-only) is there."""
    cache = Path.home() / ".cache"
    with tempfile.NamedTemporaryFile(dir=cache, prefix="verl-sandbox-test-secret-") as secret:
        targets = [host / "secret.txt", Path(secret.name), REPO / "pyproject.toml", Path("/work"),
                   Path(f"/proc/{os.getpid()}/environ"), Path("/sys/class/net")]
        code = ("import os\nfor p in %r:\n    print(p, os.path.exists(p))\n"
                "print(sorted(os.listdir('/')))\nprint(os.listdir(%r) if os.path.exists(%r) else [])"
                % ([str(t) for t in targets], str(cache), str(cache)))
        r = run(code)
    assert r.ok, r.observation()
    lines = r.stdout.splitlines()
    assert lines[:-2] == [f"{t} False" for t in targets]
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    allowed |= {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix)}
    assert set(eval(lines[-2])) <= allowed
    venv_parts = {Path(p).relative_to(cache).parts[0] for p in (sys.prefix, sys.base_prefix)
                  if Path(p).is_relative_to(cache)}
    assert set(eval(lines[-1])) == venv_parts


def test_read_root_only_file(host):
    r = run("print(open('/etc/shadow').read())")
    if sandbox._isolation_mode() == "root":
        assert r.reason == "error" and "PermissionError" in r.stderr
    else:  # user-namespace mode: the program is the caller's own uid, which cannot read /etc/shadow either
        assert r.reason == "error"


def test_open_socket(host):
    r = run("import socket\nprint(open('/proc/net/dev').read().count(':'))\n"
            "socket.create_connection(('1.1.1.1', 53), timeout=5)")
    assert r.stdout == "1\n", "only the loopback interface exists"
    assert r.reason == "error" and "Network is unreachable" in r.stderr


def test_loopback_is_down(host):
    r = run("import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
            "socket.create_connection(s.getsockname(), timeout=5)")
    assert r.reason == "error" and "Network is unreachable" in r.stderr


def test_network_true_shares_host_network():
    r = run("print(open('/proc/net/dev').read().count(':'))", network=True)
    host_ifaces = Path("/proc/net/dev").read_text().count(":")
    assert r.stdout == f"{host_ifaces}\n"


def test_print_one_gigabyte(host):
    r = run("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
            output_bytes=4096)
    assert (r.reason, r.exit_code, r.truncated) == ("output_limit", None, True)
    assert r.stdout == "x" * 4096
    assert r.observation().endswith("[output_limit: the program wrote more than 4096 bytes and was stopped]")


@pytest.mark.parametrize("snippet", ["os.kill(os.getppid(), signal.SIGKILL)", "os.kill(1, signal.SIGTERM)",
                                     "os.kill(-1, signal.SIGKILL)", "os.kill({trainer}, signal.SIGKILL)",
                                     "os.killpg({trainer_group}, signal.SIGKILL)"])
def test_kill_parent(host, snippet):
    """The sandbox's parent is its init (immune to signals from inside); the trainer's pids do not exist there."""
    snippet = snippet.format(trainer=os.getpid(), trainer_group=os.getpgrp())
    r = run(f"import os, signal\ntry:\n    {snippet}\nexcept OSError as e:\n    print(type(e).__name__)\n"
            "print('alive', os.getppid())")
    assert r.ok and r.stdout.endswith("alive 1\n"), r.observation()


def test_kill_own_process_group(host):
    r = run("import os, signal\nos.killpg(0, signal.SIGKILL)\nprint('unreachable')")
    assert (r.reason, r.exit_code, r.stdout) == ("killed", -signal.SIGKILL, "")
    assert r.observation() == "[killed: the program was killed by signal SIGKILL]"


def test_huge_file(host):
    r = run("open('big', 'wb').write(b'x' * (8 << 20))", file_mb=1)
    assert r.reason == "file_limit", r.observation()


def test_fill_tmp(host):
    r = run("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (512 << 10))", disk_mb=4)
    assert r.reason == "disk_limit", r.observation()


def test_write_outside(host):
    code = ("import os\nfor p in ['/usr/evil', '/etc/evil', '/evil', %r]:\n    try:\n        open(p, 'w')\n"
            "        print(p, 'written')\n    except OSError as e:\n        print(p, e.errno)" % str(host / "evil"))
    r = run(code)
    assert r.ok and "written" not in r.stdout, r.stdout
    assert not (host / "evil").exists() and not Path("/usr/evil").exists() and not Path("/evil").exists()


def test_daemon_does_not_outlive_the_call(host):
    marker = f"{os.getpid()}.{threading.get_ident() % 1000}"
    r = run("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('parent done')")
    assert (r.reason, r.stdout) == ("ok", "parent done\n")  # not "timeout": the call did not wait for the daemon
    assert not _running(marker), "the daemon survived"


TRAINER = r"""
import os, sys, threading, time
from verl.agents.sandbox import SandboxLimits, run_python
marker = sys.argv[1]
code = f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])"
threading.Thread(target=run_python, args=(code, SandboxLimits(wall_s=120)), daemon=True).start()
def running():
    for p in os.listdir('/proc'):
        try:
            if p.isdigit() and int(p) != os.getpid() and marker.encode() in open(f'/proc/{p}/cmdline', 'rb').read():
                return True
        except OSError:
            pass
for _ in range(600):
    if running():
        print('running', flush=True)
        os._exit(0)  # the trainer dies abruptly while its sandbox runs
    time.sleep(0.05)
"""


def test_trainer_death_kills_its_sandboxes(host):
    marker = f"{os.getpid()}.{threading.get_ident() % 1000}7"
    out = subprocess.run([sys.executable, "-c", TRAINER, marker], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.stdout == "running\n", out.stderr
    for _ in range(100):  # the kernel's SIGKILLs are asynchronous; the launcher's exit unwinds the namespace
        if not _running(marker):
            break
        time.sleep(0.05)
    assert not _running(marker), "a sandboxed program outlived the process that started it"


def test_no_privileges(host):
    r = run("import os, stat\nfor f in (lambda: os.setuid(0), lambda: os.chroot('/tmp'),\n"
            "          lambda: os.mknod('/tmp/d', 0o600 | stat.S_IFCHR, os.makedev(1, 3))):\n"
            "    try:\n        f()\n        print('allowed')\n    except OSError as e:\n        print(e.errno)\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    lines = r.stdout.split()
    assert "allowed" not in lines and lines[-1] == "0000000000000000", r.stdout


# ---------------------------------------------------------------- user-namespace mode and the refusal path

def test_user_namespace_mode(host, monkeypatch):
    """The unprivileged path (a user namespace), forced: as root it maps the program onto uid 0, which the
    kernel exempts from RLIMIT_NPROC, so the process limit is not asserted here."""
    monkeypatch.setattr(sandbox, "_isolation_mode", lambda: "userns")
    r = run("import os, socket\nprint(os.getuid(), os.path.exists(%r))\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            "socket.create_connection(('1.1.1.1', 53), timeout=5)" % str(host / "secret.txt"))
    assert r.stdout == "65534 False\n0000000000000000\n", r.observation()
    assert "Network is unreachable" in r.stderr


def test_refuses_when_namespaces_unavailable(monkeypatch):
    # An unshare() the kernel rejects (as a seccomp profile or a disabled user-namespace sysctl would).
    monkeypatch.setattr(sandbox, "_namespace_flags", lambda limits, mode: 0x1)
    monkeypatch.setattr(sandbox, "_available", {})
    with pytest.raises(VerlRuntimeError, match=r"cannot start here: unshare\(.*failed.*The code was not run"):
        run("print('must not run')")
    ok, why = sandbox_available(limits())
    assert not ok and "unshare" in why


def test_refuses_when_the_root_cannot_be_built(monkeypatch):
    monkeypatch.setattr(sandbox, "_layout", lambda: ([["/nonexistent-verl-dir", "/x"]], {}))
    with pytest.raises(VerlRuntimeError, match=r"mount\('/nonexistent-verl-dir'.*No such file"):
        run("print('must not run')")


def test_refuses_when_the_interpreter_cannot_start(monkeypatch):
    spec = sandbox._spec
    monkeypatch.setattr(sandbox, "_spec", lambda *a: {**spec(*a), "python": "/nonexistent/python3"})
    with pytest.raises(VerlRuntimeError, match="starting the program failed: FileNotFoundError"):
        run("print('must not run')")
