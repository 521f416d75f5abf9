"""`unirl export` and `unirl eval`: an RL result leaves the run as a plain HF model, and is scored.

The oracle for the export is an independent process that imports only transformers (no unirl): its
teacher-forced log-probs of the same tokens must equal the trained actor's replay within 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unirl.config import load_config
from unirl.kernel import load_kernel
from unirl.trainer.loop import build_components, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "sft.steps=4", "sft.batch_size=8", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0",
    "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "data.arith.n_train=32",
    "data.arith.n_eval=6", "rollout.n=2", "rollout.max_new_tokens=4",
    "model.build={hidden_size: 64, intermediate_size: 128}", "trainer.save_every=1",
]

PLAIN_HF = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM
    assert not any(m == "unirl" or m.startswith("unirl.") for m in sys.modules)
    path, seqs = sys.argv[1], json.loads(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt, response in seqs:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        out.append(logp[pos, torch.tensor(response)].tolist())
    assert not any(m == "unirl" or m.startswith("unirl.") for m in sys.modules)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    config = load_config(ROOT / "recipes" / "arith-tiny.yaml", [*SMALL, f"run.output_dir={tmp}", "run.name=r"])
    train(config, load_kernel())
    return config.run_dir


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_export_loads_in_plain_transformers_with_the_actors_logprobs(trained_run, tmp_path):
    out = cli("export", str(trained_run), "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    hf = tmp_path / "hf"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["use_cache"] is True and cfg["tie_word_embeddings"] is True
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] is not None
    assert (hf / "tokenizer.json").is_file()

    # the actor restored from the same checkpoint replays some sequences
    config = load_config(str(trained_run / "config.yaml"), ["trainer.progress=false"])
    c = build_components(config, load_kernel(), rollouts=False)
    try:
        c.actor.load(str(trained_run / "checkpoints"))
        from unirl.samples import Sample

        tok = c.tokenizer
        seqs = [(tok.encode(f"Q: {a}+{b}=? A:", add_special_tokens=False), tok.encode(f" {a + b} ok", add_special_tokens=False))
                for a, b in [(3, 4), (12, 9), (7, 7)]]
        samples = [Sample(id=f"p{i}/0", prompt_ids=p, response_ids=r, loss_mask=[1] * len(r)) for i, (p, r) in enumerate(seqs)]
        replay = c.actor.logprobs(samples)
    finally:
        c.close()
    plain = subprocess.run([sys.executable, "-c", PLAIN_HF, str(hf), json.dumps(seqs)],
                           capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert plain.returncode == 0, plain.stderr
    for ref, got in zip(replay, json.loads(plain.stdout), strict=True):
        assert torch.allclose(ref, torch.tensor(got), atol=1e-5), (ref, got)


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_export_of_a_named_step_and_errors(trained_run, tmp_path):
    out = cli("export", str(trained_run), "--step", "1", "--out", str(tmp_path / "s1"))
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "s1" / "model.safetensors")
    ckpt = load_file(trained_run / "checkpoints" / "step_000001" / "model.safetensors")
    assert "lm_head.weight" not in exported  # tied: written once, as save_pretrained does
    if "model.embed_tokens.weight" not in ckpt:  # the checkpoint keeps the tied tensor as the head
        ckpt["model.embed_tokens.weight"] = ckpt.pop("lm_head.weight")
    assert exported.keys() <= ckpt.keys() and all(torch.equal(exported[k], ckpt[k]) for k in exported)

    missing = cli("export", str(trained_run), "--step", "7")
    assert missing.returncode == 2 and "--step 7" in missing.stderr and "kept steps: 1, 2" in missing.stderr
    assert "Traceback" not in missing.stderr
    not_run = cli("export", str(tmp_path))
    assert not_run.returncode == 2 and "not a run directory" in not_run.stderr


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_eval_on_an_export_writes_avg_and_pass_at_k(trained_run, tmp_path):
    assert cli("export", str(trained_run), "--out", str(tmp_path / "hf")).returncode == 0
    per_prompt = tmp_path / "ev.jsonl"
    out = cli("eval", str(ROOT / "recipes" / "arith-tiny.yaml"), f"model.path={tmp_path / 'hf'}", "--k", "3",
              "--out", str(per_prompt), "data.arith.n_eval=5", "rollout.max_new_tokens=4", "trainer.progress=false",
              f"run.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in per_prompt.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r["completions"]) == 3 for r in rows)
    # the summary line is the per-prompt file, aggregated (an independent recomputation)
    avg = sum(x for r in rows for x in r["rewards"]) / 15
    passed = sum(r["pass"] for r in rows) / 5
    assert f"avg@3 {avg:.3f}" in out.stdout and f"pass@3 {passed:.3f}" in out.stdout
    assert all(r["pass"] == any(x >= 1.0 for x in r["rewards"]) for r in rows)
