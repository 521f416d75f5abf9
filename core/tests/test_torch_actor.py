"""The embedded actor: micro-batch invariance, replay, SFT, reference, hooks, export."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unirl.actor.torch_actor import TorchActor, hf_named_weights, lr_factor, step_denominators
from unirl.config import RunConfig
from unirl.contracts import StepInfo
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample
from unirl.testing import default_runtime

VOCAB = 64


def make_config(**sections) -> RunConfig:
    data = {"trainer": {"steps": 10}, "actor": {"lr": 1e-3, "micro_batch_size": 4}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return RunConfig.model_validate(data)


def tiny_model(config: RunConfig, seed: int = 0):
    from transformers import Qwen3ForCausalLM

    cfg = Qwen3Adapter().hf_config(config, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def make_actor(config: RunConfig, before_backward=None, runtime=None, **kw) -> TorchActor:
    actor = TorchActor(config=config, adapter=Qwen3Adapter(), model=tiny_model(config),
                       runtime=runtime if runtime is not None else default_runtime(config), **kw)
    actor.set_before_backward(before_backward)
    return actor


def make_samples(n: int = 6, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, 6, (1,), generator=g))
        r = int(torch.randint(1, 8, (1,), generator=g))
        mask = [1] * r
        if r > 2:
            mask[1] = 0
        out.append(Sample(id=f"p{i // 2}/{i % 2}", prompt_ids=torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                          response_ids=torch.randint(2, VOCAB, (r,), generator=g).tolist(), loss_mask=mask))
    return out


def make_batch(actor: TorchActor, samples: list[Sample], seed: int = 1, values: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    old = actor.logprobs(samples)
    batch = {
        "old_logprobs": [o + 0.3 * torch.randn(o.shape, generator=g) for o in old],
        "advantages": [torch.randn(o.shape, generator=g) for o in old],
    }
    if values:
        batch["old_values"] = [torch.randn(o.shape, generator=g) * 0.1 for o in old]
        batch["returns"] = [torch.randn(o.shape, generator=g) for o in old]
    return batch


def step_grads(actor: TorchActor, samples, batch):
    """Run train_step, capturing the accumulated gradients right before the optimizer step."""
    grads = {}
    orig = actor._clip_and_step

    def capture(opt, params):
        for i, p in enumerate(params):
            grads[i] = p.grad.detach().clone() if p.grad is not None else None
        return orig(opt, params)

    actor._clip_and_step = capture
    metrics = actor.train_step(samples, batch)
    return grads, metrics


def test_micro_batch_bounds_cut_by_count_and_by_tokens():
    """Hand-derived cuts: samples of 3, 5, 2, 9 and 4 tokens (prompt + response)."""
    from unirl.actor.skeleton import micro_batch_bounds

    samples = [Sample(id=f"s{i}", prompt_ids=[2] * 1, response_ids=[3] * (n - 1)) for i, n in enumerate((3, 5, 2, 9, 4))]
    assert micro_batch_bounds(samples, 2) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batch_bounds(samples, 64, None) == [(0, 5)]
    # 3+5 = 8 fits 8, +2 would not; 2 alone, +9 would not; 9 > 8 runs alone; 4 alone
    assert micro_batch_bounds(samples, 64, 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert micro_batch_bounds(samples, 64, 10) == [(0, 3), (3, 4), (4, 5)]
    assert micro_batch_bounds(samples, 2, 100) == [(0, 2), (2, 4), (4, 5)]  # the count still binds
    assert micro_batch_bounds([], 4, 8) == []


@pytest.mark.parametrize(
    "sections",
    [
        {"algorithm": {"loss_agg": "token-mean"}},
        {"algorithm": {"loss_agg": "seq-mean-token-mean", "kl_coef": 0.1}, "actor": {"value_head": True}},
        {"algorithm": {"loss_agg": "seq-mean-token-sum-norm"}, "actor": {"grad_clip": 0.0}},
    ],
)
def test_micro_batch_size_does_not_change_update(sections):
    samples = make_samples(6)
    results = []
    # (micro_batch_size, micro_batch_tokens): the token budget cuts 6 samples into uneven micro-batches
    for mbs, tokens in ((1, None), (4, None), (6, None), (6, 12)):
        cfg = make_config(**sections)
        cfg.actor.micro_batch_size = mbs
        cfg.actor.micro_batch_tokens = tokens
        actor = make_actor(cfg)
        if tokens is not None:
            sizes = [len(mb.samples) for mb in actor._micro_batches(samples)]
            assert len(sizes) > 1 and len(set(sizes)) > 1, sizes  # really cut, and unevenly
        batch = make_batch(actor, samples, values=cfg.actor.value_head)
        grads, metrics = step_grads(actor, samples, batch)
        params = [p.detach().clone() for p in actor._train_params()]
        results.append((grads, metrics, params))
    g0, m0, p0 = results[0]
    assert m0["clip_frac"] > 0  # the noisy old log-probs make some tokens clip
    for grads, metrics, params in results[1:]:
        for i in g0:
            # summation order differs with the micro-batch split (and with oneDNN's threading): a
            # relative 1e-5 on top of 1e-6 absolute, far below any real accumulation bug (>= 1e-2)
            torch.testing.assert_close(grads[i], g0[i], atol=1e-6, rtol=1e-5)
        # Adam's first step is lr * g / (|g| + eps): on entries with small |g| it magnifies the
        # summation-order roundoff of the gradients, so params are compared at 1e-6 where |g| > 1e-5
        # (elsewhere the update is at most lr either way)
        for i, (a, b) in enumerate(zip(params, p0, strict=True)):
            sure = g0[i].abs() > 1e-5
            torch.testing.assert_close(a[sure], b[sure], atol=1e-6, rtol=0)
            torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
        for k in ("loss", "pg_loss", "clip_frac", "entropy", "grad_norm"):
            assert metrics[k] == pytest.approx(m0[k], abs=1e-6, rel=1e-6), k


def test_train_step_metrics_and_hook():
    cfg = make_config(algorithm={"kl_coef": 0.05}, actor={"micro_batch_size": 4})
    calls = []
    actor = make_actor(cfg, before_backward=lambda ctx: calls.append(
        (len(ctx.samples), ctx.logprobs.shape[0], ctx.logprobs.requires_grad, ctx.micro_batch, ctx.rl_step,
         ctx.update, ctx.rank, ctx.world_size, ctx.rollout_logprobs.shape[0])))
    samples = make_samples(6)
    batch = make_batch(actor, samples)
    batch["rollout_logprobs"] = [o - 0.01 for o in batch["old_logprobs"]]
    before = actor.logprobs(samples)
    m = actor.train_step(samples, batch, StepInfo(rl_step=7, update=1))
    for k in ("loss", "pg_loss", "grad_norm", "clip_frac", "kl", "entropy", "lr"):
        assert k in m and math.isfinite(m[k]), k
    assert m["lr"] == pytest.approx(1e-3)
    assert m["entropy"] > 0 and m["kl"] >= 0
    assert [c[0] for c in calls] == [4, 2]
    assert sum(c[1] for c in calls) == sum(len(s.response_ids) for s in samples)
    assert not any(c[2] for c in calls)  # detached: the hook observes, it cannot alter the graph
    assert [c[3:8] for c in calls] == [(0, 7, 1, 0, 1), (1, 7, 1, 0, 1)]
    assert [c[8] for c in calls] == [c[1] for c in calls]  # rollout log-probs aligned with the trainer's
    after = actor.logprobs(samples)
    assert any((a - b).abs().max() > 1e-5 for a, b in zip(after, before, strict=True))
    # the reference is frozen at construction
    ref = actor.ref_logprobs(samples)
    for r, b in zip(ref, before, strict=True):
        torch.testing.assert_close(r, b, atol=1e-6, rtol=0)
    assert actor.step == 1


def test_logprobs_match_plain_forward_and_micro_batching():
    cfg = make_config(actor={"micro_batch_size": 2})
    actor = make_actor(cfg)
    samples = make_samples(5)
    lp = actor.logprobs(samples)
    assert [t.shape[0] for t in lp] == [len(s.response_ids) for s in samples]
    assert all(t.dtype == torch.float32 for t in lp)
    cfg.actor.micro_batch_size = 5
    for a, b in zip(lp, actor.logprobs(samples), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    s = samples[0]
    with torch.no_grad():
        logits = actor.model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
    P = len(s.prompt_ids)
    ref = torch.log_softmax(logits.float(), -1)[P - 1 : -1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    torch.testing.assert_close(lp[0], ref, atol=1e-6, rtol=0)


def test_value_head_values_and_training():
    cfg = make_config(actor={"value_head": True})
    actor = make_actor(cfg)
    samples = make_samples(4)
    v0 = actor.values(samples)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in v0)
    batch = make_batch(actor, samples, values=True)
    m = actor.train_step(samples, batch)
    assert m["vf_loss"] > 0
    v1 = actor.values(samples)
    assert any(v.abs().max() > 0 for v in v1)
    with pytest.raises(ValueError):
        actor.train_step(samples, {k: v for k, v in batch.items() if k != "returns"})


def test_no_value_head_values_raises():
    actor = make_actor(make_config())
    with pytest.raises(NotImplementedError):
        actor.values(make_samples(2))
    with pytest.raises(RuntimeError):
        actor.ref_logprobs(make_samples(2))


class _CountMatmuls(TorchDispatchMode):
    """How many matmul kernels ran (``aten.mm`` / ``addmm`` / ``bmm``), forward and backward together."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def test_activation_checkpointing_same_grads_and_selective_recomputes_no_matmul():
    """Each mode's gradient is the one without checkpointing; full recomputes every layer's matmuls in
    backward (more matmul kernels than no checkpointing), selective keeps their outputs (as many as none:
    what makes it cheaper than full, unirl.actor.activation_checkpointing)."""
    samples = make_samples(4)
    out, mms = {}, {}
    for ac in (False, True, "selective"):
        cfg = make_config(actor={"activation_checkpointing": ac})
        actor = make_actor(cfg)
        batch = make_batch(actor, samples)
        with _CountMatmuls() as count:
            out[ac], _ = step_grads(actor, samples, batch)
        mms[ac] = count.n
    for ac in (True, "selective"):
        for i in out[False]:
            torch.testing.assert_close(out[ac][i], out[False][i], atol=1e-6, rtol=0)
    layers = actor.model.config.num_hidden_layers
    # q, k, v, o, gate, up per layer, again (torch's early stop skips down: backward needs its input only)
    assert mms[True] == mms[False] + 6 * layers, mms
    assert mms["selective"] == mms[False], mms


