"""Soak: a run SIGKILLed at seeded random points (inside steps, saves and prunes), resumed each time with
run.resume=true, ends bit-identical to an uninterrupted run: weights, optimizer state, metrics.jsonl row
for row, and retention obeyed.

The kills are paced by training progress, not wall time: each life installs the drill
(``checkpoint_drill.py``) as its checkpoint phase callback, gets ``UNIRL_TEST_HOLD_AT``, blocks at exactly that point (``train:step_N:update<u>``
before a backward, ``save:step_N:<file>``, ``commit:step_N``, ``swap:step_N``, ``prune:step_N``), writes the
hold file, and the test SIGKILLs it there. So the same kills land at the same points on an idle fast
machine and on a loaded slow one. The ``train:`` phase comes from this module, registered as an
in-process plugin (``unirl_before_backward``) in both the uninterrupted run and every life.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unirl.actor import checkpoint as ckpt
from unirl.config import load_config
from unirl.kernel import hookimpl, load_kernel
from unirl.trainer.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: the drill beside this file
import checkpoint_drill as drill  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "arith-tiny.yaml"
STEPS, KEEP_LAST, KEEP_EVERY, UPDATES = 20, 2, 4, 4  # the recipe runs 4 updates per step
ARGS = [
    "sft.steps=0", f"trainer.steps={STEPS}", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.progress=false", "trainer.plot=false", "trainer.save_every=1", f"trainer.keep_last={KEEP_LAST}",
    f"trainer.keep_every={KEEP_EVERY}", "data.arith.n_train=64", "data.arith.n_eval=8", "rollout.n=4",
    "rollout.max_new_tokens=4", "model.build={hidden_size: 64, intermediate_size: 128}",
    "reward.name=soak_distinct",
]
FILES = [ckpt.MODEL_FILE, ckpt.OPTIM_FILE, ckpt.RNG_FILE, ckpt.EXTRA_FILE]
#: The life server: imports torch and the trainer once, then forks one life per request (a JSON line:
#: env, args, log) and answers the child's pid, then its wait status. Forking saves each life the imports
#: (seconds of CPU each on a 2-core machine); it is safe because nothing has run yet (one thread).
ZYGOTE = """
import json, os, sys, traceback
sys.path.insert(0, sys.argv[1])
import checkpoint_drill
import test_soak
checkpoint_drill.install()
from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import train
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.clear()
            os.environ.update(req["env"])
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            train(load_config(req["recipe"], req["args"]), load_kernel(extra=[("soak_probe", test_soak)]))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
HOOK_ENVS = (drill.SAVE_SLEEP_ENV, drill.HOLD_AT_ENV, drill.HOLD_FILE_ENV)


def distinct_chars(completion: str, sample) -> float:
    """A reward that varies within every group of a random policy, so every step has non-zero advantages
    and gradients (``exact_int`` scores 0 everywhere for this untrained model: the weights would never
    move, and comparing them would prove nothing)."""
    return len(set(completion)) / 8.0


@hookimpl
def unirl_rewards():
    return {"soak_distinct": distinct_chars}


@hookimpl
def unirl_before_backward(ctx, config) -> None:
    """Mid-step phase: before each backward of each update (the drill hook holds here when asked)."""
    ckpt.checkpoint_phase(f"train:step_{ctx.rl_step + 1:06d}:update{ctx.update}")


def step_name(n: int) -> str:
    return f"step_{n:06d}"


def latest_step(root: Path) -> int:
    try:
        return int((root / "latest").read_text().strip().removeprefix("step_"))
    except FileNotFoundError:
        return 0


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("mem/"))} for r in rs]


def assert_same(a, b, path="optim") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def kill_plan(rng: random.Random) -> list[str]:
    """Nine kills: two mid-step (one before a backward, one after the row is logged but before the save
    starts), save-file, commit (renamed, `latest` not moved) and swap (re-save of that step, old copy moved
    aside) mid-save, two mid-prune, and one more at random; order seeded."""
    kinds = ["train", "logged", "save", "save", "commit", "prune", "prune", rng.choice(["train", "save", "prune"])]
    rng.shuffle(kinds)
    i = kinds.index("commit")
    return kinds[:i + 1] + ["swap"] + kinds[i + 1:]  # a swap needs the whole step_N a commit kill leaves


def aim(kind: str, last: int, rng: random.Random) -> tuple[str, int]:
    """The hold pattern for a life resuming at step ``last`` and the step it aims at."""
    n = last + rng.randint(1, 2)
    if kind == "train":
        return f"train:{step_name(n)}:update{rng.randrange(UPDATES)}", n
    if kind == "logged":
        return f"save:{step_name(n)}:begin", n
    if kind == "save":
        return f"save:{step_name(n)}:{rng.choice(FILES)}", n
    if kind == "commit":
        return f"commit:{step_name(n)}", n
    if kind == "swap":  # the previous life left a whole step_{last+1} that `latest` does not name
        return f"swap:{step_name(last + 1)}", last + 1
    # prune: the oldest checkpoint the save of step m+2 deletes (m is in the window, no keep_every step)
    m = last if last >= 1 and last % KEEP_EVERY else last + 1
    return f"prune:{step_name(m)}", m + 2


