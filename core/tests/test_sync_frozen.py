"""A weight sync sends what changed (issue 71): a frozen vision tower goes to an engine once, in its
first sync, and later syncs leave it out, declared kept; a trained tower is sent every time. The
oracle for what was sent is an independent fingerprint of the actor's non-tower weights."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from unirl.config import RunConfig
from unirl.contracts import SamplingParams, fingerprint
from unirl.kernel.errors import WeightSyncError
from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter
from unirl.multimodal import PromptImages, attach_images
from unirl.samples import Sample, expand
from unirl.sync.inprocess import InProcessSync
from unirl.testing import build_actor, build_engine

CONFIG = dict(model={"adapter": "qwen2_5_vl"})


@pytest.fixture(scope="module")
def adapter():
    return Qwen2_5_VLAdapter()


@pytest.fixture(scope="module")
def tok(adapter):
    return adapter.build_tokenizer(RunConfig(**CONFIG))


def image_samples(adapter, tok, engine):
    img = Image.new("RGB", (56, 56), (255, 255, 255))
    img.paste(Image.new("RGB", (28, 28), (200, 0, 0)), (14, 14))
    im = PromptImages((img,))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    s = Sample(id="p0", prompt_ids=adapter.prompt_ids(tok, engine.decoder.processor, msgs, im), seed=5)
    attach_images(s, im)
    return engine.generate(expand([s], 2, tag="train-0"), SamplingParams(max_new_tokens=6))


def tower(adapter, named):
    return [(n, t) for n, t in named if n.startswith(adapter.vision_prefix)]


@pytest.mark.parametrize("frozen", [True, False], ids=["tower-frozen", "tower-trained"])
def test_second_sync_leaves_the_frozen_tower_out(adapter, tok, frozen):
    config = RunConfig(**CONFIG, actor={"freeze": ["vision"] if frozen else []})
    engine = build_engine(config, adapter=adapter, tokenizer=tok)
    actor = build_actor(config, adapter=adapter)
    sync = InProcessSync(config=config)
    everything = list(actor.named_weights())
    n_tower = len(tower(adapter, everything))
    assert n_tower > 0
    assert set(actor.frozen_weights()) == ({n for n, _ in tower(adapter, everything)} if frozen else set())

    first, _ = sync.publish(actor, engine, 1)  # a fresh engine gets every weight once
    assert first[0].num_tensors == len(everything)
    actor.sft_step(image_samples(adapter, tok, engine))
    receipts, sent = sync.publish(actor, engine, 2)
    named = [(n, t.detach().clone()) for n, t in actor.named_weights()]
    expected = [(n, t) for n, t in named if not (frozen and n.startswith(adapter.vision_prefix))]
    assert receipts[0].num_tensors == len(expected) == len(everything) - (n_tower if frozen else 0)
    assert sent == receipts[0].fingerprint == fingerprint(expected)
    # the engine serves the actor's weights exactly, tower included (kept from the first sync, or re-sent)
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in named)
    if frozen:
        tower_bytes = sum(t.numel() * t.element_size() for _, t in tower(adapter, named))
        total = sum(t.numel() * t.element_size() for _, t in named)
        print(f"tower {n_tower} tensors, {tower_bytes} of {total} bytes not sent")
        # a new engine object (a restart) gets the tower again
        fresh = build_engine(config, adapter=adapter, tokenizer=tok)
        assert sync.publish(actor, fresh, 3)[0][0].num_tensors == len(everything)


def test_kept_names_do_not_excuse_other_missing_tensors(adapter, tok):
    config = RunConfig(**CONFIG, actor={"freeze": ["vision"]})
    engine = build_engine(config, adapter=adapter, tokenizer=tok)
    actor = build_actor(config, adapter=adapter)
    staged = engine.stage()
    staged.leave_out(actor.frozen_weights())
    for name, t in actor.named_weights():
        if not name.startswith(adapter.vision_prefix) and "layers.1." not in name:
            staged.add_all(name, t.detach())
    with pytest.raises(WeightSyncError, match=r"sync is missing \d+ tensor\(s\): model.language_model.layers.1"):
        staged.finish()
    with pytest.raises(WeightSyncError, match="declared kept"):  # kept and sent in one sync is refused
        name, t = tower(adapter, actor.named_weights())[0]
        staged.add(name, t.detach())
    with pytest.raises(WeightSyncError, match="unexpected tensor 'model.visual.nope'"):
        engine.stage().leave_out({"model.visual.nope": (2, 2)})
