"""The demo recipe end to end with ``rollout.engine: sglang``: the engine *launches* its server
(``rollout.options.launch``) as a subprocess, here the stand-in instead of ``sglang.launch_server``,
and every rollout, log-prob and weight sync goes over SGLang's HTTP API."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sglang_recipe_end_to_end(tmp_path):
    from unirl.api import load_config, load_kernel, train

    port = _free_port()
    overrides = [f"run.output_dir={tmp_path}", "trainer.progress=false", "trainer.steps=3",
                 "trainer.prompts_per_step=8", "trainer.eval_every=100", "data.arith.n_eval=8", "sft.steps=10",
                 "rollout.options.launch.module=sglang_standin", f"rollout.options.launch.ports=[{port}]",
                 f"rollout.options.launch.env={{PYTHONPATH: '{HERE}', OMP_NUM_THREADS: '1'}}"]
    config = load_config(ROOT / "recipes" / "arith-tiny-sglang.yaml", overrides)
    assert config.rollout.engine == "sglang" and config.weight_sync.name == "sglang"
    result = train(config, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 3
    # every step's tokens came from the version the ledger committed before that step's rollout
    assert [h["version"] for h in steps] == list(range(2, 5))
    # the server's sampled-token log-probs agree with the actor's replay: it serves the synced weights
    assert max(h["rollout_replay_max_diff"] for h in steps) < 1e-5, [h["rollout_replay_max_diff"] for h in steps]
    assert not math.isnan(result.eval_after)
    run_dir = config.run_dir
    assert (run_dir / f"sglang_server_{port}.log").is_file()
    exported = sorted(p.name for p in (run_dir / "sglang_weights").iterdir())
    assert exported == ["v000003", "v000004"]  # keep_versions: 2, the served one among them
    with pytest.raises(OSError):  # the launched server was stopped with the run
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
