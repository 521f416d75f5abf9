"""python_sandbox v2 behaviour: a working interpreter per session, faults that stay local, sessions that
cannot see each other, the warm pool, the fail-closed preflight, and the unisolated fallback.

The attack catalogue is in ``test_sandbox_redteam.py``; this module checks what a well-behaved (or
merely clumsy) policy meets: outputs that are not valid text, huge outputs, timeouts, and a drive of
the real controller that must survive all of them."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid

import pytest
from unirl_agentic.calculator import Calculator
from unirl_agentic.controller import AgenticRolloutController
from unirl_agentic.environment import ToolEnvironment, render_call
from unirl_agentic.options import AgenticOptions
from unirl_agentic.sandbox import (
    FIELD,
    PythonSandbox,
    SandboxOptions,
    isolation_problem,
    processes_with_token,
)
from unirl_agentic.tooling import ToolFailure

from unirl.api import ConfigError, RunConfig, SamplingParams, Tool, load_kernel
from unirl.preflight import preflight


@pytest.fixture(scope="module")
def box():
    tool = PythonSandbox(options=SandboxOptions(timeout_s=2.0, memory_mb=256, max_procs=8, pool_size=1))
    yield tool
    tool.close()


def _ended(box, sid):
    token = box._sessions[sid].token
    dirs = list(box._sessions[sid].cgroup.dirs) if box._sessions[sid].cgroup else []
    box.session_end(sid)
    assert processes_with_token(token) == [], "a sandbox process outlived its session"
    assert not any(os.path.exists(d) for d in dirs), "the session's cgroup was left behind"
    assert sid not in box.live_sessions()


def test_state_persists_within_a_session_and_output_is_truncated_by_the_parent(box):
    assert box.isolation["mode"] == "bubblewrap" and box.isolation["limits"] in ("cgroup-v1", "cgroup-v2")
    box.session_start("t")
    assert box.execute("t", {"code": "x = 6 * 7"}).content == ""
    assert box.execute("t", {"code": "print(x)"}).content == "42\n"
    out = box.execute("t", {"code": "print('y' * 100000)"}).content
    assert len(out) < 2100 and "truncated" in out
    bad = box.execute("t", {"code": "1/0"})
    assert bad.error and "ZeroDivisionError" in bad.content
    assert box.execute("t", {"nope": 1}).error
    assert box.execute("t", {"code": "open('/scratch/f', 'w').write('ok'); print(open('/scratch/f').read())"
                             }).content == "ok\n"
    _ended(box, "t")


def test_surrogates_binary_and_ten_megabytes_are_observations_and_the_session_lives_on(box):
    """Each used to raise (``print('\\ud800')`` aborted the whole drive) or flood the trainer."""
    box.session_start("u")
    lone = box.execute("u", {"code": "print('\\ud800')"})
    assert lone.content == "\\ud800\n" and not lone.error
    lone.content.encode("utf-8")  # encodable: a tokenizer will not raise on it
    raw = box.execute("u", {"code": "import os; os.write(1, b'\\xff\\xfe\\x00ok')"})
    assert raw.content == "\ufffd\ufffd\x00ok"
    big = box.execute("u", {"code": "import sys; sys.stdout.write('z' * 10_000_000); import os; os.write(2, b'e' * 10_000_000)"})
    assert "truncated" in big.content and len(big.content) <= box.options.max_output_chars + 100
    assert box.execute("u", {"code": "print('alive')"}).content == "alive\n"
    _ended(box, "u")


def test_a_ten_gigabyte_allocation_fails_inside_and_the_session_survives(box):
    box.session_start("m")
    res = box.execute("m", {"code": "b = bytearray(10 * 2**30)"})
    assert res.error and "MemoryError" in res.content
    assert box.execute("m", {"code": "print('alive')"}).content == "alive\n"
    _ended(box, "m")


def test_an_infinite_loop_is_killed_at_the_timeout_and_the_session_stays_dead(box):
    box.session_start("l")
    t0 = time.monotonic()
    with pytest.raises(ToolFailure, match="wall clock"):
        box.execute("l", {"code": "while True:\n    pass"})
    assert time.monotonic() - t0 < 4
    with pytest.raises(ToolFailure, match="killed earlier"):
        box.execute("l", {"code": "print(1)"})
    _ended(box, "l")


def test_four_concurrent_sessions_neither_see_nor_affect_each_other(box):
    """Each writes a secret everywhere it can (scratch, /tmp, /dev/shm, an abstract socket) and kills every
    pid it can see; the others' files, processes and globals must be untouched and invisible."""
    sids = [f"c{i}" for i in range(4)]
    for sid in sids:
        box.session_start(sid)
    secrets = {sid: uuid.uuid4().hex for sid in sids}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run(sid: str) -> None:
        try:
            mine = secrets[sid]
            barrier.wait()
            box.execute(sid, {"code": f"import socket\nSECRET = {mine!r}\n"
                                      "for d in ('/scratch', '/tmp', '/dev/shm'):\n"
                                      "    open(d + '/secret-' + SECRET, 'w').write(SECRET)\n"
                                      "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind('\\0unirl-shared')"})
            barrier.wait()
            seen = box.execute(sid, {"code": "import os, signal\nfound = []\n"
                                             "for d in ('/scratch', '/tmp', '/dev/shm'):\n"
                                             "    for n in os.listdir(d): found.append(open(d + '/' + n).read())\n"
                                             "for p in os.listdir('/proc'):\n"
                                             "    if p.isdigit() and int(p) > 2:\n"
                                             "        try: os.kill(int(p), signal.SIGKILL)\n"
                                             "        except OSError: pass\n"
                                             "print(sorted(set(found)), SECRET)"}).content
            assert seen == f"[{mine!r}] {mine}\n", (sid, seen)
            barrier.wait()
            again = box.execute(sid, {"code": "import os; print(len(os.listdir('/scratch')), SECRET)"}).content
            assert again == f"1 {mine}\n", (sid, again)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for sid in sids:
        _ended(box, sid)


