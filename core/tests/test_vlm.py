"""Vision-language prompts (issue 71): images loaded and checked per row, shared by a group's samples,
and the embedded engine generating from image + text with log-probs a teacher-forced transformers
forward of the same image prompt reproduces."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from unirl.config import RunConfig
from unirl.contracts import SamplingParams
from unirl.kernel.errors import DataError
from unirl.models.qwen2_5_vl import IMAGE_PAD, Qwen2_5_VLAdapter
from unirl.multimodal import PromptImages, attach_images, images_of, load_image, row_images
from unirl.samples import Sample, expand
from unirl.testing import build_engine, teacher_forced_logprobs

CONFIG = dict(model={"adapter": "qwen2_5_vl"})


def square(colour: tuple[int, int, int], size: int = 84) -> Image.Image:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    img.paste(Image.new("RGB", (size // 2, size // 2), colour), (size // 4, size // 4))
    return img


@pytest.fixture(scope="module")
def adapter():
    return Qwen2_5_VLAdapter()


@pytest.fixture(scope="module")
def tok(adapter):
    return adapter.build_tokenizer(RunConfig(**CONFIG))


@pytest.fixture(scope="module")
def engine(adapter, tok):
    return build_engine(RunConfig(**CONFIG), adapter=adapter, tokenizer=tok)


def image_prompt(adapter, tok, processor, images, text):
    msgs = [{"role": "user", "content": [*({"type": "image"} for _ in images.images), {"type": "text", "text": text}]}]
    return adapter.prompt_ids(tok, processor, msgs, images)


def test_image_prompt_expands_placeholders_to_the_processors_token_count(adapter, tok, engine):
    proc = engine.decoder.processor
    im = PromptImages((square((255, 0, 0), 112),))
    ids = image_prompt(adapter, tok, proc, im, "colour?")
    grid = proc(images=list(im.images), return_tensors="pt")["image_grid_thw"]
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_PAD)) == int(grid.prod()) // 4 == 16  # 112px: 8x8 patches


def test_engine_logprobs_match_teacher_forced_forward_with_images(adapter, tok, engine):
    proc = engine.decoder.processor
    prompts = []
    for i, (colour, size, text) in enumerate([((255, 0, 0), 112, "What colour?"), ((0, 0, 255), 56, "Colour"),
                                               ((0, 200, 0), 84, "Which colour is the square, please?")]):
        im = PromptImages((square(colour, size),))
        s = Sample(id=f"p{i}", prompt_ids=image_prompt(adapter, tok, proc, im, text), seed=10 + i)
        attach_images(s, im)
        prompts.append(s)
    text_only = Sample(id="p3", prompt_ids=tok.encode("no image here"), seed=3)
    samples = engine.generate(expand([*prompts, text_only], 2, tag="train-0"), SamplingParams(max_new_tokens=12))
    assert len({len(s.prompt_ids) for s in samples}) == 4  # left padding with mixed image / text rows
    never = set(engine.decoder.placeholder_ids)
    for s in samples:
        assert s.response_ids and not never & set(s.response_ids)  # placeholders are never drawn
        got = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        torch.testing.assert_close(got, teacher_forced_logprobs(engine.model, s, proc), atol=1e-5, rtol=0)
    # a group's siblings share the prompt's one PromptImages object: no pixels copied per sample
    assert images_of(samples[0]) is images_of(samples[1]) is prompts[0].meta["images"]


def test_the_image_changes_the_output(adapter, tok, engine):
    """Same text, two images: the first-token distribution differs, so the pixels reach the forward."""
    proc = engine.decoder.processor
    lps = []
    for colour in ((255, 0, 0), (0, 0, 255)):
        im = PromptImages((square(colour),))
        s = Sample(id="p0", prompt_ids=image_prompt(adapter, tok, proc, im, "colour?"), seed=1)
        attach_images(s, im)
        lps.append(engine.generate([s], SamplingParams(max_new_tokens=1, temperature=0.0))[0].rollout_logprobs[0])
    assert lps[0] != lps[1]


# ----------------------------------------------------------------------------- bad input


def test_bad_image_rows_fail_with_one_line_naming_row_and_fix(tmp_path):
    png = io.BytesIO()
    square((1, 2, 3)).save(png, format="PNG")
    (tmp_path / "ok.png").write_bytes(png.getvalue())
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert load_image("ok.png", "row 0", base=tmp_path).size == (84, 84)
    assert load_image(png.getvalue(), "row 0").mode == "RGB"
    cases = {
        "missing.png": "does not exist",
        "bad.png": "not a readable image",
        b"garbage": "not a readable image",
        12: "not a path, bytes or a PIL image",
    }
    for value, words in cases.items():
        with pytest.raises(DataError) as e:
            load_image(value, "train.jsonl row 7", base=tmp_path)
        msg = str(e.value)
        assert words in msg and "train.jsonl row 7" in msg and "fix:" in msg and "\n" not in msg
    with pytest.raises(DataError, match=r"row 2: the image is 84x84 = 7056 pixels, over the limit of 1000; fix:"):
        load_image(square((0, 0, 0)), "row 2", max_pixels=1000)
    with pytest.raises(DataError, match=r"row 4: data.image_key 'img' names no column \(columns: image, prompt\)"):
        row_images({"prompt": "p", "image": "x"}, "img", "row 4", vision=True)
    with pytest.raises(DataError, match=r"row 5: the row has an image but the model takes text only; fix:"):
        row_images({"prompt": "p", "image": square((0, 0, 0))}, "image", "row 5", vision=False)
    assert row_images({"prompt": "p", "image": None}, "image", "row 6", vision=False) is None
    got = row_images({"image": ["ok.png", png.getvalue()]}, "image", "row 8", vision=True, base=tmp_path)
    assert len(got) == 2


def test_images_on_a_text_only_engine_are_refused(tok):
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.models.tokenizer import build_demo_tokenizer

    eng = build_engine(RunConfig(), adapter=Qwen3Adapter(), tokenizer=build_demo_tokenizer())
    s = Sample(id="p0", prompt_ids=[5, 6, 7], seed=1)
    attach_images(s, PromptImages((square((0, 0, 0)),)))
    with pytest.raises(DataError, match="takes text only; fix"):
        eng.generate([s], SamplingParams(max_new_tokens=2))


# ----------------------------------------------------------------------------- data.image_key


def write_rows(tmp_path, rows):
    import json

    (tmp_path / "red.png").parent.mkdir(exist_ok=True, parents=True)
    square((255, 0, 0)).save(tmp_path / "red.png")
    square((0, 0, 255), 112).save(tmp_path / "blue.png")
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_data_image_key_attaches_each_rows_images(tmp_path, adapter, tok):
    from unirl.data.datasets import load_prompts

    f = write_rows(tmp_path, [{"prompt": "colour?", "answer": "red", "image": "red.png"},
                              {"prompt": "colour?", "answer": "blue", "image": "blue.png"},
                              {"prompt": "text only", "answer": "x", "image": None}])
    cfg = RunConfig(**CONFIG, data={"source": str(f), "eval_source": str(f), "image_key": "image"})
    samples, stats = load_prompts(cfg, tok, "train", adapter)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert stats["rows"] == 3
    assert [s.prompt_ids.count(pad) for s in samples] == [9, 16, 0]  # 84px: 6x6 patches -> 9; 112px -> 16
    assert images_of(samples[0]).images[0].getpixel((42, 42)) == (255, 0, 0)
    assert images_of(samples[2]) is None
    kids = expand(samples[:1], 3, tag="train-0")
    assert all(images_of(k) is images_of(samples[0]) for k in kids)  # one reference per prompt


def test_data_image_key_bad_rows(tmp_path, adapter, tok):
    from unirl.data.datasets import load_prompts
    from unirl.models.qwen3 import Qwen3Adapter

    f = write_rows(tmp_path, [{"prompt": "a", "answer": "1", "image": "red.png"},
                              {"prompt": "b", "answer": "2", "image": "gone.png"}])
    cfg = RunConfig(**CONFIG, data={"source": str(f), "eval_source": str(f), "image_key": "image"})
    with pytest.raises(DataError, match=r"train.jsonl line 2: image file .*gone.png' does not exist; fix:"):
        load_prompts(cfg, tok, "train", adapter)
    bad_key = RunConfig(**CONFIG, data={"source": str(f), "eval_source": str(f), "image_key": "picture"})
    with pytest.raises(DataError, match=r"line 1: data.image_key 'picture' names no column \(columns: answer, image, "
                                        r"prompt\); fix"):
        load_prompts(bad_key, tok, "train", adapter)
    with pytest.raises(DataError, match=r"line 1: the row has an image but the model takes text only; fix"):
        load_prompts(RunConfig(data=cfg.data.model_dump()), tok, "train", Qwen3Adapter())


# ----------------------------------------------------------------------------- actor


def test_actor_replays_engine_logprobs_and_trains_with_images(adapter, tok, engine):
    """The embedded actor's packed replay of image prompts (several per row, mixed with a text one)
    equals the engine's rollout log-probs, and one training step moves the language model."""
    from unirl.testing import build_actor

    proc = engine.decoder.processor
    prompts = []
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        im = PromptImages((square(colour, 56 + 28 * i),))
        s = Sample(id=f"p{i}", prompt_ids=image_prompt(adapter, tok, proc, im, "colour?"), seed=20 + i)
        attach_images(s, im)
        prompts.append(s)
    prompts.append(Sample(id="p2", prompt_ids=tok.encode("plain text"), seed=3))
    samples = engine.generate(expand(prompts, 2, tag="train-0"), SamplingParams(max_new_tokens=8))
    actor = build_actor(RunConfig(**CONFIG, actor={"micro_batch_size": 8}), adapter=adapter)
    replayed = actor.logprobs(samples)
    for s, lp in zip(samples, replayed, strict=True):
        torch.testing.assert_close(lp, torch.tensor(s.rollout_logprobs), atol=1e-5, rtol=0)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.sft_step(samples)
    moved = {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("model.language_model.") for n in moved)
    # the vision tower learns too (no freeze): the image tokens reached the loss through it
    assert any(n.startswith(adapter.vision_prefix) for n in moved)


