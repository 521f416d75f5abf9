"""The actor hooks of a vision-language model (``unirl.actor.vision_inputs.install_actor_hooks``).

* A text-only packed micro-batch keeps its sequences apart: a text row's replay is the same alone, packed
  after another text row, or packed with an image row, and equals a teacher-forced transformers forward
  of that row alone (before the fix, packing after another text row moved a log-prob by 0.13).
* ``sharded``: a forward without pixels still runs the tower once (the ranks' collectives stay paired),
  with logits bit-identical and zero gradients for every tower parameter.
"""

from __future__ import annotations

import torch
from PIL import Image

from unirl.actor.vision_inputs import install_actor_hooks
from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter
from unirl.multimodal import PromptImages, attach_images
from unirl.samples import Sample, expand
from unirl.testing import build_actor, build_engine, teacher_forced_logprobs

CONFIG = dict(model={"adapter": "qwen2_5_vl"})


def test_text_rows_replay_the_same_however_packed():
    adapter = Qwen2_5_VLAdapter()
    engine = build_engine(RunConfig(**CONFIG), adapter=adapter)
    tok, proc = engine.tokenizer, engine.decoder.processor
    img = Image.new("RGB", (56, 56), (255, 255, 255))
    im = PromptImages((img,))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    image_row = Sample(id="p0", prompt_ids=adapter.prompt_ids(tok, proc, msgs, im), seed=1)
    attach_images(image_row, im)
    text_row = Sample(id="p1", prompt_ids=tok.encode("plain text here"), seed=2)
    samples = engine.generate(expand([image_row, text_row], 2, tag="t"), SamplingParams(max_new_tokens=6))
    actor = build_actor(RunConfig(**CONFIG, actor={"micro_batch_size": 8}), adapter=adapter)
    last = samples[3]
    alone = actor.logprobs([last])[0]
    torch.testing.assert_close(alone, teacher_forced_logprobs(engine.model, last, proc), atol=1e-5, rtol=0)
    for group in ([samples[2], last], [samples[0], last], samples):
        torch.testing.assert_close(actor.logprobs(group)[-1], alone, atol=1e-5, rtol=0)


def test_sharded_hooks_run_the_tower_without_pixels_and_change_nothing():
    adapter = Qwen2_5_VLAdapter()
    config = RunConfig(**CONFIG)
    model = adapter.build_model(config, adapter.build_tokenizer(config)).float()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = model(input_ids=ids).logits
    calls: list[int] = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    install_actor_hooks(model, sharded=True)
    hooked = model(input_ids=ids).logits
    assert torch.equal(plain, hooked) and calls == [1]
    hooked.sum().backward()
    tower = [p.grad for n, p in model.named_parameters() if n.startswith(adapter.vision_prefix)]
    assert tower and all(g is not None and not g.any() for g in tower)
