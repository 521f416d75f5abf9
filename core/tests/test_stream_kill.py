"""kill -9 mid-stream, then resume (issue 68): a stream run in a child process is killed (SIGKILL, no
handler runs) while launches are in flight two steps after its checkpoint; the resumed run continues from
that checkpoint. The surviving lineage (the killed run's steps up to the checkpoint, then the resumed
run's) trains every group whole and once, and every group the checkpoint stored is trained after the
resume, evicted (counted), or still buffered at the end: none lost."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("unirl_stream_rollout_tests", Path(__file__).with_name("test_stream_rollout.py"))
_stream = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_stream)
group_of, run_stream = _stream.group_of, _stream.run_stream

CHILD = """
import json, sys
from pathlib import Path
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.trainer.loop import train

recipe, overrides, log = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])

class Log:
    @hookimpl
    def unirl_on_rollout(self, phase, step, samples):
        if phase == "train":  # one line per trained sample, flushed: what the parent reads after the kill
            with open(log, "a") as f:
                f.write("".join(f"{step}\\t{s.id.rsplit('/', 1)[0]}\\n" for s in samples))

kernel = load_kernel()
kernel.register(Log(), entry_point="log", dist="test-log", version="0")
train(load_config(recipe, overrides), kernel)
"""


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_kill_9_mid_stream_then_resume_trains_no_group_twice_and_loses_none(tmp_path):
    # run_stream's run (test_stream_rollout.py), 40 steps, a checkpoint every 2
    overrides = [*_stream._async.SMALL, f"run.output_dir={tmp_path}", "run.name=k", "rollout.mode=stream",
                 "sft.steps=0", "trainer.steps=40", "trainer.save_every=2"]
    log = tmp_path / "trained.tsv"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(_stream.ROOT / "recipes" / "arith-tiny.yaml"),
                              json.dumps(overrides), str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while not (log.exists() and any(line.startswith("3\t") for line in log.read_text().splitlines())):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never reached step 3"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # step 3 is training; launches run on the engine
    finally:
        child.kill()
        child.wait(30)
    saved = tmp_path / "k" / "checkpoints"
    assert (saved / "latest").read_text().strip() == "step_000002"
    stored = torch.load(saved / "step_000002" / "extra.pt", weights_only=False)["trainer"]["controller"]["stream"]
    kept = {group_of(x[0]) for _, x, _ in stored["buffer"]}
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    before = Counter(g for step, g in rows if int(step) < 2)  # the surviving part of the killed run
    resumed, spy = run_stream(tmp_path, "k", "trainer.save_every=2", "trainer.steps=5", "run.resume=true")
    assert sorted(spy.steps) == [2, 3, 4]
    after = Counter(group_of(s) for ss in spy.steps.values() for s in ss)
    lineage = before + after
    assert len(before) == 8 and set(lineage.values()) == {4}  # whole groups, each trained once
    assert not kept & before.keys()
    end = resumed.history[-1]
    untrained = kept - after.keys()  # stored but not trained after the resume: evicted or still buffered
    assert len(untrained) <= end["stream/evicted_total"] - stored["evicted_total"] + end["stream/buffer_depth"]
