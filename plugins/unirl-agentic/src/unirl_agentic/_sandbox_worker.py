"""The process inside a ``python_sandbox`` session (its source is passed with ``python -I -S -c``; the
trainer never imports it for its own use).

Everything in this process is in the hands of the model's code once the first call runs: the code can
rewrite this module's globals, the reply fd, the output buffer. So nothing here is a security
boundary. The boundary is outside (bubblewrap: namespaces, seccomp, cgroups; see ``sandbox.py``), and
the parent trusts nothing it reads from here: it reads replies with its own hard cap and framing, and
checks the sequence number and that nothing else was written.

Protocol, on pipes the parent owns (stdin in, stdout out; both moved to private fds before user code):

* request: ``>I`` length + UTF-8 JSON ``{"seq": n, "code": "..."}``;
* reply: ``MAGIC`` + ``>IIB`` (seq, length, error flag) + that many bytes of UTF-8 output. A hello
  frame (seq 0, empty) is sent once the interpreter is ready (the parent measures start-up with it).

Output: ``print`` goes to a capped text buffer; raw writes to fd 1/2 go to an anonymous file (memfd)
that is read back after the call, capped. Lone surrogates are escaped (``\\ud800``), and undecodable
bytes are left to the parent, which decodes with replacement.

The audit hook (PEP 578) is a *convenience*: it turns a few actions that the OS will refuse anyway
(spawning programs, the network) into clear ``PermissionError`` messages for the model. User code can
blind it (it shares this interpreter); it is documented as not a boundary. In the unisolated mode
(``allow_unisolated: true``, no OS sandbox) it also keeps the old checks (writes only under the scratch
dir, no ctypes, no signals to other processes): all that mode has, and known to be bypassable.
"""

import io
import json
import os
import struct
import sys
import traceback

MAGIC = b"UNIRLv2\n"
CONFIG = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
CAP = int(CONFIG.get("cap", 2000))
PID = os.getpid()

_REFUSED = {
    "subprocess.Popen": "starting programs", "os.system": "starting programs", "os.exec": "starting programs",
    "os.posix_spawn": "starting programs", "os.spawn": "starting programs", "pty.spawn": "starting programs",
    "socket.connect": "the network", "socket.bind": "the network", "socket.sendto": "the network",
    "socket.getaddrinfo": "the network", "socket.gethostbyname": "the network",
}


def _guard(event, args):
    what = _REFUSED.get(event)
    if what is not None:
        raise PermissionError(f"sandbox: {what} is not available here ({event})")
    if STRICT:
        _strict(event, args)


# The unisolated mode's extra checks (``allow_unisolated: true``: no OS sandbox, so the old audit-hook
# layer stays): writes only under the scratch dir, no native code, no signals to other processes.
# Known to be bypassable (Python code can undo audit hooks); never a boundary.
STRICT = bool(CONFIG.get("strict"))
SCRATCH = os.path.realpath(os.getcwd())
_BLOCKED_MODULES = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "subprocess", "mmap"}
_PATH_EVENTS = {  # event -> indices of path arguments that are written
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "shutil.rmtree": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "os.chflags": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path):
    if isinstance(path, int):
        return True
    try:
        p = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return p == SCRATCH or p.startswith(SCRATCH + os.sep)


def _strict(event, args):
    if event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "os.chroot", "os.setuid"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_MODULES:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the scratch dir is not allowed")
        return
    if event == "os.kill" and args[0] not in (0, os.getpid(), -os.getpgrp()):
        raise PermissionError("sandbox: signalling other processes is not allowed")
    for i in _PATH_EVENTS.get(event, ()):
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

    def flush(self):
        pass


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _send(fd, seq, output, error):
    data = output.encode("utf-8", "backslashreplace") if isinstance(output, str) else output
    frame = MAGIC + struct.pack(">IIB", seq, len(data), 1 if error else 0) + data
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view):]


def _fd_output(fd):
    """What user code wrote to fd 1/2 during the call (capped), then reset for the next call."""
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, min(size, 4 * CAP))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        return b"", 0
    return data, size


def _install_filter(program):
    """Load one more seccomp filter on this process (no_new_privs is set by bubblewrap)."""
    import ctypes

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    prog = Prog(len(program) // 8, program)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp filter not loaded")


def main():
    reply_fd = os.dup(1)
    request_fd = os.dup(0)
    for fd in (reply_fd, request_fd):
        os.set_inheritable(fd, False)
    try:
        sink = os.memfd_create("output", 0)
    except (AttributeError, OSError):  # no memfd: an unlinked file in the (private) temp dir
        import tempfile
        sink = os.dup(tempfile.TemporaryFile().fileno())
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.__stdout__ = sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.__stderr__ = sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    nproc = CONFIG.get("nproc")
    if nproc:  # inside the user namespace: counts this sandbox's tasks only (kernel >= 5.14)
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    pin = CONFIG.get("pin")
    if pin:  # the rlimit mode's second seccomp filter (see _seccomp.pinning): stacked, never removable
        _install_filter(bytes.fromhex(pin))
    if CONFIG.get("guard", True) or STRICT:
        sys.addaudithook(_guard)
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    _send(reply_fd, 0, "", False)  # hello: ready
    while True:
        head = _read_exact(request_fd, 4)
        if head is None:
            os._exit(0)  # the parent closed the channel: the session is over
        body = _read_exact(request_fd, struct.unpack(">I", head)[0])
        if body is None:
            os._exit(0)
        try:
            req = json.loads(body.decode("utf-8"))
            seq, code = int(req["seq"]), req["code"]
        except (ValueError, KeyError, TypeError):
            _send(reply_fd, 0xFFFFFFFF, "sandbox: bad request", True)
            continue
        out = _Capped()
        sys.stdout = sys.stderr = out
        error = False
        try:
            exec(compile(code, "<sandbox>", "exec"), scope)
        except BaseException as exc:  # noqa: BLE001 - user code: report it, keep the session
            error = True  # the traceback from the user's code down (not this loop's frame)
            try:
                out.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)))
            except BaseException:  # noqa: BLE001 - a hostile exception's __str__
                out.write(f"{type(exc).__name__} (unprintable)")
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            if os.getpid() != PID:  # a forked child of user code must never answer
                os._exit(0)
        try:
            sys.__stdout__.flush()
            sys.__stderr__.flush()
        except BaseException:  # noqa: BLE001
            pass
        raw, size = _fd_output(1)
        text = "".join(out.parts)
        data = text.encode("utf-8", "backslashreplace") + raw
        dropped = out.dropped + max(0, size - len(raw))
        if dropped:
            data += f"\n...[truncated {dropped} characters]".encode()
        _send(reply_fd, seq, data, error)


if __name__ == "__main__":
    main()
