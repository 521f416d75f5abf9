"""The process inside a ``python_sandbox`` session (run as a script, never imported by the trainer).

Protocol: one JSON line in on stdin (``{"code": ...}``), one JSON line out on the private fd the parent
reads (a dup of the original stdout, taken before user code runs). User output goes to a capped buffer;
writes to fd 1/2 land in a file in the scratch dir, so user code can never forge a protocol line.

Why an audit hook (PEP 578) on top of the parent's rlimits, process group and PID namespace: rlimits
bound resources but not *where* a process writes or what it reads. The hook, installed before any user
code, refuses writes outside the scratch dir, process spawning (exec / subprocess / posix_spawn),
native code (ctypes, cffi), sockets, signals to other processes and reads of other processes' /proc
entries. ``os.fork`` stays allowed (a forked child shares the hook and the rlimits); the parent kills
the whole process group / namespace at session end.
"""

import io
import json
import os
import sys
import traceback

SCRATCH = os.path.realpath(os.getcwd())
CAP = int(os.environ.get("UNIRL_SANDBOX_MAX_OUTPUT", "4096"))
PID = os.getpid()

_BLOCKED_EVENTS = {
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
    "os.chroot", "os.setuid", "os.setgid", "sys.setprofile", "sys.settrace",
}
_BLOCKED_MODULES = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "subprocess", "mmap"}
_PATH_EVENTS = {  # event -> indices of path arguments that are written
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chdir": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "os.chflags": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path) -> bool:
    if isinstance(path, int):  # an fd: it was opened through a checked path
        return True
    try:
        p = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return p == SCRATCH or p.startswith(SCRATCH + os.sep)


def _foreign_proc(path) -> bool:
    if isinstance(path, int):
        return False
    p = os.path.realpath(os.fsdecode(path))
    if not p.startswith("/proc/"):
        return False
    head = p.split("/")[2]
    return head.isdigit() and int(head) != os.getpid()


def _hook(event, args):
    if event in _BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_MODULES:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the scratch dir is not allowed")
        if _foreign_proc(path):
            raise PermissionError(f"sandbox: reading {path!r} (another process) is not allowed")
        return
    if event in ("os.kill", "os.killpg"):
        pid = args[0]
        if pid not in (0, os.getpid()) and event == "os.kill" and pid != -os.getpgrp():
            raise PermissionError("sandbox: signalling other processes is not allowed")
        return
    idx = _PATH_EVENTS.get(event)
    if idx is not None:
        for i in idx:
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"sandbox: {event} outside the scratch dir is not allowed")


class _Capped(io.TextIOBase):
    """A text sink that keeps the first CAP characters and counts the rest (bounded memory)."""

    def __init__(self):
        self.parts, self.kept, self.dropped = [], 0, 0

    def writable(self):
        return True

    def write(self, s):
        s = str(s)
        room = CAP - self.kept
        if room > 0:
            self.parts.append(s[:room])
            self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self):
        out = "".join(self.parts)
        if self.dropped:
            out += f"\n...[truncated {self.dropped} characters]"
        return out


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    stdin = os.fdopen(os.dup(0), "r")
    sink = os.open(os.path.join(SCRATCH, ".fd-output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    sys.addaudithook(_hook)
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    for line in stdin:
        try:
            code = json.loads(line)["code"]
        except (ValueError, KeyError, TypeError):
            reply = {"output": "sandbox: bad request", "error": True}
        else:
            out = _Capped()
            sys.stdout = sys.stderr = out
            error = False
            try:
                exec(compile(code, "<sandbox>", "exec"), scope)
            except BaseException as exc:  # noqa: BLE001 - user code: report it, keep the session
                error = True  # the traceback from the user's code down (not this loop's frame)
                out.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)))
            finally:
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
                if os.getpid() != PID:  # a forked child of user code must never answer
                    os._exit(0)
            reply = {"output": out.text(), "error": error}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
