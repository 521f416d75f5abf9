"""`unirl export` of a vision-language run (issue 71): the export carries the model's image processor
and chat template, and plain transformers (no unirl import) loads it and generates from an image.

Oracles: the plain process renders the prompt from the exported chat template and expands the image
placeholder from the exported processor's grid, which must give the adapter's prompt ids; its
teacher-forced log-probs of a response must equal the trained actor's replay (1e-5). transformers'
``AutoProcessor`` for Qwen2.5-VL also builds a video processor, which needs torchvision, which cannot be
installed on this CPU machine; the plain process loads the same files through ``AutoImageProcessor``
and ``AutoTokenizer`` instead (the two sub-processors ``AutoProcessor`` would load).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image

from unirl.config import RunConfig, load_config
from unirl.contracts import SamplingParams
from unirl.export import export_run
from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter
from unirl.multimodal import PromptImages, attach_images
from unirl.samples import Sample, expand
from unirl.testing import build_actor, build_engine

pytestmark = pytest.mark.slow

PLAIN_VL = textwrap.dedent("""
    import json, sys
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    path, image_path, response = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc, tok = AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    pixels = proc(images=[Image.open(image_path).convert("RGB")], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // proc.merge_size ** 2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n)  # what Qwen2_5_VLProcessor does
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + response])
    kw = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
              mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, **kw).logits[0].float(), -1)
        pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        gen = model.generate(input_ids=ids[:, :len(prompt)], do_sample=False, max_new_tokens=5,
                             **{**kw, "mm_token_type_ids": kw["mm_token_type_ids"][:, :len(prompt)]})
    assert not any(m == "unirl" or m.startswith("unirl.") for m in sys.modules)
    print(json.dumps({"prompt": prompt, "logprobs": logp[pos, torch.tensor(response)].tolist(),
                      "generated": gen[0, len(prompt):].tolist()}))
""")


def test_vlm_export_loads_in_plain_transformers_and_generates_from_an_image(tmp_path):
    adapter = Qwen2_5_VLAdapter()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text(json.dumps(
        {"run": {"output_dir": str(tmp_path), "name": "r"}, "model": {"adapter": "qwen2_5_vl"},
         "actor": {"freeze": ["vision"]}}))
    config = load_config(str(tmp_path / "r" / "config.yaml"), [])
    engine = build_engine(RunConfig(model={"adapter": "qwen2_5_vl"}), adapter=adapter)
    img = Image.new("RGB", (112, 112), (255, 255, 255))
    img.paste(Image.new("RGB", (28, 28), (230, 0, 0)), (14, 14))
    img.save(tmp_path / "img.png")
    images = PromptImages((Image.open(tmp_path / "img.png").convert("RGB"),))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
    root = Sample(id="p0", prompt_ids=adapter.prompt_ids(engine.tokenizer, engine.decoder.processor, msgs, images),
                  seed=3)
    attach_images(root, images)
    samples = engine.generate(expand([root], 2, tag="train-0"), SamplingParams(max_new_tokens=6))
    actor = build_actor(config, adapter=adapter)
    actor.sft_step(samples)  # the export must carry trained weights, not the build
    actor.save(str(config.run_dir / "checkpoints" / "step_000001"))
    replay = actor.logprobs(samples[:1])[0]

    hf = export_run(config.run_dir, out=tmp_path / "hf")
    assert (hf / "preprocessor_config.json").is_file()
    plain = subprocess.run([sys.executable, "-c", PLAIN_VL, str(hf), str(tmp_path / "img.png"),
                            json.dumps(samples[0].response_ids)],
                           capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert plain.returncode == 0, plain.stderr[-2000:]
    got = json.loads(plain.stdout.strip().splitlines()[-1])
    assert got["prompt"] == samples[0].prompt_ids  # the exported template and processor render our prompt
    torch.testing.assert_close(torch.tensor(got["logprobs"]), replay, atol=1e-5, rtol=0)
    assert len(got["generated"]) == 5
