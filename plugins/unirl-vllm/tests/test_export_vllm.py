"""`unirl export` output loads in plain vLLM: a process that imports vllm and not unirl serves it, and
its teacher-forced (prompt) log-probs equal the trained actor's replay within 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLAIN_VLLM = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    path, seqs = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p + r) for p, r in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    res = []
    for (p, r), o in zip(seqs, outs):
        ids = p + r
        res.append([o.prompt_logprobs[i][ids[i]].logprob for i in range(len(p), len(ids))])
    assert not any(m == "unirl" or m.startswith(("unirl.", "unirl_")) for m in sys.modules), "unirl was imported"
    print("RESULT " + json.dumps(res))
""")


@pytest.mark.slow
def test_exported_run_loads_in_plain_vllm(require_vllm, tiny_model_dir, tmp_path):
    import torch

    from unirl.api import Sample, load_kernel
    from unirl.config import dump_config, load_config
    from unirl.trainer.components import build_components

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.name=run", "trainer.progress=false"]
    config = load_config(None, overrides)
    (run_dir / "config.yaml").write_text(dump_config(config))
    c = build_components(config, load_kernel(), rollouts=False)
    try:
        tok = c.tokenizer
        prompts = [tok.encode(f"Q: {a}+{b}=? A:", add_special_tokens=False) for a, b in [(3, 4), (12, 9)]]
        sft = [Sample(id=f"p{i}/0", prompt_ids=p, response_ids=tok.encode(" 7", add_special_tokens=False),
                      loss_mask=[1, 1], status="ok") for i, p in enumerate(prompts)]
        c.actor.sft_step(sft)  # the export must carry trained weights, not the initial ones
        c.actor.save(str(run_dir / "checkpoints" / "step_000001"), extra={"step": 1})
        seqs = [(p, tok.encode(" 11 and 21", add_special_tokens=False)) for p in prompts]
        replay = c.actor.logprobs([Sample(id=f"q{i}/0", prompt_ids=p, response_ids=r, loss_mask=[1] * len(r))
                                   for i, (p, r) in enumerate(seqs)])
    finally:
        c.close()

    out = subprocess.run([sys.executable, "-m", "unirl.cli", "export", str(run_dir), "--out", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "none"}
    plain = subprocess.run([sys.executable, "-c", PLAIN_VLLM, str(tmp_path / "hf"), json.dumps(seqs)],
                           capture_output=True, text=True, timeout=900, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    got = json.loads(next(line for line in plain.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for ref, theirs in zip(replay, got, strict=True):
        assert torch.allclose(ref, torch.tensor(theirs), atol=1e-5), (ref, theirs)


VLM_VLLM = textwrap.dedent("""
    import json, sys
    from unirl_vllm.multimodal import install_processor_shim
    install_processor_shim()  # vLLM's Qwen2-VL module imports a torchvision-only module; torchvision cannot be installed here
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    path, image, prompt, text = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              limit_mm_per_prompt={"image": 1, "video": 0}, max_num_batched_tokens=4096)
    img = Image.open(image).convert("RGB")
    outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": [img]}},
                         TokensPrompt(prompt_token_ids=text[0] + text[1])],
                        SamplingParams(max_tokens=4, prompt_logprobs=0, temperature=0.0, ignore_eos=True))
    ids = text[0] + text[1]
    lp = [outs[1].prompt_logprobs[i][ids[i]].logprob for i in range(len(text[0]), len(ids))]
    print("RESULT " + json.dumps({"generated": list(outs[0].outputs[0].token_ids), "text": lp}))
""")


@pytest.mark.slow
def test_exported_vlm_run_loads_in_vllm_and_generates_from_an_image(require_vllm, tmp_path):
    """A vision-language export (model, tokenizer, chat template, preprocessor_config.json) loads in vLLM by
    its directory alone and generates from an image; its text-row prompt log-probs equal the trained
    actor's replay (1e-5). Image rows are not held to that: their vLLM gap is open (docs/vision-language.md)."""
    import torch
    from PIL import Image

    from unirl.api import PromptImages, Sample, load_kernel
    from unirl.config import dump_config, load_config
    from unirl.multimodal import attach_images
    from unirl.trainer.components import build_components

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(None, ["model.adapter=qwen2_5_vl", f"run.output_dir={tmp_path}", "run.name=run",
                                "trainer.progress=false"])
    (run_dir / "config.yaml").write_text(dump_config(config))
    img = Image.new("RGB", (112, 112), (255, 255, 255))
    img.paste(Image.new("RGB", (28, 28), (230, 0, 0)), (14, 14))
    img.save(tmp_path / "img.png")
    c = build_components(config, load_kernel(), rollouts=False)
    try:
        tok, images = c.tokenizer, PromptImages((img,))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
        prompt = c.adapter.prompt_ids(tok, c.adapter.image_processor(config), msgs, images)
        answer = tok.encode(" 3", add_special_tokens=False)
        s = Sample(id="p0/0", prompt_ids=prompt, response_ids=answer, loss_mask=[1] * len(answer), status="ok")
        attach_images(s, images)
        c.actor.sft_step([s])  # the export must carry trained weights
        c.actor.save(str(run_dir / "checkpoints" / "step_000001"), extra={"step": 1})
        text = (tok.encode("Q: 3+4=? A:", add_special_tokens=False), tok.encode(" 7 ok", add_special_tokens=False))
        replay = c.actor.logprobs([Sample(id="q0/0", prompt_ids=text[0], response_ids=text[1],
                                          loss_mask=[1] * len(text[1]))])[0]
    finally:
        c.close()
    out = subprocess.run([sys.executable, "-m", "unirl.cli", "export", str(run_dir), "--out", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "none"}
    plain = subprocess.run([sys.executable, "-c", VLM_VLLM, str(tmp_path / "hf"), str(tmp_path / "img.png"),
                            json.dumps(prompt), json.dumps(text)], capture_output=True, text=True, timeout=900, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    got = json.loads(next(line for line in plain.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(got["generated"]) == 4
    torch.testing.assert_close(torch.tensor(got["text"]), replay, atol=1e-5, rtol=0)