def test_the_warm_pool_hands_out_fresh_sandboxes_and_close_kills_it():
    tool = PythonSandbox(options=SandboxOptions(pool_size=2))
    deadline = time.monotonic() + 20
    while len(tool._pool) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tool._pool) == 2
    pooled = [s.token for s in tool._pool]
    tool.session_start("a")
    assert tool._sessions["a"].token in pooled, "the session should come from the pool (no bwrap start)"
    assert tool.execute("a", {"code": "import os; print(os.listdir('/scratch'))"}).content == "[]\n"
    tool.close()
    assert all(processes_with_token(t) == [] for t in pooled)
    with pytest.raises(ToolFailure, match="closed"):
        tool.session_start("b")


def test_rlimit_mode_keeps_a_session_one_process_with_bounded_threads():
    """Without a cgroup, ``RLIMIT_AS`` bounds one process, so the session stays one: ``fork`` is refused
    (a second seccomp filter), threads run, and ``RLIMIT_NPROC`` set inside the session's user namespace
    bounds them without starving another session."""
    tool = PythonSandbox(options=SandboxOptions(limits="rlimit", max_procs=6, timeout_s=3.0))
    assert tool.isolation["limits"] == "rlimit" and tool.isolation["single_process"]
    try:
        tool.session_start("other")
        tool.session_start("bomb")
        forked = tool.execute("bomb", {"code": "import os\nos.fork()"})
        assert forked.error and "PermissionError" in forked.content, forked.content
        res = tool.execute("bomb", {"code": "import threading, time\nn = 0\ntry:\n    for _ in range(1000):\n"
                                            "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
                                            "        n += 1\nexcept RuntimeError as e:\n    print('refused after', n)"})
        assert "refused after" in res.content and int(res.content.split()[-1]) <= 10, res.content
        assert tool.execute("other", {"code": "import threading\nt = threading.Thread(target=print, args=('ok',))\n"
                                      "t.start(); t.join()"}).content == "ok\n"
    finally:
        tool.close()


def test_without_bubblewrap_preflight_and_the_tool_fail_closed_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap anywhere on PATH
    problem = isolation_problem(SandboxOptions())
    assert problem is not None
    field_, message, fix = problem
    assert field_ == f"{FIELD}.bwrap" and "bubblewrap is not available" in message
    assert "make install" in fix and "apt-get install -y bubblewrap" in fix and "allow_unisolated: true" in fix
    cfg = RunConfig(rollout={"environment": "tool_env", "tools": ["python_sandbox"]})
    got = {v.field: v for v in preflight(cfg, load_kernel()) if v.source == "unirl-agentic"}
    assert "apt-get install -y bubblewrap" in got[f"{FIELD}.bwrap"].fix
    with pytest.raises(ConfigError, match=r"bubblewrap is not available.*fix: install bubblewrap"):
        PythonSandbox(options=SandboxOptions())


