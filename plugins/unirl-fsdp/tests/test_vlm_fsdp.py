"""The FSDP actor replays and trains with images (issue 71): the tiny Qwen2.5-VL, gloo, 2 ranks, fp32.

Each rank gets its samples with their prompt images (the pixels the processor made ride with the
prompt, :mod:`unirl.actor.vision_inputs`). The oracle is the embedded actor in this process: the FSDP
actor's replay log-probs and its full gradients (tower included) on the same image batch must equal it.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import fsdp_support  # noqa: E402
from fsdp_support import loss_and_grads  # noqa: E402
from test_fsdp_actor import make_batch, max_diff  # noqa: E402

from unirl.actor.torch_actor import TorchActor, micro_batch_loss, step_denominators  # noqa: E402
from unirl.algorithms.losses import LossSettings, ppo_clip  # noqa: E402
from unirl.api import RunConfig, SamplingParams, build_actor, build_runtime, expand, load_kernel  # noqa: E402
from unirl.models.qwen2_5_vl import Qwen2_5_VLAdapter  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOL = 1e-6


def vlm_config(world_size: int = 2, **actor) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"adapter": "qwen2_5_vl"},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0,
                  "options": {"world_size": world_size, "cpus_per_rank": 0.5, "step_timeout_s": 180,
                              "worker_cls": fsdp_support.WORKER_CLS}, **actor},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "trainer": {"prompts_per_step": 3},
    })


def image_samples(adapter, config):
    """Two image prompts of different sizes and a text row, two samples each, from the embedded engine."""
    from PIL import Image

    from unirl.api import PromptImages, Sample, build_engine
    from unirl.multimodal import attach_images

    engine = build_engine(config.model_copy(update={"actor": config.actor.model_copy(update={"name": "torch"})}),
                          adapter=adapter)
    roots = []
    for i, size in enumerate((112, 56)):
        img = Image.new("RGB", (size, size), (255, 255, 255))
        img.paste(Image.new("RGB", (size // 2, size // 2), (0, 90 * i, 200)), (size // 4, size // 4))
        images = PromptImages((img,))
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
        s = Sample(id=f"p{i}", prompt_ids=adapter.prompt_ids(engine.tokenizer, engine.decoder.processor, msgs,
                                                             images), seed=7 + i)
        attach_images(s, images)
        roots.append(s)
    roots.append(Sample(id="p2", prompt_ids=engine.tokenizer.encode("plain text"), seed=9))
    return engine.generate(expand(roots, 2, tag="train-0"), SamplingParams(max_new_tokens=6))


@pytest.fixture(scope="module")
def setup(ray_session):
    adapter = Qwen2_5_VLAdapter()
    config = vlm_config()
    runtime = build_runtime(config, load_kernel(), adapter=adapter)
    reference = TorchActor(config=config, adapter=adapter, runtime=runtime)
    actor = build_actor(config, adapter=adapter, runtime=runtime)
    samples = image_samples(adapter, config)
    yield {"config": config, "reference": reference, "actor": actor, "samples": samples}
    actor.close()


def reference_loss_and_grads(actor: TorchActor, samples, batch, config):
    total_tokens, total_seqs = step_denominators(samples)
    actor.optimizer.zero_grad(set_to_none=True)
    loss, _, _ = micro_batch_loss(actor.model, samples, batch, config=config, loss_fn=ppo_clip,
                                  total_tokens=total_tokens, total_seqs=total_seqs, value_head=None,
                                  settings=LossSettings.from_algorithm(config.algorithm,
                                                                       norm_len=config.rollout.max_new_tokens))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_fsdp_replay_and_gradients_equal_the_embedded_actor_on_images(setup):
    samples, ref, actor = setup["samples"], setup["reference"], setup["actor"]
    want = ref.logprobs(samples)
    got = actor.logprobs(samples)
    # one image sample: the other rank holds only a padding micro-batch (text), and must still run the tower
    one = samples[:1]
    assert float((actor.logprobs(one)[0] - ref.logprobs(one)[0]).abs().max()) < TOL
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) < TOL
    batch = make_batch(samples, want)
    want_loss, want_grads = reference_loss_and_grads(ref, samples, batch, setup["config"])
    got_loss, got_grads = loss_and_grads(actor, samples, batch)
    assert abs(got_loss - want_loss) < TOL
    tower = [n for n in want_grads if n.startswith("model.visual.")]
    assert tower and any(float(want_grads[n].abs().max()) > 0 for n in tower)  # the pixels reach the loss
    assert max_diff(got_grads, want_grads) < TOL


def test_fsdp_frozen_tower_is_unchanged_and_sent_once(setup):
    """``actor.freeze: [vision]`` on the ranks: the tower's gathered weights do not move in an SFT step, and
    a sync to an engine sends it in the first publish only (the engine then serves the actor's weights)."""
    from unirl.api import InProcessSync, build_engine

    adapter = Qwen2_5_VLAdapter()
    config = vlm_config(freeze=["vision"])
    actor = build_actor(config, adapter=adapter, runtime=build_runtime(config, load_kernel(), adapter=adapter))
    try:
        before = {n: t.clone() for n, t in actor.named_weights()}
        tower = {n for n in before if n.startswith(adapter.vision_prefix)}
        assert tower and set(actor.frozen_weights()) == tower
        engine_config = config.model_copy(update={"actor": config.actor.model_copy(update={"name": "torch"})})
        engine = build_engine(engine_config, adapter=adapter)
        sync = InProcessSync(config=engine_config)
        assert sync.publish(actor, engine, 1)[0][0].num_tensors == len(before)
        actor.sft_step(setup["samples"])
        after = dict(actor.named_weights())
        assert all(torch.equal(after[n], before[n]) for n in tower)
        assert any(not torch.equal(after[n], before[n]) for n in before if n not in tower)
        assert sync.publish(actor, engine, 2)[0][0].num_tensors == len(before) - len(tower)
        state = engine.model.state_dict()
        assert all(torch.equal(state[n], t) for n, t in after.items())
    finally:
        actor.close()