def test_grad_clip_limits_update():
    samples = make_samples(4)
    cfg = make_config(actor={"grad_clip": 1e-3})
    actor = make_actor(cfg)
    grads, m = step_grads(actor, samples, make_batch(actor, samples))
    # reported norm is the pre-clip norm; after clipping the (captured, pre-clip) grads scale down
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values() if g is not None))
    assert m["grad_norm"] == pytest.approx(float(total), rel=1e-5)
    assert m["grad_norm"] > 1e-3


def test_lr_schedule():
    assert lr_factor(0, schedule="constant", warmup_steps=0, total_steps=10) == 1.0
    assert lr_factor(0, schedule="cosine", warmup_steps=4, total_steps=10) == pytest.approx(0.25)
    assert lr_factor(3, schedule="cosine", warmup_steps=4, total_steps=10) == pytest.approx(1.0)
    assert lr_factor(4, schedule="cosine", warmup_steps=4, total_steps=10) == pytest.approx(1.0)
    assert lr_factor(7, schedule="cosine", warmup_steps=4, total_steps=10) == pytest.approx(0.5)
    assert lr_factor(7, schedule="linear", warmup_steps=4, total_steps=10) == pytest.approx(0.5)
    assert lr_factor(10, schedule="linear", warmup_steps=4, total_steps=10) == 0.0
    cfg = make_config(actor={"lr_schedule": "linear", "warmup_steps": 2}, trainer={"steps": 2},
                      algorithm={"updates_per_batch": 2})
    actor = make_actor(cfg)
    samples = make_samples(2)
    lrs = []
    for _ in range(4):
        lrs.append(actor.train_step(samples, make_batch(actor, samples))["lr"])
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])


