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
import hashlib
import os
import select
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from sandbox_attacks import ATTACKS
from unirl_agentic.sandbox import PythonSandbox, SandboxOptions, processes_with_token
from unirl_agentic.tooling import ToolFailure

SECRET = "unirl-canary-" + uuid.uuid4().hex
MAX_PROCS, MEMORY_MB, TIMEOUT = 8, 256, 2.0


# ------------------------------------------------------------------------------------------- host side
@pytest.fixture(scope="module", params=["auto", "rlimit"])
def host(request):
    """The host's canaries and listeners, and one box (guard off: an attacker removes it), once with the
    session cgroup (``auto``; v1 here) and once without (``rlimit``)."""
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
                                               scratch_mb=64, guard=False, pool_size=1, python="/usr/bin/python3",
                                               limits=request.param))
    assert box.isolation["mode"] == "bubblewrap" and box.isolation["seccomp"]
    assert (box.isolation["limits"] == "rlimit") == (request.param == "rlimit")
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
        "bwrap_sha": hashlib.sha256(Path(box._bwrap).read_bytes()).hexdigest(), "mode": request.param,
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
    assert h["bwrap_sha"] not in output, "the sandbox read the host's bwrap binary (/proc/1/exe)"
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
    expect = (attack.expect_rlimit or attack.expect) if h["mode"] == "rlimit" else attack.expect
    if expect == "killed":
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
                                  "print(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 'no-sys')\n"
                                  "try:\n    print(open('/proc/1/comm').read().strip(), os.readlink('/proc/1/exe'))\n"
                                  "except OSError as e:\n    print('pid1', e.errno)"}).content
    finally:
        box.session_end("look")
    import ast

    status = ast.literal_eval(out.splitlines()[0])
    assert status == ["CapEff:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"], status
    line = out.splitlines()[1]
    assert line.startswith("2 65534 ['dev', 'lib', 'lib64', 'proc', 'scratch', 'tmp', 'usr']"), line
    assert "['bin', 'lib']" in line or "['bin', 'lib', 'lib64']" in line, line  # /usr: the binary and libs only
    pid1 = out.splitlines()[3]  # issue 66: pid 1 was bubblewrap, and /proc/1/exe read the host's bwrap binary
    assert "bwrap" not in pid1 and pid1 == "pid1 13", pid1  # our init, not dumpable: EACCES


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


# ------------------------------------------------------------------------------- issue 66: the gaps it found
def _status_uid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])


def test_per_user_kernel_limits_are_each_sessions_own():
    """Every session ran as host ``nobody``: one that used up a per-user kernel limit (inotify instances,
    POSIX message queue bytes) made the same call fail in every other session. Each session now has a host
    uid of its own, so session B's call succeeds after A exhausted the limit."""
    box = PythonSandbox(options=SandboxOptions(pool_size=0, timeout_s=5.0))
    try:
        box.session_start("a")
        box.session_start("b")
        uids = [_status_uid(box._sessions[sid].ns_init) for sid in ("a", "b")]
        assert uids[0] != uids[1] and not {0, 65534} & set(uids), uids
        inotify = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); fds = []\n"
                   "while len(fds) < 100000:\n    fd = libc.inotify_init()\n    if fd < 0: break\n    fds.append(fd)\n"
                   "print(len(fds), ctypes.get_errno())")
        mqueue = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); qs = []\n"
                  "while len(qs) < 10000:\n    q = libc.mq_open(f'/q{len(qs)}'.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)\n"
                  "    if q < 0: break\n    qs.append(q)\nprint(len(qs), ctypes.get_errno())")
        limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        got = box.execute("a", {"code": inotify}).content.split()
        assert got == [str(limit), "24"], got  # A holds every instance its uid may have: EMFILE (needs the
        # per-user limit below the session's 256 fds, as on this kind of machine: 128)
        held = box.execute("a", {"code": mqueue}).content.split()
        assert held[1] == "24" and 0 < int(held[0]) < 10000, held  # RLIMIT_MSGQUEUE bytes used up: EMFILE
        assert box.execute("b", {"code": inotify.replace("100000", "1")}).content.split() == ["1", "0"]
        assert box.execute("b", {"code": mqueue.replace("10000", "1")}).content.split() == ["1", "0"]
    finally:
        box.close()


def _session_memory(s) -> int:
    """Host view of what a session holds: its processes' RSS plus its tmpfs (rlimit mode's host mount)."""
    from unirl_agentic.sandbox_freeze import descendants

    total = 0
    for pid in [s.ns_init, *descendants(s.ns_init)]:
        try:
            total += int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) << 10
        except (OSError, IndexError, ValueError):
            pass
    st = os.statvfs(s.mount)
    return total + (st.f_blocks - st.f_bfree) * st.f_frsize


