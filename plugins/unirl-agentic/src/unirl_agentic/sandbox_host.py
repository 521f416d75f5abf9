"""What ``python_sandbox`` needs of the host: its options, the sandbox account, bubblewrap, the interpreter
and the files it loads (its runtime), and the spawning thread. Checked before any model is built
(preflight), so a missing account or interpreter is a one-line error, not a failure minutes into a run.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import queue
import shutil
import subprocess
import sys
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from unirl.api import ConfigError, StrictOptions
from unirl_agentic import _seccomp

INSTALL_FIX = ("install bubblewrap: `make install` (runs `apt-get install -y bubblewrap`), or set "
               "plugins.agentic.tools.python_sandbox.allow_unisolated: true to run without OS isolation "
               "(logs a warning; not a security boundary)")


class SandboxOptions(StrictOptions):
    """``plugins.agentic.tools.python_sandbox`` (finite numbers only: an infinite ``timeout_s`` would be no
    timeout at all)."""

    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one call (enforced from outside)")
    cpu_s: int = Field(20, ge=1, description="CPU seconds per process of the session (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, description="memory of the whole session (cgroup), and RLIMIT_AS per process")
    file_mb: int = Field(16, ge=1, description="largest file the session may write (RLIMIT_FSIZE)")
    scratch_mb: int = Field(64, ge=1, description="size of each private tmpfs (/scratch, /tmp, /dev/shm)")
    max_procs: int = Field(16, ge=1, description="tasks the session may create (cgroup pids, or RLIMIT_NPROC "
                           "inside its user namespace)")
    max_output_chars: int = Field(2000, ge=16, description="output returned to the model, truncated beyond")
    user: str | None = Field(None, description="trainer root: the account whose /etc/subuid range gives each "
                             "session its own host uid (None: 'nobody'; no range: a built-in private one); else "
                             "the account sessions run as (None: the trainer's own)")
    python: str | None = Field(None, description="interpreter of the worker (stdlib only); None: /usr/bin/python3 "
                               "if present, else the trainer's")
    bwrap: str | None = Field(None, description="path of bubblewrap; None: `bwrap` on PATH")
    limits: Literal["auto", "cgroup", "rlimit"] = Field(
        "auto", description="whole-session limits: a cgroup (v2 or v1 memory+pids), per-namespace rlimits, or "
        "auto (cgroup when one can be made here)")
    pool_size: int = Field(2, ge=0, description="sandboxes started ahead of time (a warm pool): a session's "
                           "first call then skips start-up")
    guard: bool = Field(True, description="Python audit hook that turns refused actions into clear messages "
                        "(a convenience, not a security boundary)")
    allow_unisolated: bool = Field(False, description="where bubblewrap cannot run, run the weaker unisolated "
                                   "mode (rlimits + audit hook; NOT a security boundary) instead of refusing")


#: where the options live in a recipe (the field preflight names)
FIELD = "plugins.agentic.tools.python_sandbox"


# ---------------------------------------------------------------------------------------- host checks
def _account(o: SandboxOptions) -> str | None:
    return o.user or ("nobody" if os.geteuid() == 0 else None)


def account_problem(o: SandboxOptions) -> tuple[str, str, str] | None:
    """``(field, message, fix)`` when the sandbox account cannot be resolved on this host, else None.

    Why preflight asks this: the tool is built with the rollout components, after the actor's model;
    a misspelt ``user`` used to surface there as a bare ``KeyError`` from :func:`pwd.getpwnam`."""
    name = _account(o)
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


def _ids(o: SandboxOptions) -> tuple[int, int]:
    name = _account(o)
    if name is None:
        return os.getuid(), os.getgid()
    pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


def _as_user(uid: int, gid: int):
    """A preexec function that drops to ``uid``/``gid`` (a no-op when already them)."""
    def drop() -> None:
        if os.getuid() != uid:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
    return drop


def _bwrap_path(o: SandboxOptions) -> str | None:
    if o.bwrap:
        return o.bwrap if os.path.isfile(o.bwrap) and os.access(o.bwrap, os.X_OK) else None
    return shutil.which("bwrap")


# ---------------------------------------------------------------------------------------- the runtime
_runtime_cache: dict[str, dict[str, Any]] = {}


def _runtime(python: str) -> dict[str, Any]:
    """What the sandbox must see of ``python``: its binary, stdlib, lib-dynload and shared libraries."""
    if python in _runtime_cache:
        return _runtime_cache[python]
    probe = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
             "print(json.dumps({'exe': sys.executable, 'stdlib': p['stdlib'], 'platstdlib': p['platstdlib'], "
             "'purelib': p['purelib'], 'platlib': p['platlib'], 'path': sys.path}))")
    # Probe without the trainer's LD_PRELOAD: the sandboxed interpreter runs without it, and ldd lists
    # preloaded objects as dependencies (vLLM's CPU platform preloads torch's libgomp into os.environ, and
    # binding that file failed the sandbox's start wherever the checkout is unreadable to the session uid).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30, env=env)
    if r.returncode != 0:
        raise ConfigError(f"{FIELD}.python: {python} does not run ({r.stderr.strip()[-300:]}) (fix: set it to "
                          "a working python3, e.g. /usr/bin/python3)")
    info = json.loads(r.stdout)
    exe = os.path.realpath(info["exe"] or python)
    dirs = {os.path.realpath(info["stdlib"]), os.path.realpath(info["platstdlib"])}
    dirs |= {os.path.realpath(p) for p in info["path"] if os.path.isdir(p) and "lib-dynload" in p}
    hide = sorted({os.path.realpath(info[k]) for k in ("purelib", "platlib")
                   if any(os.path.realpath(info[k]).startswith(d + os.sep) for d in dirs)
                   and os.path.isdir(info[k])})
    objects = [exe] + [f for d in dirs for f in glob.glob(os.path.join(d, "**", "*.so"), recursive=True)
                       if not any(f.startswith(h + os.sep) for h in hide)]
    libs: set[str] = set()
    ldd = shutil.which("ldd")
    if ldd is None:
        raise ConfigError(f"{FIELD}.python: `ldd` is needed to find the interpreter's shared libraries "
                          "(fix: install libc-bin)")
    for i in range(0, len(objects), 64):
        out = subprocess.run([ldd, *objects[i:i + 64]], capture_output=True, text=True, timeout=60, env=env).stdout
        for line in out.splitlines():
            for tok in line.split():
                if tok.startswith("/") and os.path.exists(tok) and not tok.endswith(":"):
                    libs.add(tok)
    extra = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout \
        if os.path.exists("/sbin/ldconfig") else ""
    for line in extra.splitlines():  # dlopen'ed by glibc at thread exit
        if "libgcc_s.so.1 " in line and "=>" in line:
            libs.add(line.split("=>")[-1].strip())
            break
    files: set[str] = set()
    for lib in libs:
        files.add(lib)
        files.add(os.path.realpath(lib))
    rt = {"exe": exe, "dirs": sorted(dirs), "files": sorted(files - {exe}), "hide": hide}
    _runtime_cache[python] = rt
    return rt


def _readable_by(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid`` can reach ``path`` (every parent searchable): bwrap binds as that account."""
    if uid == 0:
        return True
    try:
        r = subprocess.run(["test", "-r", path], preexec_fn=_as_user(uid, gid), timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


# ---------------------------------------------------------------------------------------- spawning
class _Spawner:
    """One long-lived thread forks every sandbox.

    Why: ``--die-with-parent`` (PR_SET_PDEATHSIG) fires when the *thread* that forked bwrap exits, so a
    session started from a short-lived thread would die with it."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="unirl-sandbox-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self._q.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def call(self, fn):
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _spawn(fn):
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.call(fn)


def processes_with_token(token: str) -> list[int]:
    """Pids of processes whose environment carries ``token`` (a host-side tracer for tests and the
    unisolated sweep; never used for integrity)."""
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


_probe_cache: dict[tuple, tuple[str, str, str] | None] = {}
_probe_lock = threading.Lock()


def isolation_problem(o: SandboxOptions, tool_cls: type) -> tuple[str, str, str] | None:
    """``(field, message, fix)`` when the OS sandbox cannot run here (and ``allow_unisolated`` is off).

    Why a real probe (a sandbox is started once, cached): bwrap can be installed yet refused by the
    kernel (user namespaces disabled, a seccomp-less kernel); the run must learn that before a model."""
    if o.allow_unisolated:
        return None
    return sandbox_problem(o, tool_cls)


def sandbox_problem(o: SandboxOptions, tool_cls: type) -> tuple[str, str, str] | None:
    """Why no OS sandbox can run here with these options (None: it can), whatever ``allow_unisolated`` says.

    ``tool_cls`` is the tool whose sandbox the probe starts (``unirl_agentic.sandbox.PythonSandbox``),
    passed in rather than imported: the tool's module imports this one, so the probe must not import it."""
    bwrap = _bwrap_path(o)
    if bwrap is None:
        where = f"{o.bwrap!r} is not an executable file" if o.bwrap else "`bwrap` is not on PATH"
        return (f"{FIELD}.bwrap", f"bubblewrap is not available ({where}): python_sandbox isolates model-written "
                "code with it and refuses to run without it", INSTALL_FIX)
    if not _seccomp.supported():
        import platform
        return (f"{FIELD}.allow_unisolated", f"no seccomp syscall table for this CPU ({platform.machine()})",
                "run on x86_64 or aarch64, or set allow_unisolated: true (not a security boundary)")
    if account_problem(o) or python_problem(o):
        return None  # reported on their own
    key = (bwrap, o.python, _account(o), o.limits)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe_sandbox(o, bwrap, tool_cls)
        return _probe_cache[key]


def _probe_sandbox(o: SandboxOptions, bwrap: str, tool_cls: type) -> tuple[str, str, str] | None:
    from unirl_agentic.tooling import ToolFailure

    try:
        tool = tool_cls(options=o.model_copy(update={"pool_size": 0}), _probing=True)
    except ConfigError as exc:
        return (f"{FIELD}.python", str(exc), "set python to an interpreter the sandbox account can read")
    sid = f"probe-{uuid.uuid4().hex[:8]}"
    try:
        tool.session_start(sid)
        res = tool.execute(sid, {"code": "print(6 * 7)"})
        if res.content.strip() != "42":
            raise ToolFailure(f"unexpected output {res.content!r}")
    except (ToolFailure, OSError, ConfigError) as exc:
        return (f"{FIELD}.bwrap", f"bubblewrap ({bwrap}) is installed but could not start a sandbox here: {exc}",
                "check that unprivileged user namespaces are enabled (sysctl user.max_user_namespaces > 0) and "
                f"that the sandbox account can read the interpreter; or {INSTALL_FIX}")
    finally:
        tool.close()
    return None


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def pick_python(o: SandboxOptions, uid: int, gid: int) -> str:
    """The isolated worker's interpreter: the first candidate whose binary and stdlib ``uid`` can read."""
    cands = [o.python] if o.python else ["/usr/bin/python3", sys.executable]
    for c in cands:
        if c and os.path.exists(c) and _readable_by(os.path.realpath(c), uid, gid):
            rt = _runtime(c)
            if all(_readable_by(d, uid, gid) for d in rt["dirs"]):
                return c
    raise ConfigError(f"{FIELD}.python: no interpreter among {[c for c in cands if c]} that the sandbox "
                      f"account (uid {uid}) can read (fix: set it to a python3 outside private home "
                      "dirs, e.g. /usr/bin/python3)")

def pick_unisolated_python(o: SandboxOptions, uid: int, gid: int) -> str:
    """The unisolated worker's interpreter: the first candidate ``uid`` can run."""
    for c in [o.python, sys.executable, "/usr/bin/python3"]:
        if c and os.path.exists(c):
            try:
                r = subprocess.run([c, "-I", "-S", "-c", "pass"], capture_output=True, timeout=20,
                                   preexec_fn=_as_user(uid, gid), cwd="/")
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0:
                return c
    raise ConfigError(f"{FIELD}.python: no interpreter the sandbox account (uid {uid}) can run "
                      "(fix: set it to a python3 that account may execute, e.g. /usr/bin/python3)")