def test_sft_step_learns_and_keeps_rl_optimizer_clean():
    cfg = make_config(sft={"lr": 3e-3})
    actor = make_actor(cfg)
    samples = make_samples(4)
    losses = [actor.sft_step(samples)["sft_loss"] for _ in range(8)]
    assert losses[-1] < losses[0] * 0.8
    assert len(actor.optimizer.state) == 0
    assert actor.scheduler.last_epoch == 0
    assert len(actor.sft_optimizer.state) > 0


def test_sft_lr_schedule_decays_over_sft_steps_alone():
    """``sft.lr_schedule`` runs over ``sft.steps`` (not the RL steps), the reported lr is the one the step
    used, and the RL schedule does not move."""
    cfg = make_config(sft={"lr": 1e-3, "steps": 4, "lr_schedule": "cosine", "warmup_steps": 1},
                      trainer={"steps": 100})
    actor = make_actor(cfg)
    samples = make_samples(2)
    lrs = [actor.sft_step(samples)["lr"] for _ in range(5)]
    # warmup 1 step (factor 1), then cosine over the 3 remaining: cos(0), cos(pi/3), cos(2pi/3), end (0)
    assert lrs == pytest.approx([1e-3, 1e-3, 0.75e-3, 0.25e-3, 0.0], abs=1e-12)
    assert actor.scheduler.last_epoch == 0 and actor.optimizer.param_groups[0]["lr"] == cfg.actor.lr
    constant = make_actor(make_config(sft={"lr": 1e-3, "steps": 2}))
    assert [constant.sft_step(samples)["lr"] for _ in range(3)] == pytest.approx([1e-3] * 3)


