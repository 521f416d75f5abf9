"""Per-session cgroups of ``python_sandbox`` (v2 where its controllers can be enabled, else v1 ``memory`` +
``pids``), and the removal of those a killed trainer left behind.

Why stale removal lives here: a trainer killed with SIGKILL runs no cleanup, so its sessions' cgroup
directories stay. Every session's directory is named after its trainer (pid and start time, so a reused
pid is not mistaken for the owner); the next trainer that sets up cgroups empties and removes every
directory whose owner is gone.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

from unirl_agentic.sandbox_freeze import kill_until_gone


def proc_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), or None when it does not exist."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_tag() -> str:
    """``<pid>.<start time>`` of this process: names what it creates on the host, for stale cleanup."""
    return f"{os.getpid()}.{proc_start(os.getpid())}"


_OWNED = re.compile(r"^unirl-(?:sandbox|probe)-(\d+)(?:\.(\d+))?-")


def owner_alive(name: str) -> bool:
    """Whether the trainer that named ``name`` (``unirl-sandbox-<pid>.<start>-...``) still runs."""
    m = _OWNED.match(name)
    if m is None:
        return True  # not ours: never touched
    pid, start = int(m.group(1)), m.group(2)
    now = proc_start(pid)
    return now is not None and (start is None or int(start) == now)


def _own_cgroup(controller: str | None) -> str | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if controller is None and hid == "0" and ctrls == "":
            return path
        if controller is not None and controller in ctrls.split(","):
            return path
    return None


class _Cgroup:
    """One session's cgroup(s): ``procs_files`` (joined by the child before exec), kill, remove."""

    def __init__(self, dirs: list[str], kill_file: str | None):
        self.dirs, self.kill_file = dirs, kill_file
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out |= {int(x) for x in Path(f).read_text().split()}
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill(self) -> None:
        if self.kill_file:
            try:
                Path(self.kill_file).write_text("1")
            except OSError:
                pass
        kill_until_gone(self.pids, tries=200, pause_s=0.005)

    def remove(self) -> None:
        for d in reversed(self.dirs):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


class CgroupFactory:
    """Makes per-session cgroups: v2 where its controllers can be enabled, else v1 ``memory`` + ``pids``.

    Why both: cgroup v2 is the norm, but this kind of machine mounts v1 (writable ``memory`` and ``pids``
    hierarchies). Session groups nest under the trainer's own group, so its limits still cover them."""

    def __init__(self, root: str = "/sys/fs/cgroup"):
        self.root = root
        self.kind: str | None = None
        self._bases: list[tuple[str, str]] = []
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            self._setup_v2()
        elif os.path.isdir(os.path.join(root, "memory")) and os.path.isdir(os.path.join(root, "pids")):
            self._setup_v1()

    def _setup_v2(self) -> None:
        own = _own_cgroup(None)
        if own is None:
            return
        base = os.path.join(self.root, own.lstrip("/"))
        try:
            enabled = Path(base, "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(enabled):
                Path(base, "cgroup.subtree_control").write_text("+memory +pids")
        except OSError:
            return
        self.kind, self._bases = "cgroup-v2", [("v2", base)]

    def _setup_v1(self) -> None:
        bases = []
        for ctrl in ("memory", "pids"):
            own = _own_cgroup(ctrl)
            if own is None:
                return
            base = os.path.join(self.root, ctrl, own.lstrip("/"))
            if not os.access(base, os.W_OK):
                return
            bases.append((ctrl, base))
        self.kind, self._bases = "cgroup-v1", bases

    def create(self, name: str, memory_bytes: int, max_tasks: int) -> _Cgroup:
        dirs: list[str] = []
        try:
            for ctrl, base in self._bases:
                d = os.path.join(base, name)
                os.mkdir(d)
                dirs.append(d)
                if ctrl == "v2":
                    Path(d, "memory.max").write_text(str(memory_bytes))
                    if os.path.exists(os.path.join(d, "memory.swap.max")):
                        Path(d, "memory.swap.max").write_text("0")
                    Path(d, "pids.max").write_text(str(max_tasks))
                elif ctrl == "memory":
                    Path(d, "memory.limit_in_bytes").write_text(str(memory_bytes))
                    if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                        Path(d, "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                else:
                    Path(d, "pids.max").write_text(str(max_tasks))
        except OSError:
            _Cgroup(dirs, None).remove()
            raise
        kill = os.path.join(dirs[0], "cgroup.kill") if self.kind == "cgroup-v2" else None
        return _Cgroup(dirs, kill if kill and os.path.exists(kill) else None)

    def works(self) -> bool:
        if self.kind is None:
            return False
        try:
            self.create(f"unirl-probe-{owner_tag()}-{uuid.uuid4().hex[:6]}", 64 << 20, 8).remove()
        except OSError:
            return False
        return True


_cgroups: CgroupFactory | None = None


def _cgroup_factory() -> CgroupFactory | None:
    global _cgroups
    if _cgroups is None:
        _cgroups = CgroupFactory()
        remove_stale([base for _, base in _cgroups._bases])  # what a SIGKILLed trainer left behind
    return _cgroups if _cgroups.works() else None


def remove_stale(bases: list[str]) -> list[str]:
    """Kill the processes of, and remove, every session cgroup under ``bases`` whose trainer is gone."""
    gone = []
    for base in bases:
        try:
            names = [e.name for e in os.scandir(base) if e.is_dir() and _OWNED.match(e.name)]
        except OSError:
            continue
        for name in names:
            if owner_alive(name):
                continue
            cg = _Cgroup([os.path.join(base, name)], None)
            cg.kill()
            cg.remove()
            gone.append(cg.dirs[0])
    return gone
