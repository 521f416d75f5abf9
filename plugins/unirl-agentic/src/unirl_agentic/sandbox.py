"""``python_sandbox``: a persistent Python interpreter per trajectory, isolated by the OS.

The code a policy writes is hostile input (sampled from a model optimised for reward), so isolation comes
from the kernel, built by **bubblewrap** for every session, never from Python hooks the code can undo
(threat model and guarantees per mode: docs/agentic.md, "The sandbox"):

* **namespaces**: new user, pid, net (loopback only), mount, ipc and uts; no nested user namespaces. On
  the host each session runs as **its own uid** (:mod:`.sandbox_ids`; trainer root), so per-user kernel
  quotas are its own; inside, uid 65534 with no capabilities. Pid 1 is our init
  (:mod:`._sandbox_init`), which ends the namespace when the trainer goes, however it goes;
* **filesystem**: a read-only bind of only the interpreter, its stdlib and their shared libraries;
  ``/`` and ``/dev`` read-only; private, size-capped tmpfs for ``/scratch`` (cwd, ``HOME``), ``/tmp``
  and ``/dev/shm``; a fresh ``/proc``;
* **seccomp** (:mod:`._seccomp`): no socket family but ``AF_UNIX``, no ``ptrace``, ``mount``,
  ``unshare``, ``bpf``, ``keyctl``, ``io_uring`` and more;
* **whole-session limits**: a cgroup per session (:mod:`.sandbox_cgroups`) with ``memory_mb`` and
  ``max_procs``; without one (``limits: rlimit``) the session is one process (a second filter refuses
  ``fork``, memfds, sockets, SysV shm, inotify) under ``RLIMIT_AS``, with one host tmpfs capped in size
  and inodes (:mod:`.sandbox_mounts`);
* **time**: each call has a deadline enforced from outside (SIGKILL of the pid namespace); between
  calls every process the call left is stopped (:mod:`.sandbox_freeze`);
* **a reply channel the parent owns**: framed replies (magic, sequence number, length) read with a hard
  byte cap; a second frame, a wrong sequence number or stray bytes end the session.

Fail closed: where bwrap cannot run, the tool refuses to start (preflight says so, with the fix); only
``allow_unisolated: true`` runs the old, weaker mode, with a warning. A warm pool (``pool_size``) keeps
sandboxes started ahead, so a session's first call does not wait for start-up.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import resource
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from unirl.api import ConfigError, ToolResult
from unirl_agentic import _seccomp, sandbox_freeze, sandbox_host, sandbox_mounts
from unirl_agentic.options import tool_options
from unirl_agentic.sandbox_cgroups import CgroupFactory, _Cgroup, _cgroup_factory, _own_cgroup, owner_tag  # noqa: F401
from unirl_agentic.sandbox_freeze import kill_until_gone
from unirl_agentic.sandbox_host import (  # noqa: F401 - re-exported: the tool's public names live here
    FIELD,
    SandboxOptions,
    _account,
    _as_user,
    _bwrap_path,
    _ids,
    _ppid,
    _readable_by,
    _runtime,
    _spawn,
    account_problem,
    pick_python,
    pick_unisolated_python,
    processes_with_token,
    python_problem,
    user_task_count,
)
from unirl_agentic.sandbox_ids import DEFAULT_RANGE, SessionIds, mapped, subid_range
from unirl_agentic.tooling import StatefulTool, ToolFailure, clean_text

log = logging.getLogger(__name__)

_WORKER_SRC = Path(__file__).with_name("_sandbox_worker.py").read_text()
_INIT_SRC = Path(__file__).with_name("_sandbox_init.py").read_text()
_prctl = __import__("ctypes").CDLL(None, use_errno=True).prctl  # resolved before any fork
MAGIC = b"UNIRLv2\n"
_HEAD = struct.Struct(">IIB")
SCRATCH = "/scratch"
SANDBOX_UID = 65534


# ---------------------------------------------------------------------------------------- sessions
@dataclass
class _Session:
    proc: subprocess.Popen
    request_fd: int
    reply_fd: int
    token: str
    cgroup: _Cgroup | None = None
    scratch: str | None = None  # unisolated mode only: a host dir
    ns_init: int | None = None
    uid: int | None = None  # the session's own host uid (trainer root)
    uid_fd: int | None = None  # the flock that holds it
    mount: str | None = None  # rlimit mode, root: the session's host tmpfs
    seq: int = 0
    started: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False
    calling: threading.Event = field(default_factory=threading.Event)  # a call waits for the lock


_ALL: weakref.WeakSet[PythonSandbox] = weakref.WeakSet()


@atexit.register
def _reclaim_all() -> None:  # a trainer that exits never leaves a sandbox behind
    for tool in list(_ALL):
        tool.close()


class PythonSandbox(StatefulTool):
    """The ``python_sandbox`` tool: ``{"code": "..."}`` runs in the trajectory's interpreter."""

    name: ClassVar[str] = "python_sandbox"
    description: ClassVar[str] = "Run Python code in a persistent sandboxed interpreter; prints are returned."
    Config = SandboxOptions

    def __init__(self, *, config: Any = None, options: SandboxOptions | dict | None = None,
                 _probing: bool = False):
        if options is None and config is not None:
            options = tool_options(config, self.name)
        self.options = options if isinstance(options, SandboxOptions) else SandboxOptions.model_validate(options or {})
        o = self.options
        for problem in (account_problem(o), python_problem(o), None if _probing else isolation_problem(o)):
            if problem is not None:  # preflight reports these first; a tool built without preflight too
                field_, message, fix = problem
                raise ConfigError(f"{field_}: {message} (fix: {fix})")
        self.uid, self.gid = _ids(o)
        self._bwrap = _bwrap_path(o)
        self.isolated = _probing or sandbox_problem(o) is None
        self.cgroups: CgroupFactory | None = None
        self.ids: SessionIds | None = None  # a host uid per session (trainer root, bubblewrap)
        self.own_mounts = False  # rlimit mode, root: one capped host tmpfs per session
        if self.isolated:
            start, count = subid_range(_account(o) or "", self.uid) or DEFAULT_RANGE
            if os.geteuid() == 0 and mapped(start, count):
                self.ids = SessionIds(start, count)
                self.uid = self.gid = start  # what the readability checks below run as
            elif os.geteuid() == 0:
                log.warning("python_sandbox: uids %d..%d are not mapped in this user namespace: every session "
                            "runs as uid %d, sharing its per-user kernel quotas", start, start + count - 1, self.uid)
            self.python = pick_python(o, self.uid, self.gid)
            self.runtime = _runtime(self.python)
            self.cgroups = _cgroup_factory() if o.limits != "rlimit" else None
            if o.limits == "cgroup" and self.cgroups is None:
                raise ConfigError(f"{FIELD}.limits: 'cgroup' but no writable cgroup (v2 with memory+pids, or "
                                  "v1 memory and pids) exists here (fix: limits: auto or rlimit)")
            self._seccomp = _seccomp.program()
            self._pinning = _seccomp.pinning().hex() if self.cgroups is None else None
            if self.cgroups is None and self.ids is not None:
                sandbox_mounts.remove_stale()
                self.own_mounts = True
        else:
            log.warning("python_sandbox: bubblewrap is not available and allow_unisolated is true: model-written "
                        "code runs WITHOUT OS isolation (rlimits and an audit hook only; not a security boundary)")
            self.python = pick_unisolated_python(o, self.uid, self.gid)
        self.isolation = {
            "mode": "bubblewrap" if self.isolated else "unisolated",
            "limits": (self.cgroups.kind if self.cgroups else "rlimit") if self.isolated else "rlimit (per process)",
            "seccomp": self.isolated,
            "python": self.python,
            "uids": (f"one per session from {self.ids.start}..{self.ids.start + self.ids.count - 1}" if self.ids
                     else f"shared: uid {self.uid}"),
        }
        if self.isolated and self.cgroups is None:
            self.isolation["single_process"] = True  # _seccomp.pinning: fork, memfd, sockets refused
            self.isolation["inode_cap"] = self.own_mounts
        self._sessions: dict[str, _Session] = {}
        self._pool: list[_Session] = []
        self._lock = threading.Lock()
        self._closed = False
        self._filler: threading.Thread | None = None
        self._fill = threading.Event()
        self._stop_q: queue.Queue[_Session | None] = queue.Queue()
        if self.isolated:
            threading.Thread(target=self._stopper, name="unirl-sandbox-stopper", daemon=True).start()
        _ALL.add(self)
        if o.pool_size and self.isolated:
            self._filler = threading.Thread(target=self._fill_pool, name="unirl-sandbox-pool", daemon=True)
            self._filler.start()
            self._fill.set()

    # ------------------------------------------------------------------ interpreters
    # ------------------------------------------------------------------ starting
    def _bwrap_argv(self, token: str, mount: str | None) -> list[str]:
        o, rt = self.options, self.runtime
        size = str(o.scratch_mb << 20)
        # no --die-with-parent (nor a parent-death signal of ours): bwrap's child blocks on an eventfd until
        # bwrap has set it up, so a bwrap killed in that window left it stuck for good. bwrap finishes its
        # setup on its own; the session's pid 1 then ends everything when the trainer is gone (POLLHUP).
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
                "--as-pid-1", "--new-session", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--hostname", "sandbox"]
        for d in rt["dirs"]:
            argv += ["--ro-bind", d, d]
        for h in rt["hide"]:
            argv += ["--tmpfs", h, "--remount-ro", h]
        for f in rt["files"]:
            argv += ["--ro-bind", f, f]
        argv += ["--ro-bind", rt["exe"], rt["exe"], "--proc", "/proc", "--dev", "/dev"]
        if mount:  # one host tmpfs with size and inode caps, its three dirs bound into place
            argv += ["--bind", f"{mount}/tmp", "/tmp", "--bind", f"{mount}/shm", "/dev/shm",
                     "--bind", f"{mount}/scratch", SCRATCH]
        else:
            argv += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm",
                     "--size", size, "--tmpfs", SCRATCH]
        argv += ["--remount-ro", "/", "--remount-ro", "/dev",  # bwrap's own tmpfs mounts hold no files
                 "--chdir", SCRATCH, "--clearenv", "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", "/tmp",
                 "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONUTF8", "1",
                 "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "UNIRL_SANDBOX_TOKEN", token]
        return argv

    def _start(self) -> _Session:
        o = self.options
        config: dict[str, Any] = {"cap": o.max_output_chars, "guard": o.guard}
        limits_rl = [(resource.RLIMIT_AS, o.memory_mb << 20), (resource.RLIMIT_CPU, o.cpu_s),
                     (resource.RLIMIT_FSIZE, o.file_mb << 20), (resource.RLIMIT_NOFILE, 256),
                     (resource.RLIMIT_CORE, 0)]
        s = _Session(None, -1, -1, uuid.uuid4().hex)  # type: ignore[arg-type] - proc comes below
        closers: list[int] = []
        try:
            if self.isolated:
                cmd, env, cwd = self._isolated_command(s, config, closers)
            else:
                cmd, env, cwd = self._unisolated_command(s, config, limits_rl)
            procs = [f.encode() for f in (s.cgroup.procs_files if s.cgroup else [])]
            drop, parent = _as_user(s.uid or self.uid, s.uid or self.gid), os.getpid()
            pdeath = not self.isolated  # the unisolated worker dies with the trainer (see _bwrap_argv for bwrap)

            def child() -> None:  # between fork and exec: join the cgroup (as root), set limits, drop
                for f in procs:
                    fd = os.open(f, os.O_WRONLY)
                    os.write(fd, b"0")
                    os.close(fd)
                for kind, value in limits_rl:
                    resource.setrlimit(kind, (value, value + 1 if kind == resource.RLIMIT_CPU else value))
                drop()  # (a uid change clears the parent-death signal: armed after it)
                if pdeath:
                    _prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG, and the trainer may be gone already
                    if os.getppid() != parent:
                        os._exit(1)

            def spawn() -> subprocess.Popen:
                return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        cwd=cwd, env=env, start_new_session=True, preexec_fn=child,
                                        close_fds=True, pass_fds=closers)

            s.proc = _spawn(spawn)
        except BaseException:
            self._undo_host(s)
            raise
        finally:
            for fd in closers:
                os.close(fd)
        s.request_fd, s.reply_fd, s.started = s.proc.stdin.fileno(), s.proc.stdout.fileno(), time.monotonic()
        os.set_blocking(s.request_fd, False)
        return s

    def _isolated_command(self, s: _Session, config: dict[str, Any], fds: list[int]) -> tuple[list[str], dict, str]:
        """Take the session's host uid, cgroup and tmpfs; the bwrap command line (fds: what it inherits)."""
        o = self.options
        name = f"unirl-sandbox-{owner_tag()}-{s.token[:12]}"
        if self.ids is not None:
            s.uid, s.uid_fd = self.ids.acquire()
        if self.cgroups is not None:
            s.cgroup = self.cgroups.create(name, o.memory_mb << 20, o.max_procs + 4)
        if self.own_mounts:
            s.mount = sandbox_mounts.mount_scratch(name, o.scratch_mb, s.uid, s.uid)
        config["nproc"] = o.max_procs + 4  # inside the user namespace: this session's tasks only
        if self._pinning:
            config["pin"] = self._pinning
        sec_r, sec_w = os.pipe()
        os.write(sec_w, self._seccomp)
        os.close(sec_w)
        fds.append(sec_r)
        cmd = [*self._bwrap_argv(s.token, s.mount), "--seccomp", str(sec_r), "--",
               self.runtime["exe"], "-I", "-S", "-c", _INIT_SRC, json.dumps(config), _WORKER_SRC]
        return cmd, {"PATH": "/usr/bin:/bin"}, "/"

    def _unisolated_command(self, s: _Session, config: dict[str, Any], limits_rl: list) -> tuple[list[str], dict, str]:
        o = self.options
        s.scratch = scratch = tempfile.mkdtemp(prefix="unirl-sandbox-")
        if os.geteuid() == 0:
            os.chown(scratch, self.uid, self.gid)
        limits_rl.append((resource.RLIMIT_NPROC, user_task_count(self.uid) + o.max_procs + 1))
        config["strict"] = True  # the old audit-hook layer (writes, ctypes, signals): all this mode has
        cmd = [self.python, "-I", "-S", "-c", _WORKER_SRC, json.dumps(config)]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "UNIRL_SANDBOX_TOKEN": s.token}
        return cmd, env, scratch

    def _undo_host(self, s: _Session) -> None:
        """Give back what the session held on the host (after its processes are gone)."""
        cgroup, s.cgroup = s.cgroup, None
        if cgroup is not None:
            cgroup.kill()
            cgroup.remove()
        mount, s.mount = s.mount, None
        sandbox_mounts.unmount(mount)
        if s.scratch:
            shutil.rmtree(s.scratch, ignore_errors=True)
            s.scratch = None
        uid_fd, s.uid_fd = s.uid_fd, None
        SessionIds.release(uid_fd)

    def _ready(self, s: _Session, timeout: float) -> None:
        """Wait for the worker's hello frame; then note the pid namespace's init: bwrap's only child."""
        self._read_frame(s, 0, time.monotonic() + timeout)
        if self.isolated:
            kids = sandbox_freeze.descendants(s.proc.pid)
            if kids and _ppid(kids[0]) == s.proc.pid:
                s.ns_init = kids[0]

    def _start_ready(self) -> _Session:
        s = self._start()
        try:
            self._ready(s, max(10.0, self.options.timeout_s))
        except ToolFailure as exc:
            err = self._stderr(s)
            self._kill(s)
            self._release(s)
            raise ToolFailure(f"python_sandbox: the sandbox did not start ({exc}){': ' + err if err else ''}") \
                from None
        return s

    def _stopper(self) -> None:
        """Between calls, stop every process a call left (see :mod:`unirl_agentic.sandbox_freeze`)."""
        while True:
            s = self._stop_q.get()
            if s is None:
                return
            with s.lock:
                if s.dead or not s.ns_init or sandbox_freeze.stop_all(s.ns_init, cancel=s.calling.is_set):
                    continue
                log.warning("python_sandbox: the processes a call left could not be stopped: session killed")
                self._kill(s)  # the next call reports the killed session

    def _fill_pool(self) -> None:
        while True:
            self._fill.wait()
            self._fill.clear()
            while not self._closed:
                with self._lock:
                    short = self.options.pool_size - len(self._pool)
                if short <= 0:
                    break
                try:
                    s = self._start_ready()
                except Exception as exc:  # noqa: BLE001 - session_start then starts one itself (and reports)
                    log.warning("python_sandbox: warm pool refill failed: %s", exc)
                    break
                with self._lock:
                    if self._closed:
                        self._kill(s)
                        self._release(s)
                        return
                    self._pool.append(s)
            if self._closed:
                return

    # ------------------------------------------------------------------ the protocol
    def session_start(self, session_id: str) -> None:
        with self._lock:
            if self._closed:
                raise ToolFailure("python_sandbox: the tool is closed")
            if session_id in self._sessions:
                raise ValueError(f"python_sandbox: session {session_id!r} is already open")
            s = self._pool.pop(0) if self._pool else None
        if s is not None:
            self._fill.set()
            if s.proc.poll() is not None:
                self._kill(s)
                self._release(s)
                s = None
        if s is None:
            s = self._start_ready()
        with self._lock:
            clash = session_id in self._sessions or self._closed
            if not clash:
                self._sessions[session_id] = s
        if clash:  # opened twice concurrently, or closed meanwhile: this sandbox is not handed out
            self._kill(s)
            self._release(s)
            raise ValueError(f"python_sandbox: session {session_id!r} is already open, or the tool closed")

    def execute(self, session_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('python_sandbox: arguments must be {"code": "<python source>"}', error=True)
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise ToolFailure(f"python_sandbox: no open session {session_id!r}")
        o = self.options
        s.calling.set()  # a stopper still waiting for the last call's leftovers gives way
        with s.lock:
            s.calling.clear()  # (a second waiting call just waits for the stopper: never less stopping)
            if s.dead:
                raise ToolFailure("python_sandbox: the session was killed earlier in this trajectory")
            deadline = time.monotonic() + o.timeout_s
            stray = self._stray(s)
            if stray is not None:
                self._kill(s)
                raise ToolFailure("python_sandbox: the session died between calls" if stray == b"" else
                                  "python_sandbox: the session wrote outside its reply (protocol violation)")
            s.seq += 1
            body = json.dumps({"seq": s.seq, "code": code}).encode()
            try:
                if s.ns_init:  # what the last call left runs again, during this call only
                    sandbox_freeze.continue_all(s.ns_init)
                self._write(s, struct.pack(">I", len(body)) + body, deadline)
                error, data = self._read_frame(s, s.seq, deadline)
            except ToolFailure:
                self._kill(s)
                raise
            except (OSError, ValueError) as exc:  # a pipe error: the session is unusable
                self._kill(s)
                raise ToolFailure(f"python_sandbox: the session's pipes failed ({exc})") from None
            if s.ns_init:  # stopped now; made sure (and the call's newborns caught) by the stopper thread
                sandbox_freeze.signal_all(s.ns_init)
                self._stop_q.put(s)
        text = data.decode("utf-8", "replace")
        if len(text) > o.max_output_chars:
            text = text[:o.max_output_chars] + f"\n...[truncated at {o.max_output_chars} characters]"
        return ToolResult(clean_text(text), error=error)

    def _write(self, s: _Session, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolFailure(f"python_sandbox: the call was killed after {self.options.timeout_s:g}s wall clock")
            _, w, _ = select.select([], [s.request_fd], [], left)
            if not w:
                continue
            try:
                view = view[os.write(s.request_fd, view):]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise ToolFailure(f"python_sandbox: the session died ({exc})") from None

    def _read_exact(self, s: _Session, n: int, deadline: float) -> bytes:
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolFailure(f"python_sandbox: the call was killed after {self.options.timeout_s:g}s "
                                  "wall clock")
            r, _, _ = select.select([s.reply_fd], [], [], left)
            if not r:
                continue
            chunk = os.read(s.reply_fd, n - len(buf))
            if not chunk:
                raise ToolFailure(f"python_sandbox: the session died (exit {s.proc.poll()})")
            buf += chunk
        return buf

    def _read_frame(self, s: _Session, seq: int, deadline: float) -> tuple[bool, bytes]:
        """One reply frame: magic, the expected sequence number, a length under the hard cap."""
        head = self._read_exact(s, len(MAGIC) + _HEAD.size, deadline)
        if head[:len(MAGIC)] != MAGIC:
            raise ToolFailure("python_sandbox: malformed reply (protocol violation)")
        got, length, error = _HEAD.unpack(head[len(MAGIC):])
        if got != seq:
            raise ToolFailure(f"python_sandbox: reply for call {got}, expected {seq} (protocol violation)")
        cap = 8 * self.options.max_output_chars + 4096
        if length > cap:
            raise ToolFailure(f"python_sandbox: a {length}-byte reply exceeds the {cap}-byte cap (protocol violation)")
        data = self._read_exact(s, length, deadline)
        return bool(error), data

    @staticmethod
    def _stray(s: _Session) -> bytes | None:
        """What is on the reply pipe between calls: None (nothing: good), b"" (the worker died), or bytes
        (the child wrote a second, forged frame)."""
        r, _, _ = select.select([s.reply_fd], [], [], 0)
        return os.read(s.reply_fd, 1) if r else None

    @staticmethod
    def _stderr(s: _Session) -> str:
        try:
            r, _, _ = select.select([s.proc.stderr], [], [], 0.2)
            return os.read(s.proc.stderr.fileno(), 2000).decode("utf-8", "replace").strip() if r else ""
        except (OSError, ValueError):
            return ""

    def session_end(self, session_id: str) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is not None:
            self._kill(s)  # not under s.lock: a call blocked in a read ends at once (EOF)
            with s.lock:  # then the pipes close, never under a running call (their fd numbers get reused)
                self._release(s)

    def live_sessions(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def reclaim(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """End every session not in ``keep`` (their trajectories died without closing them)."""
        gone = [sid for sid in self.live_sessions() if sid not in keep]
        for sid in gone:
            self.session_end(sid)
        return gone

    def close(self) -> None:
        """End every session and the warm pool (also run at interpreter exit)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
        self._fill.set()
        self._stop_q.put(None)
        self.reclaim()
        for s in pool:
            self._kill(s)
            self._release(s)

    # ------------------------------------------------------------------ killing
    def _kill(self, s: _Session) -> None:
        """Kill the pid namespace (its init: the kernel kills the rest), bwrap, the cgroup; clean up."""
        s.dead = True
        # the namespace's init only while it is still our bwrap's child (its pid cannot have been reused:
        # bwrap is not reaped yet); then bwrap itself
        init = s.ns_init if s.ns_init and _ppid(s.ns_init) == s.proc.pid else None
        for pid in (init, s.proc.pid if s.proc.returncode is None else None):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not self.isolated:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            s.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes exit
            pass
        if not self.isolated:
            # setsid'd children left the group: find them by the token they inherited
            kill_until_gone(lambda: processes_with_token(s.token), tries=20, pause_s=0.01)
        self._undo_host(s)

    @staticmethod
    def _release(s: _Session) -> None:
        """Close the session's pipes and remove its host scratch (after :meth:`_kill`)."""
        for f in (s.proc.stdin, s.proc.stdout, s.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if s.scratch:
            shutil.rmtree(s.scratch, ignore_errors=True)


def isolation_problem(o: SandboxOptions) -> tuple[str, str, str] | None:
    """:func:`unirl_agentic.sandbox_host.isolation_problem`, probing with this module's tool."""
    return sandbox_host.isolation_problem(o, PythonSandbox)


def sandbox_problem(o: SandboxOptions) -> tuple[str, str, str] | None:
    """:func:`unirl_agentic.sandbox_host.sandbox_problem`, probing with this module's tool."""
    return sandbox_host.sandbox_problem(o, PythonSandbox)