def test_allow_unisolated_runs_the_old_mode_with_a_warning(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="unirl_agentic.sandbox"):
        tool = PythonSandbox(options=SandboxOptions(bwrap="/nonexistent/bwrap", allow_unisolated=True))
    assert "WITHOUT OS isolation" in caplog.text and tool.isolation["mode"] == "unisolated"
    try:
        tool.session_start("a")
        assert tool.execute("a", {"code": "print(6 * 7)"}).content == "42\n"
        guarded = tool.execute("a", {"code": "import socket; socket.create_connection(('127.0.0.1', 9))"})
        assert guarded.error and "not available here" in guarded.content  # the convenience guard's message
        outside = tool.execute("a", {"code": f"open({str(tmp_path / 'out.txt')!r}, 'w')"})
        assert outside.error and "outside the scratch dir" in outside.content  # the old layer, kept here
        assert not (tmp_path / "out.txt").exists()
        scratch = tool._sessions["a"].scratch
        tool.session_end("a")
        assert not os.path.exists(scratch)
    finally:
        tool.close()


class _Scripted(ToolEnvironment):
    """A stand-in *task*: the first turn of trajectory i runs CODES[i % len] in the real sandbox whatever
    the model wrote, the second answers. The controller, engine, tokenizer and sandbox are all real."""

    CODES = ["print('\\ud800')", "import os; os.write(1, b'\\xff\\xfe binary')", "print('w' * 10_000_000)",
             "print('fine')"]

    def step(self, sample, turn_text):
        i = int(sample.id.rpartition("/")[2])
        first = self._state[sample.id].turns == 0
        if first and i == 3:
            return super().step(sample, render_call("boom", {}))
        if first:
            return super().step(sample, render_call("python_sandbox", {"code": self.CODES[i % len(self.CODES)]}))
        return super().step(sample, "42")


class _Boom(Tool):
    name = "boom"

    def call(self, arguments):
        raise RuntimeError("tool bug")


def test_bad_outputs_and_a_tool_exception_never_abort_the_drive(engine, tok):
    """Sample 0-2 print a lone surrogate, binary and 10 MB: observations, and they finish scored. Sample 3's
    tool raises: only that trajectory fails, with the error in the sample and counted in the metrics."""
    from agentic_support import drawer

    sandbox = PythonSandbox(options=SandboxOptions(max_output_chars=64, pool_size=0))
    env = _Scripted(tools={"python_sandbox": sandbox, "boom": _Boom()}, tokenizer=tok,
                    options=AgenticOptions(max_turns=3))
    ctl = AgenticRolloutController(engine, env, tok, reward_fn=lambda text, s: 1.0,
                                   options=AgenticOptions(max_turns=3), base_seed=3)
    try:
        out = ctl.collect(drawer(tok), groups=1, n=4,
                          sampling=SamplingParams(max_new_tokens=4, max_response_tokens=512, temperature=1.0))
    finally:
        ctl.close()
        sandbox.close()
    by = {int(s.id.rpartition("/")[2]): s for s in out}
    for i in range(3):
        assert not by[i].failed and by[i].reward == 1.0, by[i].meta.get("error")
    texts = [by[i].response_text for i in range(3)]
    assert "\\ud800" in texts[0] and "\ufffd\ufffd binary" in texts[1] and "truncated" in texts[2]
    assert by[3].failed and math.isnan(by[3].reward) and "tool boom raised RuntimeError: tool bug" in by[3].meta["error"]
    assert ctl.last.tool_failures == 1 and ctl.last.metrics()["agentic/tool_failures"] == 1.0
    assert sandbox.live_sessions() == []


@pytest.mark.parametrize("expr", ["\ud800", "1+\ud800", "\udcff*2", "1\x00+2", "\x00", "1e308*10", "(-8)**0.5",
                                  "10**99*10.0**300", "2**64 % 0.0", "9**9**9", "(" * 100 + "1" + ")" * 99,
                                  "[1]*3", "__import__('os')", "'a'*3", "1 if 1 else 2", "", "1" * 150, "1e999",
                                  "10**64 / 1e-300"])
def test_the_calculator_answers_every_bad_input_with_a_tool_error(expr):
    """Never an exception (which used to become a NaN reward), never a non-finite number: a tool error."""
    res = Calculator().call({"expression": expr})
    assert res.error and res.content.startswith("calculator: "), (expr, res)
    res.content.encode("utf-8")  # the error text itself is safe to tokenize