_FILL = "while pinned < 2**30:\n    f.write(b'x' * 2**20); f.flush(); pinned += 2**20\n"
PINNING = {  # each tries to hold 1 GiB and prints what it held (bytes, or files for inodes)
    "root-tmpfs": "f = open('/fill', 'wb')\n" + _FILL,
    "dev-tmpfs": "f = open('/dev/fill', 'wb')\n" + _FILL,
    "scratch-tmpfs": "for d in ('/tmp', '/dev/shm', '/scratch'):\n    try:\n        f = open(d + '/fill', 'wb')\n"
                     "        while pinned < 2**30:\n            f.write(b'x' * 2**20); f.flush(); pinned += 2**20\n"
                     "    except OSError as e: last = e\nraise last\n",
    "inodes": "for i in range(10**6):\n    open(f'/tmp/{i}', 'w').close(); pinned = i + 1\n",
    "memfd": "while pinned < 2**30:\n    fd = os.memfd_create('m'); held.append(fd); os.ftruncate(fd, 2**24)\n"
             "    os.write(fd, b'x' * 2**24); pinned += 2**24\n",
    "socket-buffers": "import socket\nwhile pinned < 2**30:\n    a, b = socket.socketpair(); held += [a, b]; a.setblocking(False)\n"
                      "    try:\n        while True: pinned += a.send(b'x' * 65536)\n    except BlockingIOError: pass\n",
    "sysv-shm": "import ctypes; libc = ctypes.CDLL(None, use_errno=True); libc.shmat.restype = ctypes.c_void_p\n"
                "while pinned < 2**30:\n    i = libc.shmget(0, 2**26, 0o1600)\n    assert i >= 0, os.strerror(ctypes.get_errno())\n"
                "    p = libc.shmat(i, None, 0); ctypes.memset(p, 1, 2**26); libc.shmdt(ctypes.c_void_p(p)); pinned += 2**26\n",
    "forked": "for _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(200 * 2**20); time.sleep(3); os._exit(0)\n"
              "    pinned += 200 * 2**20\n",
    "threads": "import threading\nstops = []\ndef grab():\n    global pinned\n    try:\n        while True:\n"
               "            b = bytearray(2**24); held.append(b); pinned += 2**24\n    except MemoryError as e: stops.append(e)\n"
               "ts = [threading.Thread(target=grab) for _ in range(8)]\n[t.start() for t in ts]; [t.join() for t in ts]\n"
               "raise stops[0]\n",
    "pipes": "import fcntl\nwhile pinned < 2**30:\n    r, w = os.pipe(); held += [r, w]; os.set_blocking(w, False)\n"
             "    try: fcntl.fcntl(w, 1031, 2**20)\n    except OSError: pass\n"
             "    try:\n        while True: pinned += os.write(w, b'x' * 65536)\n    except BlockingIOError: pass\n",
}


@pytest.mark.parametrize("attack", sorted(PINNING))
def test_rlimit_mode_bounds_what_a_session_can_pin(attack):
    """Without a cgroup, memory was bounded only by the host's RAM: files on the writable ``/`` and
    ``/dev``, memfds, socket buffers, inodes and forked processes each held 0.8-2.3 GiB with
    ``memory_mb=256``. Now each stops near ``memory_mb`` (host view: RSS of every process of the session
    plus its tmpfs), and the attack's own count agrees."""
    import threading

    mem_mb, scratch_mb = 128, 16
    box = PythonSandbox(options=SandboxOptions(limits="rlimit", pool_size=0, timeout_s=8.0, memory_mb=mem_mb,
                                               scratch_mb=scratch_mb, file_mb=64, guard=False))
    assert box.isolation["single_process"] and box.isolation["inode_cap"]
    try:
        box.session_start("p")
        s = box._sessions["p"]
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _session_memory(s))
                time.sleep(0.01)

        w = threading.Thread(target=watch)
        w.start()
        code = ("import os, time\npinned, held = 0, []\ntry:\n" + "".join("    " + line + "\n" for line in
                PINNING[attack].splitlines()) + "except (OSError, MemoryError, AssertionError, RuntimeError) as e:\n"
                "    print('stopped:', type(e).__name__, e)\ntime.sleep(0.3)\nprint('PINNED', pinned)")
        out = box.execute("p", {"code": code}).content
        done.set()
        w.join()
        pinned = int(out.rsplit("PINNED", 1)[1])
        bound = (mem_mb + scratch_mb) << 20
        assert "stopped:" in out, out
        if attack == "inodes":
            from unirl_agentic.sandbox_mounts import inode_cap

            assert pinned <= inode_cap(scratch_mb), out
        else:
            assert pinned <= bound, out
        assert peak[0] <= bound + (32 << 20), f"{peak[0] >> 20} MiB held on the host: {out[-300:]}"
        if attack in ("memfd", "socket-buffers", "sysv-shm", "forked", "root-tmpfs", "dev-tmpfs"):
            assert pinned == 0, out  # refused outright
    finally:
        box.close()


def _tree_cpu(init: int) -> float:
    """CPU seconds of a session's processes, live and reaped (their time moves to the reaper's cutime)."""
    from unirl_agentic.sandbox_freeze import descendants

    ticks = 0
    for pid in [init, *descendants(init)]:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in f[11:15])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("limits", ["auto", "rlimit"])
