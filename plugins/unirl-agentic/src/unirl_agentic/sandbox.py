"""``python_sandbox``: a persistent Python interpreter per trajectory, that cannot hurt the host.

Each session is one subprocess (``_sandbox_worker.py``) in a fresh scratch dir, with layered
containment, because any single layer can be bypassed or may be missing on a machine:

* **an unprivileged account**: a trainer running as root starts sessions as ``nobody`` (root ignores
  ``RLIMIT_NPROC`` and every file permission), in a scratch dir that account owns;
* **rlimits** set before exec: address space (``memory_mb``), CPU seconds per session (``cpu_s``),
  file size, open files, no core dumps, and ``RLIMIT_NPROC`` set to the account's *current* task count plus
  ``max_procs`` (the limit counts every task of the user, other jobs included, so an absolute number
  would either starve them or be no limit at all; a relative one bounds a fork bomb to ``max_procs``);
* **a wall-clock timeout** per call (``timeout_s``): past it the session is killed and the call raises
  :class:`~unirl_agentic.tooling.ToolFailure` (reward NaN, not a miss);
* **a new session / process group**, killed as a whole at session end; when unprivileged user
  namespaces work (probed once), also a **PID namespace** with its own ``/proc`` (``unshare``): when
  its first process dies the kernel kills every process in it, so a child that called ``setsid`` dies
  too. Without namespaces a sweep kills any process still carrying the session's token in its
  environment;
* **a scrubbed environment**: only ``PATH``, ``HOME``/``TMPDIR`` (the scratch dir), ``LANG`` and the
  session token; the parent's variables are never passed;
* **an audit hook** in the worker (see its module doc): no writes outside the scratch dir, no exec,
  no ctypes, no sockets, no reading other processes' ``/proc`` entries;
* **output truncation** to ``max_output_chars`` inside the worker (bounded memory);
* the scratch dir is removed at session end, and sessions are **reclaimed** if their trajectory died
  without closing them (:meth:`PythonSandbox.reclaim`, also run at interpreter exit).
"""

from __future__ import annotations

import atexit
import json
import os
import pwd
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import ConfigError, ToolResult
from unirl_agentic.tooling import StatefulTool, ToolFailure

_WORKER = str(Path(__file__).with_name("_sandbox_worker.py"))
_NS_PREFIX = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]
_ns_ok: dict[tuple[int, int], bool] = {}
_py_ok: dict[tuple[str, int], bool] = {}
_ns_lock = threading.Lock()