def check_left(kind: str, root: Path, run: Path, n: int) -> str:
    """Assert what the kill left on disk; return where it landed."""
    name = step_name(n)
    if kind in ("train", "logged"):
        assert not list(root.glob("*.tmp-*")) and not list(root.glob(".prune-*"))
        logged = [r["step"] for r in rows(run)] if (run / "metrics.jsonl").exists() else []
        if kind == "logged":  # the row of a step that never got its checkpoint: resume must cut it
            assert logged[-1] == n, logged[-3:]
        return "mid-step"
    if kind == "save":
        assert list(root.glob(f"{name}.tmp-*")) and latest_step(root) == n - 1
    elif kind == "commit":
        assert (root / name / ckpt.META_FILE).is_file() and latest_step(root) == n - 1
    elif kind == "swap":
        assert list(root.glob(f"{name}.old-*")) and not (root / name).exists()
    return "mid-save"


class Zygote:
    """The client of :data:`ZYGOTE`: ``fork`` starts a life and returns its pid, ``status`` its exit code
    once it ended (None while it runs, after ``timeout`` seconds)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.buf = b""

    def __enter__(self) -> Zygote:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(HERE)], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        return self

    def __exit__(self, *exc) -> None:
        if self.pid is not None and self.status(timeout=0) is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    pid: int | None = None

    def _line(self, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if not select.select([self.proc.stdout], [], [], max(0.0, left))[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, "the life server died"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def fork(self, env: dict[str, str], args: list[str], log: Path) -> int:
        req = {"env": env, "recipe": str(RECIPE), "args": args, "log": str(log)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        line = self._line(120)
        assert line is not None, "the life server did not fork"
        self.pid = int(line)
        return self.pid

    def status(self, timeout: float) -> int | None:
        line = self._line(timeout)
        if line is None:
            return None
        self.pid = None
        return int(line)


@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~1 min idle; a 2-core machine shared with other jobs can be 10x slower
def test_soak_sigkill_anywhere_then_resume(tmp_path):
    t_start = time.perf_counter()
    rng = random.Random(1234)
    env = {k: v for k, v in os.environ.items() if k not in HOOK_ENVS}
    straight = train(load_config(RECIPE, [*ARGS, f"run.output_dir={tmp_path}", "run.name=straight"]),
                     load_kernel(extra=[("soak_probe", sys.modules[__name__])]))
    assert straight.steps_done == STEPS
    assert all(h["grad_norm"] > 0 for h in straight.history if h["step"] > 0)  # the weights move
    t_straight = time.perf_counter() - t_start

    run = tmp_path / "soak"
    root = run / "checkpoints"
    args = [*ARGS, f"run.output_dir={tmp_path}", "run.name=soak", "run.resume=auto"]
    landed = {"mid-step": 0, "mid-save": 0, "mid-prune": 0}
    trail = []
    with Zygote(env) as zygote:
        for life, kind in enumerate([*kill_plan(rng), "end"]):
            last = latest_step(root)
            hold = tmp_path / f"hold-{life}"
            life_env = dict(env)
            if kind != "end":
                pattern, n = aim(kind, last, rng)
                assert n <= STEPS, (kind, n)
                life_env |= {drill.HOLD_AT_ENV: pattern, drill.HOLD_FILE_ENV: str(hold)}
            log = tmp_path / f"life-{life}.log"
            pid = zygote.fork(life_env, args, log)
            if kind == "end":
                assert zygote.status(timeout=300) == 0, log.read_text()[-3000:]
                break
            deadline = time.monotonic() + 600  # a hang guard: generous for a loaded machine
            while not hold.exists():
                assert zygote.status(timeout=0.01) is None, f"life {life} ended before {pattern}: " \
                    + log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"life {life} never reached {pattern} (hung?)"
            label, held = hold.read_text().split()
            assert label == pattern and int(held) == pid
            os.kill(pid, signal.SIGKILL)
            assert zygote.status(timeout=30) == -signal.SIGKILL
            if kind == "prune":
                assert list(root.glob(".prune-*")) and latest_step(root) == n
                where = "mid-prune"
            else:
                where = check_left(kind, root, run, n)
            landed[where] += 1
            trail.append(f"{pattern} ({where}, resumed from {last})")
    kills = sum(landed.values())
    print(f"\nsoak: {kills} SIGKILLs: {landed}; uninterrupted run {t_straight:.0f}s, all "
          f"{time.perf_counter() - t_start:.0f}s\n  " + "\n  ".join(trail))
    assert kills >= 8 and landed["mid-save"] >= 2 and landed["mid-prune"] >= 1 and landed["mid-step"] >= 2

    final = step_name(STEPS)
    a, b = tmp_path / "straight" / "checkpoints" / final, root / final
    wa, wb = load_file(a / ckpt.MODEL_FILE), load_file(b / ckpt.MODEL_FILE)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "final weights"
    load = lambda p: torch.load(p / ckpt.OPTIM_FILE, map_location="cpu", weights_only=False)  # noqa: E731
    assert_same(load(a), load(b))
    assert untimed(rows(run)) == untimed(rows(tmp_path / "straight")), "metrics.jsonl row for row"
    assert [r["step"] for r in rows(run)] == list(range(STEPS + 1))

    want = ckpt.retained_steps(range(1, STEPS + 1), keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
    assert sorted(p.name for p in root.iterdir()) == ["latest", *[step_name(s) for s in sorted(want)]]
    assert latest_step(root) == STEPS
