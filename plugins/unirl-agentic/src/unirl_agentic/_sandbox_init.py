"""Pid 1 of a ``python_sandbox`` session (its source is passed with ``python -I -S -c``; bubblewrap runs it
with ``--as-pid-1``; the trainer never imports it for its own use).

Why our own init instead of bubblewrap's: bubblewrap's init made ``/proc/1/exe`` the host's ``bwrap``
binary (a host file outside the bound set), and a session could outlive a trainer killed with SIGKILL
while the warm pool was refilling: bubblewrap's child waits on an eventfd until bubblewrap has set up its
namespaces, so a bwrap killed in that window (``--die-with-parent``, or SIGPIPE on ``--info-fd``) left it
waiting for good. Neither is used any more: bubblewrap always finishes its setup, and this init:

* forks the worker (pid 2; ``argv[2]`` is its source) and reaps every orphan of the namespace;
* ends the session when the worker exits, or when the trainer is gone: it polls its copy of the request
  pipe (stdin) for POLLHUP, which the kernel raises once the trainer, the only writer, has exited,
  however it exited. When pid 1 exits the kernel kills every process of the namespace;
* is not dumpable (``/proc/1/mem`` is closed to the session's own code, which runs as the same uid) and
  leaves every signal at its default, so the code inside cannot signal it (the kernel drops signals
  without a handler sent to a namespace's init from inside).
"""

import ctypes
import json
import os
import select
import signal
import sys

PR_SET_DUMPABLE = 4
CONFIG = json.loads(sys.argv[1])


def _run_worker(source):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the worker's own /proc entries stay its own
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL if s == signal.SIGCHLD else signal.default_int_handler)
    sys.argv = [sys.argv[0], sys.argv[1]]
    import __main__
    __main__.__dict__.pop("_run_worker", None)
    exec(compile(source, "<string>", "exec"), __main__.__dict__)
    os._exit(0)


def _init():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    source = sys.argv[2]
    worker = os.fork()
    if worker == 0:
        os.close(wake_r)
        os.close(wake_w)
        _run_worker(source)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)  # the reply pipe is the worker's alone: its death must read as EOF in the trainer
    os.close(null)
    poller = select.poll()
    poller.register(0, 0)  # stdin (the request pipe), no events: POLLHUP/POLLERR only, never the data
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, ev in poller.poll():
            if fd == 0 and ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(1)  # the trainer is gone
            if fd == wake_r:
                os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(0)
            if pid == 0:
                break
            if pid == worker:
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


_init()
