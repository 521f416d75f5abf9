"""python_sandbox security: each attack is contained, the host is unharmed, and the call is a tool error
(an error observation) or a ToolFailure (a killed call: reward NaN). Every test ends the session and checks
that no process of it survives and the scratch dir is gone."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from unirl_agentic.sandbox import (
    PythonSandbox,
    SandboxOptions,
    namespaces_available,
    processes_with_token,
    user_task_count,
)
from unirl_agentic.tooling import ToolFailure

MODES = [pytest.param(True, id="pid-namespace"), pytest.param(False, id="no-namespace")]


@pytest.fixture(params=MODES)
def box(request):
    probe = PythonSandbox(options=SandboxOptions(namespaces=False))
    if request.param and not namespaces_available(probe.uid, probe.gid):
        pytest.fail("unprivileged user namespaces are not available on this machine (unshare failed)")
    tool = PythonSandbox(options=SandboxOptions(timeout_s=1.5, cpu_s=5, memory_mb=256, max_procs=8,
                                                namespaces=request.param))
    yield tool
    tool.reclaim()


def _open(box, sid="t"):
    box.session_start(sid)
    s = box._sessions[sid]
    return s.token, s.scratch


def _contained(box, token, scratch, sid="t"):
    box.session_end(sid)
    deadline = time.monotonic() + 5
    while processes_with_token(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_token(token) == [], "a sandbox process outlived its session"
    assert not Path(scratch).exists(), "the scratch dir was not removed"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    assert box.live_sessions() == []


def test_state_persists_within_a_session_and_output_is_truncated(box):
    token, scratch = _open(box)
    assert box.execute("t", {"code": "x = 6 * 7"}).content == ""
    assert box.execute("t", {"code": "print(x)"}).content == "42\n"
    out = box.execute("t", {"code": "print('y' * 100000)"}).content
    assert len(out) < 2100 and "truncated" in out
    bad = box.execute("t", {"code": "1/0"})
    assert bad.error and "ZeroDivisionError" in bad.content
    assert box.execute("t", {"nope": 1}).error
    _contained(box, token, scratch)


def test_infinite_loop_is_killed_at_the_wall_clock_timeout(box):
    token, scratch = _open(box)
    t0 = time.monotonic()
    with pytest.raises(ToolFailure, match="wall clock"):
        box.execute("t", {"code": "while True:\n    pass"})
    assert time.monotonic() - t0 < 5
    with pytest.raises(ToolFailure, match="killed earlier"):
        box.execute("t", {"code": "print(1)"})
    _contained(box, token, scratch)


def test_fork_bomb_is_bounded_and_reaped(box):
    token, scratch = _open(box)
    before = user_task_count(box.uid)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], user_task_count(box.uid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        res = box.execute("t", {"code": "import os\nfor _ in range(10000):\n    os.fork()"})
        assert res.error and "BlockingIOError" in res.content  # fork refused by RLIMIT_NPROC
    except ToolFailure:
        pass  # or the forking children kept the session busy past the timeout: killed
    finally:
        stop.set()
        watcher.join()
    assert peak[0] - before <= 8 + 2  # max_procs above the account's count at session start
    _contained(box, token, scratch)


def test_ten_gigabyte_allocation_fails_inside_the_sandbox(box):
    token, scratch = _open(box)
    res = box.execute("t", {"code": "b = bytearray(10 * 2**30)"})
    assert res.error and "MemoryError" in res.content
    assert box.execute("t", {"code": "print('alive')"}).content == "alive\n"  # the session survives
    _contained(box, token, scratch)


def test_writing_outside_the_scratch_dir_is_refused(box, tmp_path):
    target = tmp_path / "owned.txt"
    token, scratch = _open(box)
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os; os.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))",
                 f"import os; os.mkdir({str(tmp_path / 'd')!r})",
                 "import pathlib; pathlib.Path('../escape.txt').write_text('x')",
                 "import os; os.system('touch /tmp/unirl-sandbox-escape')",
                 "import subprocess"):
        res = box.execute("t", {"code": code})
        assert res.error and "PermissionError" in res.content, code
    assert not target.exists() and not (tmp_path / "d").exists()
    assert not Path(scratch).parent.joinpath("escape.txt").exists()
    assert box.execute("t", {"code": "open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())"
                             }).content == "ok\n"
    _contained(box, token, scratch)


def test_the_parents_environment_is_not_visible(box, monkeypatch):
    monkeypatch.setenv("UNIRL_TEST_SECRET", "hunter2")
    token, scratch = _open(box)
    res = box.execute("t", {"code": "import os; print(sorted(os.environ)); print(os.environ.get('UNIRL_TEST_SECRET'))"})
    assert "hunter2" not in res.content and "UNIRL_TEST_SECRET" not in res.content
    res = box.execute("t", {"code": f"print(open('/proc/{os.getpid()}/environ', 'rb').read())"})
    assert res.error and "hunter2" not in res.content
    _contained(box, token, scratch)


def test_a_child_that_tries_to_outlive_the_session_is_killed(box):
    token, scratch = _open(box)
    code = ("import os, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.setsid()\n"  # leaves the process group: only the namespace or the sweep catches it
            "    if os.fork() == 0:\n"
            "        time.sleep(600)\n"
            "    os._exit(0)\n"
            "print('spawned')")
    assert box.execute("t", {"code": code}).content == "spawned\n"
    time.sleep(0.2)
    assert processes_with_token(token), "the orphan should be alive before the session ends"
    _contained(box, token, scratch)


def test_sessions_of_dead_trajectories_are_reclaimed(box):
    for sid in ("a", "b"):
        box.session_start(sid)
    tokens = [box._sessions[s].token for s in ("a", "b")]
    assert sorted(box.reclaim(keep={"a"})) == ["b"]
    assert box.live_sessions() == ["a"]
    assert box.reclaim() == ["a"]
    assert all(processes_with_token(t) == [] for t in tokens)