def test_step_denominators():
    s = make_samples(3)
    s.append(Sample(id="x/0", prompt_ids=[3], response_ids=[4, 5], loss_mask=[0, 0]))
    tokens, seqs = step_denominators(s)
    assert tokens == sum(sum(x.loss_mask) for x in s)
    assert seqs == 3


def test_named_weights_and_export(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    actor = make_actor(make_config())
    names = [n for n, _ in actor.named_weights()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(set(names))
    out = tmp_path / "hf"
    actor.export_hf(str(out))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(names)
        for n, t in actor.named_weights():
            assert torch.equal(f.get_tensor(n), t)
    # re-export over an existing directory replaces it; no temp dirs are left behind
    actor.export_hf(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, actor.model.eval()(input_ids=ids).logits)
    assert len(list(hf_named_weights(loaded))) == len(names)


def test_untied_model_exports_lm_head():
    cfg = make_config(model={"build": {"tie_word_embeddings": False}})
    actor = make_actor(cfg)
    names = [n for n, _ in actor.named_weights()]
    assert "lm_head.weight" in names


def test_before_backward_can_stop_the_step():
    def gate(ctx):
        raise RuntimeError("parity gate: drift")

    actor = make_actor(make_config(), before_backward=gate)
    samples = make_samples(3)
    batch = make_batch(actor, samples)
    before = [p.detach().clone() for p in actor._train_params()]
    with pytest.raises(RuntimeError, match="parity gate"):
        actor.train_step(samples, batch)
    assert all(torch.equal(a, b) for a, b in zip(actor._train_params(), before, strict=True))
    assert actor.step == 0
    actor.set_before_backward(None)
    actor.train_step(samples, batch)  # a later step starts from clean gradients
    assert actor.step == 1


def test_selected_policy_loss_comes_from_the_runtime(tmp_path, monkeypatch):
    """`algorithm.loss` picks the registered loss through the runtime the trainer built from its kernel:
    an in-process plugin's loss (twice ppo_clip) doubles every grad; no actor looks a loss up itself."""
    import importlib

    from unirl.algorithms.losses import ppo_clip
    from unirl.kernel import load_kernel
    from unirl.runtime import build_runtime

    (tmp_path / "double_loss_plugin.py").write_text(
        "from unirl.kernel import hookimpl\n"
        "from unirl.algorithms.losses import ppo_clip\n"
        "def double(inp, settings):\n"
        "    loss, metrics = ppo_clip(inp, settings)\n"
        "    return 2 * loss, metrics\n"
        "@hookimpl\n"
        "def unirl_policy_losses():\n"
        "    return {'double': double}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = importlib.import_module("double_loss_plugin")
    kernel = load_kernel(extra=[("double_loss", plugin)])
    samples = make_samples()
    grads = {}
    for loss in ("ppo_clip", "double"):
        cfg = make_config(algorithm={"loss": loss}, actor={"grad_clip": 0.0})
        actor = make_actor(cfg, runtime=build_runtime(cfg, kernel, worker_env={}))
        assert actor.runtime.policy_loss is (plugin.double if loss == "double" else ppo_clip)
        grads[loss], _ = step_grads(actor, samples, make_batch(actor, samples))
    for i, g in grads["ppo_clip"].items():
        if g is not None:
            assert torch.allclose(grads["double"][i], 2 * g, atol=1e-7)


def test_exact_context_wraps_replay_and_train_forward_and_backward():
    """The parity seam: replay inside exact("replay"), the reference inside exact("reference"), every
    training forward and its backward inside exact("train")."""
    import contextlib
    import dataclasses

    cfg = make_config(algorithm={"kl_coef": 0.05}, actor={"micro_batch_size": 4})
    actor = make_actor(cfg)
    phases: list[str] = []
    inside: list[str] = []

    @contextlib.contextmanager
    def exact(phase):
        phases.append(phase)
        inside.append(phase)
        try:
            yield
        finally:
            inside.pop()

    class Exact:
        def exact_context(self, phase):
            return exact(phase)

    actor.runtime = dataclasses.replace(actor.runtime, parity=Exact())
    seen_in_backward = []
    handle = actor.model.get_output_embeddings().register_full_backward_hook(
        lambda *_: seen_in_backward.append(list(inside)))
    samples = make_samples(6)
    batch = make_batch(actor, samples)
    assert phases == ["replay", "replay"]
    actor.ref_logprobs(samples)
    assert phases[2:] == ["reference", "reference"]
    actor.train_step(samples, batch)
    assert phases[4:] == ["train", "train"]
    assert seen_in_backward == [["train"], ["train"]]
    handle.remove()
    actor.sft_step(samples)
    assert phases[6:] == ["train", "train"]


def test_bf16_compute_autocasts_and_keeps_fp32_master():
    """``actor.options.compute_dtype: bfloat16`` (built through the kernel, as ``train()`` does): every forward
    runs under bf16 autocast, log-probs move by bf16 rounding only, and the master weights, gradients and
    optimizer state stay fp32, with gradients pointing where the fp32 ones do."""
    from unirl.testing import build_actor

    config = make_config()
    samples = make_samples()
    fp32 = make_actor(config)
    config16 = make_config(actor={"options": {"compute_dtype": "bfloat16"}})
    bf16 = build_actor(config16, adapter=Qwen3Adapter(), model=tiny_model(config16))
    assert bf16.options.compute_dtype == "bfloat16"
    seen = []
    bf16.model.register_forward_hook(
        lambda *_: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    lp32, lp16 = fp32.logprobs(samples), bf16.logprobs(samples)
    assert seen == [(True, torch.bfloat16)] * len(seen) and seen
    assert all(lp.dtype == torch.float32 for lp in lp16)
    diff = max(float((a - b).abs().max()) for a, b in zip(lp32, lp16, strict=True))
    assert 0 < diff < 0.1, diff  # bf16 rounding of the matmuls, not another model
    batch = make_batch(fp32, samples)
    g32, _ = step_grads(fp32, samples, batch)
    g16, _ = step_grads(bf16, samples, batch)
    for i, g in g32.items():
        if g is None or float(g.norm()) == 0:
            continue
        assert g16[i].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g.flatten(), g16[i].flatten(), dim=0)
        assert cos > 0.99, (i, float(cos))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    state = [t for st in bf16.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)


def test_bf16_update_casts_each_weight_once_with_the_same_gradients():
    """An update enters autocast once around all its micro-batches, so each fp32 weight is cast to bf16 once
    per update, not once per micro-batch (a 100 M model's cast is ~0.1 s on 2 CPU cores). Oracle: the same
    update with autocast's cast cache off casts per matmul, and its gradients are the same, bit for bit."""
    from unirl.testing import build_actor

    class CountCasts(TorchDispatchMode):
        def __init__(self, params):
            super().__init__()
            self.ptrs, self.casts = {p.data_ptr() for p in params}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                    and args[0].data_ptr() in self.ptrs):
                self.casts.append(args[0].data_ptr())
            return func(*args, **kwargs)

    config = make_config(actor={"micro_batch_size": 2, "options": {"compute_dtype": "bfloat16"}})
    samples = make_samples(6)  # 3 micro-batches

    def run(cache: bool):
        actor = build_actor(config, adapter=Qwen3Adapter(), model=tiny_model(config))
        if not cache:
            actor._compute = lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        batch = make_batch(actor, samples)
        with CountCasts(actor.model.parameters()) as mode:
            grads, _ = step_grads(actor, samples, batch)
        return grads, mode.casts

    grads, casts = run(cache=True)
    uncached, many = run(cache=False)
    assert casts and len(casts) == len(set(casts))  # every weight a matmul reads, once
    assert len(many) >= 3 * len(casts)  # per matmul, in each of the 3 micro-batches
    assert grads.keys() == uncached.keys()
    for i, g in grads.items():
        assert (g is None) == (uncached[i] is None)
        assert g is None or torch.equal(g, uncached[i]), i


def test_compute_dtype_is_validated_by_name():
    from unirl.kernel.errors import UniRLError
    from unirl.testing import build_actor

    config = make_config(actor={"options": {"compute_dtype": "float16"}})
    with pytest.raises(UniRLError, match=r"actor\.options\.compute_dtype"):
        build_actor(config, adapter=Qwen3Adapter(), model=tiny_model(config))


@pytest.mark.slow
@pytest.mark.background  # make test: beside the suite, at idle priority on one thread
def test_compile_option_compiles_the_regions_at_start_up_and_keeps_the_update():
    """``actor.options.compile``: every MLP and RMSNorm is compiled at start-up by the warm-up, whose time
    the first RL step reports once as ``compile_s``; the training step then compiles nothing new (dynamic
    shapes: its packed lengths differ from the warm-up's). Oracle: the same actor eager. The replayed
    log-probs and the update's gradients agree to fp32 rounding (the compiled kernels fuse ops), and the
    parameter names, which checkpoints and weight sync read, do not change."""
    from torch._dynamo.utils import counters

    from unirl.actor.torch_actor import TorchActorOptions

    config = make_config(actor={"micro_batch_size": 2})
    samples = make_samples(6)
    eager = make_actor(config)
    compiled = make_actor(config, options=TorchActorOptions(compile=True))
    regions = [m for m in compiled.model.modules() if type(m).__name__.endswith(("MLP", "RMSNorm"))]
    assert regions and all(m._compiled_call_impl is not None for m in regions)
    assert compiled._compile_s > 0 and eager._compile_s is None
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    warm_up_s, graphs = compiled._compile_s, counters["stats"]["unique_graphs"]
    for a, b in zip(compiled.logprobs(samples), eager.logprobs(samples), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    batch = make_batch(eager, samples)
    (g_compiled, m_compiled), (g_eager, m_eager) = step_grads(compiled, samples, batch), step_grads(eager, samples, batch)
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up compiled every graph the step runs
    for i, g in g_eager.items():
        assert g is None or torch.allclose(g_compiled[i], g, atol=1e-5, rtol=1e-4), i
    assert m_compiled["compile_s"] == warm_up_s  # reported once, by the first step
    assert "compile_s" not in m_eager and "compile_s" not in step_grads(compiled, samples, batch)[1]


def test_compile_option_is_refused_with_lora_before_the_model_is_built():
    from unirl.actor.torch_actor import TorchActorOptions
    from unirl.kernel.errors import ConfigError

    config = make_config(actor={"lora": {"r": 4}})
    with pytest.raises(ConfigError, match="actor.options.compile: not with actor.lora"):
        TorchActor(config=config, adapter=Qwen3Adapter(), model=None, runtime=default_runtime(config),
                   options=TorchActorOptions(compile=True))
