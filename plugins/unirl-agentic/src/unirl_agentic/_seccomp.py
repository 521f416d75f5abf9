"""The seccomp filter of ``python_sandbox``: a classic-BPF program, built here with no dependency, that
bubblewrap loads (``--seccomp FD``) just before it starts the interpreter.

Why hand-built: libseccomp's Python bindings are a Debian package for the system Python only, and the
rules are few. The program checks the architecture first (another ABI has other numbers: a mismatch
kills the process), refuses the x32 ABI, then denies (``EPERM`` unless noted):

* ``socket``/``socketpair`` for every family but ``AF_UNIX`` (``EAFNOSUPPORT``): no TCP, UDP, raw,
  netlink, packet sockets, so no ``sendmsg``/``MSG_FASTOPEN``/``listen``-without-``bind`` either;
* ``clone`` with any namespace flag, ``clone3`` (``ENOSYS``: its flags sit in memory the filter cannot
  read; glibc falls back to ``clone``), ``unshare``, ``setns``;
* ``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``, ``pidfd_getfd`` (no reading other processes);
* ``mount`` and the new mount API, ``umount2``, ``pivot_root``, ``chroot``;
* ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*`` (io_uring can open sockets without the
  ``socket`` syscall), ``keyctl``/``add_key``/``request_key`` (keyrings are per uid, shared with other
  sessions), kernel modules, kexec, ``reboot``, swap, clock and host-name setters, ``syslog``,
  ``personality``, ``iopl``/``ioperm``, ``open_by_handle_at``/``name_to_handle_at``, ``quotactl``,
  ``acct``, ``fanotify_init``, ``lookup_dcookie``, ``vhangup``.
"""

from __future__ import annotations

import errno
import platform
import struct

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K

_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000

_AF_UNIX = 1
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080

#: machine -> (AUDIT_ARCH, syscall numbers); checked against the kernel headers (unistd_64.h, asm-generic)
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "unshare": 272, "setns": 308,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
        "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168, "settimeofday": 164,
        "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170,
        "setdomainname": 171, "syslog": 103, "personality": 135, "iopl": 172, "ioperm": 173,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "quotactl": 179, "acct": 163,
        "fanotify_init": 300, "lookup_dcookie": 212, "vhangup": 153}),
    "aarch64": (0xC00000B7, {
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "unshare": 97, "setns": 268,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104,
        "kexec_file_load": 294, "reboot": 142, "swapon": 224, "swapoff": 225, "settimeofday": 170,
        "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161,
        "setdomainname": 162, "syslog": 116, "personality": 92, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "quotactl": 60, "acct": 89, "fanotify_init": 262, "lookup_dcookie": 18,
        "vhangup": 58}),
}

#: denied outright (EPERM); socket, socketpair, clone and clone3 have their own rules
DENIED = ("unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
          "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
          "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key", "init_module",
          "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
          "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
          "syslog", "personality", "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "quotactl",
          "acct", "fanotify_init", "lookup_dcookie", "vhangup")


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in _ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter as ``struct sock_filter`` records (what ``bwrap --seccomp`` reads)."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise RuntimeError(f"no seccomp syscall table for {machine!r} (supported: {', '.join(_ARCHES)})")
    audit_arch, nr = _ARCHES[machine]
    ins: list[tuple[int, int, int, int]] = []

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        ins.append((code, jt, jf, k))

    op(_LD_W_ABS, 4)  # seccomp_data.arch
    op(_JEQ, audit_arch, 1, 0)
    op(_RET, _KILL_PROCESS)
    op(_LD_W_ABS, 0)  # seccomp_data.nr
    if machine == "x86_64":  # the x32 ABI shares the arch value: refuse its numbers
        op(_JGE, 0x40000000, 0, 1)
        op(_RET, _ERRNO | errno.EPERM)
    for name in ("socket", "socketpair"):  # domain (args[0]) must be AF_UNIX
        op(_JEQ, nr[name], 0, 4)
        op(_LD_W_ABS, 16)
        op(_JEQ, _AF_UNIX, 0, 1)
        op(_RET, _ALLOW)
        op(_RET, _ERRNO | errno.EAFNOSUPPORT)
    op(_JEQ, nr["clone"], 0, 4)  # x86_64 and aarch64: flags are args[0]
    op(_LD_W_ABS, 16)
    op(_JSET, _CLONE_NS, 0, 1)
    op(_RET, _ERRNO | errno.EPERM)
    op(_RET, _ALLOW)
    op(_JEQ, nr["clone3"], 0, 1)
    op(_RET, _ERRNO | errno.ENOSYS)
    for name in DENIED:
        if name in nr:
            op(_JEQ, nr[name], 0, 1)
            op(_RET, _ERRNO | errno.EPERM)
    op(_RET, _ALLOW)
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


#: the rlimit mode's second filter (:func:`pinning`): syscall numbers per machine
_PINNING: dict[str, dict[str, int]] = {
    "x86_64": {"clone": 56, "fcntl": 72, "fork": 57, "vfork": 58, "memfd_create": 319, "memfd_secret": 447,
               "shmget": 29, "socket": 41, "socketpair": 53, "inotify_init": 253, "inotify_init1": 294},
    "aarch64": {"clone": 220, "fcntl": 25, "memfd_create": 279, "memfd_secret": 447, "shmget": 194,
                "socket": 198, "socketpair": 199, "inotify_init1": 26},
}
_CLONE_THREAD = 0x00010000
_F_SETPIPE_SZ = 1031
PINNING_DENIED = ("fork", "vfork", "memfd_create", "memfd_secret", "shmget", "socket", "socketpair",
                  "inotify_init", "inotify_init1")


def pinning(machine: str | None = None) -> bytes:
    """A second filter for sessions without a cgroup (``limits: rlimit``), loaded by the worker itself.

    Why: without a cgroup, ``RLIMIT_AS`` bounds one process, not a session. So such a session stays one
    process (threads allowed: ``clone`` only with ``CLONE_THREAD``; ``fork``/``vfork`` refused), and every
    kernel object that holds memory outside a process's address space and outside the capped tmpfs is
    refused: memfds, SysV shared memory, sockets (their buffers), inotify instances, and pipe buffers
    grown past their default (``F_SETPIPE_SZ``). All ``EPERM``."""
    machine = machine or platform.machine()
    if machine not in _PINNING:
        raise RuntimeError(f"no seccomp syscall table for {machine!r} (supported: {', '.join(_PINNING)})")
    audit_arch, nr = _ARCHES[machine][0], _PINNING[machine]
    ins: list[tuple[int, int, int, int]] = []

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        ins.append((code, jt, jf, k))

    deny = _ERRNO | errno.EPERM
    op(_LD_W_ABS, 4)
    op(_JEQ, audit_arch, 1, 0)
    op(_RET, _KILL_PROCESS)
    op(_LD_W_ABS, 0)
    op(_JEQ, nr["clone"], 0, 4)  # flags: args[0]
    op(_LD_W_ABS, 16)
    op(_JSET, _CLONE_THREAD, 0, 1)
    op(_RET, _ALLOW)
    op(_RET, deny)
    op(_JEQ, nr["fcntl"], 0, 4)  # cmd: args[1]
    op(_LD_W_ABS, 24)
    op(_JEQ, _F_SETPIPE_SZ, 0, 1)
    op(_RET, deny)
    op(_RET, _ALLOW)
    for name in PINNING_DENIED:
        if name in nr:
            op(_JEQ, nr[name], 0, 1)
            op(_RET, deny)
    op(_RET, _ALLOW)
    return b"".join(struct.pack("=HBBI", *i) for i in ins)