def test_cgroup_v2_layout_is_written_where_v2_is_mounted(tmp_path, monkeypatch):
    """This kind of machine mounts v1, so the v2 branch runs against a stand-in hierarchy: limits land in
    ``memory.max`` / ``pids.max`` of a child of the trainer's own group, and the child is joined there."""
    from unirl_agentic import sandbox as sb
    from unirl_agentic import sandbox_cgroups

    monkeypatch.setattr(sandbox_cgroups, "_own_cgroup", lambda controller: "/trainer" if controller is None else None)
    base = tmp_path / "trainer"
    base.mkdir()
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    (base / "cgroup.subtree_control").write_text("memory pids")
    factory = sb.CgroupFactory(root=str(tmp_path))
    assert factory.kind == "cgroup-v2"
    cg = factory.create("s1", 256 << 20, 12)
    assert (base / "s1" / "memory.max").read_text() == str(256 << 20)
    assert (base / "s1" / "pids.max").read_text() == "12"
    assert cg.procs_files == [str(base / "s1" / "cgroup.procs")]


def test_session_uids_are_exclusive_host_wide_and_fall_back_where_unmapped(tmp_path, monkeypatch, caplog):
    """Each live session holds its uid by a flock (so another trainer on the host skips it); a range from
    /etc/subuid wins over the built-in one; where the range is not mapped (a rootless container), sessions
    share the account's uid, with a warning, instead of failing to start."""
    from unirl_agentic import sandbox as sb
    from unirl_agentic.sandbox_ids import SessionIds, mapped, subid_range

    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nnobody:300000:1000\n")
    assert subid_range("nobody", 65534, str(subuid)) == (300000, 1000)
    assert subid_range("bob", 1001, str(subuid)) is None
    uid_map = tmp_path / "uid_map"
    uid_map.write_text("         0     100000      65536\n")
    assert mapped(1000, 10, str(uid_map)) and not mapped(0x70000000, 65536, str(uid_map))
    ids = SessionIds(0x70000000, 2, lock_dir=str(tmp_path / "locks"))
    (a, fa), (b, _fb) = ids.acquire(), ids.acquire()  # (b stays held)
    assert a != b and {a, b} == {0x70000000, 0x70000001}
    with pytest.raises(OSError, match="no free sandbox uid"):
        ids.acquire()
    ids.release(fa)
    assert ids.acquire()[0] == a
    monkeypatch.setattr(sb, "mapped", lambda start, count: False)
    with caplog.at_level(logging.WARNING, logger="unirl_agentic.sandbox"):
        tool = PythonSandbox(options=SandboxOptions(pool_size=0))
    try:
        assert tool.isolation["uids"] == "shared: uid 65534" and "not mapped" in caplog.text
        tool.session_start("s")
        assert tool.execute("s", {"code": "print(6 * 7)"}).content == "42\n"
    finally:
        tool.close()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_an_infinite_or_nan_timeout_is_refused_at_config_time(value):
    """``timeout_s: .inf`` passed ``gt=0`` and meant no timeout at all: the options refuse non-finite numbers."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="timeout_s"):
        SandboxOptions(timeout_s=value)


def test_the_runtime_probe_binds_nothing_the_trainer_preloads(tmp_path, monkeypatch):
    """vLLM's CPU platform puts torch's libgomp in ``os.environ["LD_PRELOAD"]``, and ``ldd`` lists preloaded
    objects as dependencies: the sandbox then bound that file, and failed to start wherever the checkout was
    unreadable to the session's uid (a CI clone under a 0700 temp dir). The sandboxed interpreter runs without
    the preload, so the probe must not see it either."""
    import glob
    import shutil
    import sys

    import torch
    from unirl_agentic import sandbox_host

    gomp = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    assert gomp, "torch ships libgomp on this platform"
    lib = tmp_path / "preload" / "libgomp.so.1"
    lib.parent.mkdir()
    shutil.copy(gomp[0], lib)
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    monkeypatch.setattr(sandbox_host, "_runtime_cache", {})
    rt = sandbox_host._runtime(sys.executable)
    assert rt["files"], "the probe found the interpreter's shared libraries"
    assert not [f for f in rt["files"] if f.startswith(str(tmp_path))], rt["files"]