class SandboxOptions(BaseModel):
    """``plugins.agentic.tools.python_sandbox``."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one call")
    cpu_s: int = Field(20, ge=1, description="CPU seconds a whole session may use (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, description="address-space limit of the session (RLIMIT_AS)")
    file_mb: int = Field(16, ge=1, description="largest file the session may write (RLIMIT_FSIZE)")
    max_procs: int = Field(16, ge=1, description="extra tasks the session may create (RLIMIT_NPROC, relative)")
    max_output_chars: int = Field(2000, ge=16, description="output returned to the model, truncated beyond")
    namespaces: bool | None = Field(None, description="PID namespace via unshare; None: use when it works")
    user: str | None = Field(None, description="account the session runs as; None: 'nobody' when the trainer "
                             "is root (root ignores RLIMIT_NPROC and file permissions), else the trainer's own")
    python: str | None = Field(None, description="interpreter for the worker (stdlib only); None: the trainer's "
                               "if that account can run it, else /usr/bin/python3")


#: where the options live in a recipe (the field preflight names)
FIELD = "plugins.agentic.tools.python_sandbox"


def account_problem(o: SandboxOptions) -> tuple[str, str, str] | None:
    """``(field, message, fix)`` when the sandbox account cannot be resolved on this host, else None.

    Why preflight asks this: the tool is built with the rollout components, after the actor's model;
    a misspelt ``user`` used to surface there as a bare ``KeyError`` from :func:`pwd.getpwnam`."""
    name = o.user or ("nobody" if os.geteuid() == 0 else None)
    if name is None:
        return None
    try:
        pwd.getpwnam(name)
    except KeyError:
        if o.user is None:
            return (f"{FIELD}.user", "the trainer runs as root, so sandbox sessions drop to 'nobody', but this "
                    "host has no such account", "set it to an existing unprivileged account (getent passwd lists them)")
        return (f"{FIELD}.user", f"{name!r}: no such account on this host",
                f"name an existing unprivileged account, e.g. {FIELD}.user=nobody, or leave it unset to run "
                "as the trainer's own account ('nobody' when the trainer is root)")
    return None


def python_problem(o: SandboxOptions) -> tuple[str, str, str] | None:
    """``(field, message, fix)`` when ``python`` names no executable file (checked before any model)."""
    if o.python is None or (os.path.isfile(o.python) and os.access(o.python, os.X_OK)):
        return None
    return (f"{FIELD}.python", f"{o.python!r} is not an executable file",
            "give the path of a python3 interpreter, e.g. /usr/bin/python3, or leave it unset")


def _as_user(uid: int, gid: int):
    """A preexec function that drops to ``uid``/``gid`` (a no-op when already them)."""
    def drop() -> None:
        if os.getuid() != uid:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
    return drop


def _probe(cmd: list[str], uid: int, gid: int) -> bool:
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=20, preexec_fn=_as_user(uid, gid), cwd="/")
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def namespaces_available(uid: int | None = None, gid: int | None = None) -> bool:
    """Whether ``unshare`` can make an unprivileged user + PID namespace here as ``uid`` (probed once)."""
    uid = os.getuid() if uid is None else uid
    gid = os.getgid() if gid is None else gid
    with _ns_lock:
        if (uid, gid) not in _ns_ok:
            _ns_ok[(uid, gid)] = _probe([*_NS_PREFIX, "true"], uid, gid)
        return _ns_ok[(uid, gid)]


def _interpreter(candidates: list[str | None], uid: int, gid: int) -> str:
    for c in candidates:
        if c and (c, uid) not in _py_ok:
            _py_ok[(c, uid)] = _probe([c, "-I", "-S", "-c", "pass"], uid, gid)
        if c and _py_ok[(c, uid)]:
            return c
    raise ConfigError(f"{FIELD}.python: no interpreter the sandbox account (uid {uid}) can run among "
                      f"{[c for c in candidates if c]} (fix: set it to a python3 that account may execute, "
                      "e.g. /usr/bin/python3)")


def user_task_count(uid: int | None = None) -> int:
    """Tasks (threads included: what RLIMIT_NPROC counts) owned by ``uid`` right now."""
    uid, n = (os.getuid() if uid is None else uid), 0
    for d in os.scandir("/proc"):
        if not d.name.isdigit():
            continue
        try:
            if d.stat().st_uid == uid:
                n += len(os.listdir(f"/proc/{d.name}/task"))
        except OSError:
            continue
    return n


def processes_with_token(token: str) -> list[int]:
    """Pids of processes whose environment carries ``token`` (the sweep's oracle)."""
    needle, out = f"UNIRL_SANDBOX_TOKEN={token}".encode(), []
    for d in os.scandir("/proc"):
        if not d.name.isdigit():
            continue
        try:
            with open(f"/proc/{d.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d.name))
        except OSError:
            continue
    return out


@dataclass
class _Session:
    proc: subprocess.Popen
    scratch: str
    token: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: bool = False


_ALL: weakref.WeakSet[PythonSandbox] = weakref.WeakSet()


@atexit.register
def _reclaim_all() -> None:  # a trainer that exits never leaves a sandbox behind
    for tool in list(_ALL):
        tool.reclaim()


class PythonSandbox(StatefulTool):
    """The ``python_sandbox`` tool: ``{"code": "..."}`` runs in the trajectory's interpreter."""

    name: ClassVar[str] = "python_sandbox"
    description: ClassVar[str] = "Run Python code in a persistent sandboxed interpreter; prints are returned."
    Config = SandboxOptions

    def __init__(self, *, config: Any = None, options: SandboxOptions | dict | None = None):
        if options is None and config is not None:
            options = ((config.plugins.get("agentic") or {}).get("tools") or {}).get(self.name)
        self.options = options if isinstance(options, SandboxOptions) else SandboxOptions.model_validate(options or {})
        o = self.options
        problem = account_problem(o)  # preflight reports it first; a tool built without preflight too
        if problem is not None:
            field_, message, fix = problem
            raise ConfigError(f"{field_}: {message} (fix: {fix})")
        name = o.user or ("nobody" if os.geteuid() == 0 else None)
        if name is None:
            self.uid, self.gid = os.getuid(), os.getgid()
        else:
            pw = pwd.getpwnam(name)
            self.uid, self.gid = pw.pw_uid, pw.pw_gid
        self.python = _interpreter([o.python, sys.executable, "/usr/bin/python3"], self.uid, self.gid)
        self.use_namespaces = namespaces_available(self.uid, self.gid) if o.namespaces is None else o.namespaces
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        _ALL.add(self)

    # ------------------------------------------------------------------ sessions
    def session_start(self, session_id: str) -> None:
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"python_sandbox: session {session_id!r} is already open")
        scratch = tempfile.mkdtemp(prefix="unirl-sandbox-")
        worker = os.path.join(scratch, ".worker.py")  # a copy the sandbox account can always read
        shutil.copyfile(_WORKER, worker)
        if os.geteuid() == 0:
            os.chown(scratch, self.uid, self.gid)
        token = uuid.uuid4().hex
        o = self.options
        nproc = user_task_count(self.uid) + o.max_procs + (2 if self.use_namespaces else 1)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
               "UNIRL_SANDBOX_MAX_OUTPUT": str(o.max_output_chars), "UNIRL_SANDBOX_TOKEN": token}
        mem = o.memory_mb << 20
        drop = _as_user(self.uid, self.gid)

        def limits() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_CPU, (o.cpu_s, o.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (o.file_mb << 20, o.file_mb << 20))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            drop()  # last: the limits are set while still allowed to, then they bind the sandbox account

        cmd = [self.python, "-I", "-S", worker]
        if self.use_namespaces:
            cmd = [*_NS_PREFIX, "--", *cmd]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    cwd=scratch, env=env, start_new_session=True, preexec_fn=limits,
                                    close_fds=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        with self._lock:
            self._sessions[session_id] = _Session(proc, scratch, token)

    def execute(self, session_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('python_sandbox: arguments must be {"code": "<python source>"}', error=True)
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise ToolFailure(f"python_sandbox: no open session {session_id!r}")
        with s.lock:
            if s.dead:
                raise ToolFailure("python_sandbox: the session was killed earlier in this trajectory")
            try:
                s.proc.stdin.write((json.dumps({"code": code}) + "\n").encode())
                s.proc.stdin.flush()
            except OSError as exc:
                self._kill(s)
                raise ToolFailure(f"python_sandbox: the session died ({exc})") from None
            line = self._read_line(s, self.options.timeout_s)
        if line is None:
            raise ToolFailure(f"python_sandbox: the call was killed after {self.options.timeout_s:g}s "
                              f"wall clock, or the session died (exit {s.proc.poll()})")
        try:
            reply = json.loads(line)
        except ValueError:
            self._kill(s)
            raise ToolFailure("python_sandbox: the worker sent a malformed reply") from None
        return ToolResult(str(reply.get("output", "")), error=bool(reply.get("error")))

    def _read_line(self, s: _Session, timeout: float) -> bytes | None:
        """One reply line, or None (session killed) when the deadline passes or the worker dies."""
        deadline = time.monotonic() + timeout
        buf = b""
        fd = s.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    self._kill(s)
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # EOF: the worker died (rlimit, os._exit)
                    self._kill(s)
                    return None
                buf += chunk
                if b"\n" in buf:
                    return buf.split(b"\n", 1)[0]

    def session_end(self, session_id: str) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return
        self._kill(s)  # not under s.lock: a call blocked in a read ends at once (EOF)
        with s.lock:
            for f in (s.proc.stdin, s.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        shutil.rmtree(s.scratch, ignore_errors=True)

    def live_sessions(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def reclaim(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """End every session not in ``keep`` (their trajectories died without closing them)."""
        gone = [sid for sid in self.live_sessions() if sid not in keep]
        for sid in gone:
            self.session_end(sid)
        return gone

    # ------------------------------------------------------------------ killing
    def _kill(self, s: _Session) -> None:
        """Kill the session's process group (and PID namespace), then sweep stragglers by token."""
        s.dead = True
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            s.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes exit
            pass
        for _ in range(20):  # setsid'd children left the group: find them by the token they inherited
            pids = processes_with_token(s.token)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
