"""One capped tmpfs per ``python_sandbox`` session without a cgroup (``limits: rlimit``, trainer root).

Why: bubblewrap's ``--tmpfs`` takes a size but no inode cap, and without a cgroup nothing else charges
a session for its inodes: empty files filled host memory (about 1 KiB of kernel memory each, millions
per tmpfs). Here the trainer mounts one tmpfs per session on the host with ``size=`` (``scratch_mb``,
shared by ``/scratch``, ``/tmp`` and ``/dev/shm``) and ``nr_inodes=``, and bubblewrap binds its three
directories into place. The mount is detached at the session's end; one a SIGKILLed trainer left is
detached by the next trainer that mounts (its name carries its owner's pid and start time).
"""

from __future__ import annotations

import ctypes
import os

from unirl_agentic.sandbox_cgroups import owner_alive

MNT_DIR = "/run/unirl-sandbox/mnt"
DIRS = ("scratch", "tmp", "shm")
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


def inode_cap(scratch_mb: int) -> int:
    """Inodes of a session's tmpfs: 128 per MiB (a 64 MiB scratch holds 8,192 files and dirs)."""
    return max(256, scratch_mb * 128)


def mount_scratch(name: str, scratch_mb: int, uid: int, gid: int) -> str:
    """Mount the session's tmpfs at ``MNT_DIR/name`` with its three directories owned by ``uid``."""
    os.makedirs(MNT_DIR, exist_ok=True)
    for d in (os.path.dirname(MNT_DIR), MNT_DIR):
        os.chmod(d, 0o711)  # traversable by the session's uid (bubblewrap binds as that uid)
    path = os.path.join(MNT_DIR, name)
    os.mkdir(path, 0o700)
    opts = f"size={scratch_mb << 20},nr_inodes={inode_cap(scratch_mb)},mode=0711".encode()
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        os.rmdir(path)
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")
    for d in DIRS:
        p = os.path.join(path, d)
        os.mkdir(p, 0o700)
        os.chown(p, uid, gid)
    return path


def unmount(path: str | None) -> None:
    """Detach the session's tmpfs (lazily: the kernel frees it with the sandbox's last reference)."""
    if path is None:
        return
    _libc.umount2(path.encode(), _MNT_DETACH)
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_stale() -> list[str]:
    """Detach every session tmpfs whose trainer is gone."""
    try:
        names = os.listdir(MNT_DIR)
    except OSError:
        return []
    gone = [os.path.join(MNT_DIR, n) for n in names if not owner_alive(n)]
    for p in gone:
        unmount(p)
    return gone
