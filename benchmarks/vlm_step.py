"""Seconds per GRPO step of the vision-language demo (``recipes/vlm-tiny.yaml``: tiny Qwen2.5-VL,
embedded engine and actor) and the vision tower's share of it (issue 71).

The tower's share is measured in the same run as the step: a global forward hook times every forward
of transformers' Qwen2.5-VL vision tower (the engine's prefill and the actor's replay and training
forward; with the tower frozen nothing flows back through it), and the printed ratio is tower seconds
over step seconds, so the figure does not depend on the machine's speed. ``--trained-tower`` runs the
same steps without ``actor.freeze: [vision]`` (the tower then also takes a backward, not timed here).
The data comes from ``scripts/make_vlm_tiny_data.py`` (written when missing).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout_s", "replay_s", "train_s", "sync_s")


class TowerClock:
    """Wall seconds inside the vision tower's forwards, per trainer step (global module hooks)."""

    def __init__(self) -> None:
        import torch
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        self.kind = Qwen2_5_VisionTransformerPretrainedModel
        self.total = 0.0
        self.calls = 0
        self._t0: float | None = None
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
                         torch.nn.modules.module.register_module_forward_hook(self._post)]

    def _pre(self, module, args):  # noqa: ANN001 - torch hook signature
        if isinstance(module, self.kind):
            self._t0 = time.perf_counter()

    def _post(self, module, args, out):  # noqa: ANN001 - torch hook signature
        if isinstance(module, self.kind) and self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self.calls += 1
            self._t0 = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trained-tower", action="store_true", help="actor.freeze: [] (the tower trains too)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not (ROOT / ".cache" / "vlm-tiny" / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_vlm_tiny_data.py")], check=True, cwd=ROOT)
    from unirl.api import hookimpl, load_kernel
    from unirl.config import load_config
    from unirl.trainer.loop import train

    clock = TowerClock()
    per_step: list[float] = []

    class StepMark:
        """Reads the tower clock at each step's end (the trainer's step hook)."""

        last = 0.0

        @hookimpl
        def unirl_on_step_end(self, step, metrics, config):  # noqa: ANN001 - hook signature
            per_step.append(clock.total - StepMark.last)
            StepMark.last = clock.total

    with tempfile.TemporaryDirectory() as out:
        config = load_config(str(ROOT / "recipes" / "vlm-tiny.yaml"), [
            f"run.output_dir={out}", f"trainer.steps={args.steps}", "sft.steps=0", "trainer.eval_every=0",
            "trainer.plot=false", "trainer.progress=false",
            *(["actor.freeze=[]"] if args.trained_tower else []), *args.overrides])
        result = train(config, load_kernel(extra=[("vlm_step_mark", StepMark())]))
    clock.close()
    steps = [h for h in result.history if h["step"] > 1]  # step 1 warms caches
    tower = per_step[1:len(steps) + 1]
    total = statistics.mean(sum(h[p] for p in PHASES) for h in steps)
    print(f"{'phase':<12}{'s/step':>10}{'share':>10}")
    for p in PHASES:
        mean = statistics.mean(h[p] for h in steps)
        print(f"{p[:-2]:<12}{mean:>10.3f}{mean / total:>10.1%}")
    print(f"{'total':<12}{total:>10.3f}{1:>10.1%}")
    t = statistics.mean(tower) if tower else float("nan")
    print(f"vision tower forward {t:.3f} s/step = {t / total:.1%} of the step "
          f"({clock.calls} tower forwards in {len(per_step)} steps; tower {'trained' if args.trained_tower else 'frozen'})")


if __name__ == "__main__":
    main()