def test_frozen_vision_tower_is_unchanged_after_training(adapter, tok, engine):
    from unirl.kernel.errors import ConfigError
    from unirl.models.qwen3 import Qwen3Adapter
    from unirl.testing import build_actor

    proc = engine.decoder.processor
    im = PromptImages((square((0, 128, 255)),))
    s = Sample(id="p0", prompt_ids=image_prompt(adapter, tok, proc, im, "colour?"), seed=4)
    attach_images(s, im)
    samples = engine.generate(expand([s], 2, tag="train-0"), SamplingParams(max_new_tokens=6))
    actor = build_actor(RunConfig(**CONFIG, actor={"freeze": ["vision"]}), adapter=adapter)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.sft_step(samples)
    actor.sft_step(samples)
    vision = [n for n in before if n.startswith(adapter.vision_prefix)]
    assert vision and all(torch.equal(actor.model.get_parameter(n), before[n]) for n in vision)
    assert any(not torch.equal(p, before[n]) for n, p in actor.model.named_parameters() if n not in vision)
    with pytest.raises(ConfigError, match=r"actor.freeze: \[vision\] but model.adapter 'qwen3' has no vision tower"):
        build_actor(RunConfig(actor={"freeze": ["vision"]}), adapter=Qwen3Adapter())


def test_images_of_in_flight_samples_survive_checkpoint_and_resume(adapter, tok, engine, tmp_path):
    """A checkpoint's carried tail is pickled Samples in ``extra`` (actor.save / actor.load): the images
    come back bit for bit, with their processed pixels, and a group's siblings still share one object."""
    import numpy as np

    from unirl.testing import build_actor

    proc = engine.decoder.processor
    im = PromptImages((square((10, 200, 30)), square((200, 10, 30), 112)))
    s = Sample(id="p0", prompt_ids=image_prompt(adapter, tok, proc, im, "two images"), seed=8)
    attach_images(s, im)
    samples = engine.generate(expand([s], 2, tag="train-0"), SamplingParams(max_new_tokens=4))
    actor = build_actor(RunConfig(**CONFIG), adapter=adapter)
    actor.save(str(tmp_path / "ckpt"), extra={"carried": samples})
    back = actor.load(str(tmp_path / "ckpt"))["carried"]
    got = images_of(back[0])
    assert got is images_of(back[1])  # one reference per prompt after the round trip too
    for a, b in zip(got.images, im.images, strict=True):
        assert a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))
    for k, v in im.cache.items():
        assert all(torch.equal(v[f], got.cache[k][f]) for f in v)
    assert [x.prompt_ids for x in back] == [x.prompt_ids for x in samples]
    # the resumed samples replay to the rollout log-probs: the images still drive the forward
    for x, lp in zip(back, actor.logprobs(back), strict=True):
        torch.testing.assert_close(lp, torch.tensor(x.rollout_logprobs), atol=1e-5, rtol=0)
