"""One host uid per ``python_sandbox`` session (when the trainer is root).

Why: the kernel keeps some limits per *host* user, not per namespace: inotify instances and watches,
the pipe buffer quota, POSIX message queue bytes, pending signals, in-flight SCM_RIGHTS fds. When every
session ran as ``nobody``, one session that exhausted one of them made the same calls fail in every
other session (and for any host process of that account). A session of its own uid owns its quotas.

Where the ids come from: the sandbox account's range in ``/etc/subuid`` (``nobody:<start>:<count>``)
when it has one, else a fixed private range that no account or container manager uses
(:data:`DEFAULT_RANGE`, above systemd's container ranges). The gid is the same number. No passwd entry is
needed: the id only names a kernel accounting bucket and owns nothing on the host but the session's own
scratch mount.

Allocation works across trainers on one host: a uid is taken by an exclusive ``flock`` on
``<lock dir>/<uid>.lock``, held for the session's life and released by the kernel when the trainer exits,
however it exits. A uid that still has live processes (a session of a killed trainer on its way out) is
skipped.
"""

from __future__ import annotations

import fcntl
import os
import random

#: (first uid, count): 0x70000000.., past systemd's container ranges (524288..1879048191)
DEFAULT_RANGE = (0x70000000, 65536)
LOCK_DIR = "/run/unirl-sandbox/uids"


def subid_range(account: str, uid: int | None, path: str = "/etc/subuid") -> tuple[int, int] | None:
    """The first ``account:start:count`` (or ``uid:start:count``) line of ``path``, else None."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in (account, str(uid)) and parts[1].isdigit() and parts[2].isdigit():
            if int(parts[2]) > 0:
                return int(parts[1]), int(parts[2])
    return None


def mapped(start: int, count: int, path: str = "/proc/self/uid_map") -> bool:
    """Whether this process's user namespace maps every uid of ``[start, start + count)`` (a container
    with a short map, e.g. rootless, cannot switch to the default range)."""
    try:
        rows = [tuple(int(x) for x in line.split()) for line in open(path, encoding="utf-8") if line.strip()]
    except (OSError, ValueError):
        return False
    return any(len(r) == 3 and r[0] <= start and start + count <= r[0] + r[2] for r in rows)


def uid_in_use(uid: int) -> bool:
    """Whether a process of host ``uid`` exists (a scan of /proc, about 1 ms per 500 processes)."""
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    return True
            except OSError:
                continue
    return False


class SessionIds:
    """Hands out host uids of ``[start, start + count)``, one per live session, host-wide."""

    def __init__(self, start: int, count: int, lock_dir: str = LOCK_DIR):
        self.start, self.count, self.lock_dir = start, count, lock_dir
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)

    def acquire(self) -> tuple[int, int]:
        """``(uid, lock fd)``; close the fd (:meth:`release`) when the session's processes are gone."""
        first = random.randrange(self.count)
        for i in range(min(self.count, 4096)):
            uid = self.start + (first + i) % self.count
            fd = os.open(os.path.join(self.lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if uid_in_use(uid):
                os.close(fd)
                continue
            return uid, fd
        raise OSError(f"no free sandbox uid in {self.start}..{self.start + self.count - 1}")

    @staticmethod
    def release(fd: int | None) -> None:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
