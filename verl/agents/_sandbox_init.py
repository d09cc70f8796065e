"""The sandbox's launcher: run as ``python -I -S _sandbox_init.py <spec>`` by `verl.agents.sandbox`.

Standard library only, and only modules that import in microseconds (no json, re, enum or signal: the launcher's
start-up is part of every call's latency). The spec is a marshal-ed dict, hex-encoded. Three processes:

- the launcher (host pid namespace; killed by the kernel when its caller dies) reads the program from stdin,
  enters fresh namespaces (mount, pid, ipc, uts, network unless allowed, and a user namespace when not root),
  forks the init and waits for it;
- the init (pid 1 of the new pid namespace; killed by the kernel when the launcher dies, via PDEATHSIG) builds a
  new root on a tmpfs — read-only binds of the system and interpreter directories, a writable /tmp tmpfs, a
  private /proc, a few device nodes — pivots into it, forks the program and reaps orphans. When the program
  exits the init reports its wait status and exits, and the kernel kills everything left in the namespace;
- the program: its own session, resource limits, an unprivileged uid, no_new_privs, then ``python main.py``.

Setup failures and the program's end are reported on the status fd, one tab-separated line each:
``error\t<message>`` and ``end\t<wait status>\t<cpu seconds>\t<max rss KiB>``.
"""

import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SIGKILL = 9
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
SYS_MOUNT_SETATTR = 442  # one number on every architecture (added after the syscall tables were unified)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
FLAG_NAMES = {CLONE_NEWUSER: "NEWUSER", CLONE_NEWNS: "NEWNS", CLONE_NEWPID: "NEWPID", CLONE_NEWNET: "NEWNET",
              CLONE_NEWIPC: "NEWIPC", CLONE_NEWUTS: "NEWUTS"}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """A step of the isolation failed; the message names the step and the errno."""


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what} failed: [Errno {err}] {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount({source!r} on {target!r})")


def report(fd: int, kind: str, *fields) -> None:
    os.write(fd, ("\t".join([kind, *(str(f).replace("\n", " ").replace("\t", " ") for f in fields)]) + "\n").encode())


def flag_names(flags: int) -> str:
    return "|".join(f"CLONE_{name}" for bit, name in FLAG_NAMES.items() if flags & bit)


def enter_namespaces(spec: dict) -> None:
    """unshare() the namespaces; in user-namespace mode map the sandbox uid/gid onto our own."""
    uid, gid = os.getuid(), os.getgid()
    flags = spec["ns_flags"]
    check(libc.unshare(ctypes.c_int(flags)), f"unshare({flag_names(flags)})")
    if flags & CLONE_NEWUSER:
        # One id mapped: the sandbox's inner uid/gid is the caller's own, so it gains nothing on the host.
        for name, text in (("setgroups", "deny"), ("uid_map", f"{spec['uid']} {uid} 1"),
                           ("gid_map", f"{spec['gid']} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError as e:
                raise SetupError(f"writing /proc/self/{name} ({text!r}) failed: {e}") from e


def bind_readonly(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    mount(src, dst, None, MS_BIND | MS_REC)
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), dst.encode(),
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
          f"mount_setattr(read-only, {dst!r}) (needs Linux >= 5.12)")


def build_root(spec: dict, code: bytes) -> None:
    """The new root at spec['root'] (a tmpfs), then pivot_root into it and detach the host's tree."""
    root, uid, gid = spec["root"], spec["uid"], spec["gid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below propagates back to the host
    mount("verl-sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    tmp = root + "/tmp"
    os.mkdir(tmp)
    mount("verl-sandbox-tmp", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=700")
    os.chown(tmp, uid, gid)
    with open(tmp + "/main.py", "wb") as f:
        f.write(code)
    os.chown(tmp + "/main.py", uid, gid)
    for source, path in spec["binds"]:
        bind_readonly(source, root + path)
    for path, target in spec["symlinks"].items():
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "wb").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    pivot = SYS_PIVOT_ROOT.get(os.uname().machine)
    if pivot is None:
        raise SetupError(f"pivot_root: no syscall number known for architecture {os.uname().machine!r}")
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(pivot), b".", b"."), "pivot_root")
    check(libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount2(old root)")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    libc.sethostname(b"sandbox", ctypes.c_size_t(7))


def exec_program(spec: dict) -> None:
    """In the forked program process: limits, privileges dropped, then exec. Never returns."""
    os.setsid()  # its own session: killpg(0) / kill(-pgid) reach only the program's processes
    # A new session is a new scheduler autogroup, which would get as much CPU as the trainer's whole process:
    # lower the group's weight along with the process's own niceness.
    os.setpriority(os.PRIO_PROCESS, 0, max(spec["nice"], os.getpriority(os.PRIO_PROCESS, 0)))
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(spec["nice"]))
    except OSError:
        pass  # a kernel without CONFIG_SCHED_AUTOGROUP: the process niceness alone applies
    mb = 1024 * 1024
    cpu = max(1, int(spec["cpu_s"] + 0.999))
    # In user-namespace mode the launcher and the init share the program's uid, so they count against NPROC.
    procs = spec["max_procs"] + (2 if spec["ns_flags"] & CLONE_NEWUSER else 0)
    for rlim, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                             (resource.RLIMIT_AS, spec["memory_mb"] * mb, spec["memory_mb"] * mb),
                             (resource.RLIMIT_FSIZE, spec["file_mb"] * mb, spec["file_mb"] * mb),
                             (resource.RLIMIT_NPROC, procs, procs), (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(rlim, (soft, hard))
    if not spec["ns_flags"] & CLONE_NEWUSER:  # root mode: become the per-call unprivileged uid
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.chdir("/tmp")
    os.execve(spec["python"], [spec["python"], "-E", "-s", "-u", "-B", "main.py"], spec["env"])


def init_main(spec: dict, code: bytes, status_fd: int) -> None:
    """Pid 1 of the sandbox: build the root, run the program, report its end. Exiting kills the namespace."""
    # Had the launcher died before this, the parent's killpg of the launcher's group reaches us too.
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    build_root(spec, code)
    pid = os.fork()
    if pid == 0:
        try:
            exec_program(spec)
        except BaseException as e:  # noqa: BLE001 - whatever stopped the exec is reported, then the child ends
            report(status_fd, "error", f"starting the program failed: {type(e).__name__}: {e}")
        os._exit(127)
    while True:
        try:
            child, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if child == pid:  # orphans re-parented to us are just reaped
            report(status_fd, "end", status, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
            os._exit(0)


def main() -> None:
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    # The caller's thread waits for us for as long as we run, so its end means the trainer died: follow it.
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    if os.getppid() != spec["caller_pid"]:
        os._exit(1)
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)  # the program must not hold the status pipe
    try:
        code = sys.stdin.buffer.read()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if spec["ns_flags"] & CLONE_NEWUSER == 0:
            spec["uid"] = spec["gid"] = spec["uid_base"] + os.getpid()  # one host uid per live sandbox
        enter_namespaces(spec)
        pid = os.fork()
        if pid == 0:
            try:
                init_main(spec, code, status_fd)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which refuses to run the code
                report(status_fd, "error", str(e) if isinstance(e, SetupError) else f"{type(e).__name__}: {e}")
            os._exit(2)
    except SetupError as e:
        report(status_fd, "error", str(e))
        os._exit(2)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