def test_processes_a_call_leaves_burn_no_cpu_between_calls(limits):
    """A call could leave processes that keep forking successors and burning CPU after it returned (9.9
    CPU-seconds in 8 s with ``cpu_s=2``). Between calls they are stopped: the session's processes use no
    CPU until the next call, during which they run again (the oracle sees that, so it can see burning)."""
    burner = ("import os, threading\ndef burn():\n    while True: pass\n"
              "threading.Thread(target=burn, daemon=True).start()\n")
    if limits == "auto":  # a chain of forks: each child forks a successor and exits, each burns
        burner += ("if os.fork() == 0:\n    while True:\n        if os.fork(): os._exit(0)\n"
                   "        for _ in range(10**6): pass\n")
    box = PythonSandbox(options=SandboxOptions(limits=limits, pool_size=0, cpu_s=60, timeout_s=5.0, guard=False))
    try:
        box.session_start("c")
        init = box._sessions["c"].ns_init
        assert box.execute("c", {"code": burner + "print('left')"}).content == "left\n"
        before = _tree_cpu(init)
        time.sleep(2.0)
        idle = _tree_cpu(init) - before
        assert idle < 0.1, f"{idle:.2f} CPU-s burned between calls"
        before = _tree_cpu(init)
        assert box.execute("c", {"code": "import time; time.sleep(2.0); print('next')"}).content == "next\n"
        assert _tree_cpu(init) - before > 0.05, "the leftovers did not run during the next call"
    finally:
        box.close()


_TRAINER = """
from unirl_agentic.sandbox import PythonSandbox, SandboxOptions
box = PythonSandbox(options=SandboxOptions(pool_size=4, timeout_s=5.0))
print('ready', flush=True)
i = 0
while True:  # sessions open and close as fast as they can: the warm pool is always refilling
    box.session_start(f's{i}'); box.execute(f's{i}', {'code': 'x = 1'}); box.session_end(f's{i}'); i += 1
"""

_REAPER = r"""
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the trainer come here

def descendants():
    out, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                kids = [int(k) for k in open(f"/proc/{pid}/task/{tid}/children").read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    live = []
    for p in out:
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                live.append(p)
        except OSError:
            pass  # gone meanwhile
    return live

trainers, left = [], []
for trial in range(int(sys.argv[2])):
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
    p.stdout.readline()
    time.sleep(0.4 + 0.3 * trial)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    trainers.append(p.pid)
    deadline = time.monotonic() + 15  # a sandbox in mid-setup finishes it, then its pid 1 sees the trainer gone
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        alive = descendants()
        if not alive:
            break
        time.sleep(0.05)
    for pid in alive:
        try:
            st = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        left.append(" ".join([open(f"/proc/{pid}/comm").read().strip(), st.split("State:")[1].split()[0],
                              open(f"/proc/{pid}/wchan").read(), "nspid", st.split("NSpid:")[1].split("\n")[0].strip()]))
        os.kill(pid, signal.SIGKILL)
print(json.dumps({"trainers": trainers, "left": left}))
"""


def test_no_sandbox_outlives_a_sigkilled_trainer_and_stale_cgroups_go_at_the_next_start():
    """A trainer killed with SIGKILL while its warm pool refilled left a ``bwrap`` stuck for good (bwrap's
    ``--die-with-parent`` is armed only after its setup) and every session's cgroup behind. Now the
    session's own pid 1 ends when the trainer's end of the request pipe closes, the parent-death signal is
    armed before bwrap runs, and the next trainer removes the dead one's cgroups."""
    import json

    from unirl_agentic.sandbox_cgroups import CgroupFactory

    r = subprocess.run([sys.executable, "-c", _REAPER, _TRAINER, "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["left"] == [], f"processes outlived their SIGKILLed trainer: {got['left']}"
    bases = [base for _, base in CgroupFactory()._bases]  # (not _cgroup_factory: it would clean up itself)
    assert bases
    # one more, made here with a live process in it and named for a dead trainer: the killed ones' own may
    # already be gone (any trainer that starts on this host, e.g. another test process, cleans up)
    dead = f"unirl-sandbox-{got['trainers'][-1]}.1-synthetic"
    for b in bases:
        os.mkdir(os.path.join(b, dead))
    sleeper = subprocess.Popen(["sleep", "600"])
    for b in bases:
        Path(b, dead, "cgroup.procs").write_text(str(sleeper.pid))

    def stale() -> list[str]:
        return [e.path for b in bases for e in os.scandir(b)
                if any(e.name.startswith(f"unirl-sandbox-{pid}.") for pid in got["trainers"])]

    assert stale()
    r = subprocess.run([sys.executable, "-c", "from unirl_agentic.sandbox import PythonSandbox, SandboxOptions\n"
                        "PythonSandbox(options=SandboxOptions(pool_size=0))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sleeper.wait(timeout=10) == -9, "the process in a dead trainer's cgroup was not killed"
    assert stale() == [], "the next start did not remove the dead trainers' cgroups"
