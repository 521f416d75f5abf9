"""Checkpoints: bit-exact resume, atomicity under a crash mid-save, the latest pointer."""

from __future__ import annotations

import random

import pytest
import torch

from unirl.actor import checkpoint as ckpt
from unirl.actor.torch_actor import TorchActor
from unirl.config import RunConfig
from unirl.models.qwen3 import Qwen3Adapter
from unirl.samples import Sample
from unirl.testing import default_runtime

VOCAB = 64


def make_actor(**actor) -> TorchActor:
    from transformers import Qwen3ForCausalLM

    config = RunConfig.model_validate({
        "trainer": {"steps": 8},
        "actor": {"lr": 1e-3, "micro_batch_size": 3, "lr_schedule": "cosine", "warmup_steps": 2, **actor},
        "algorithm": {"kl_coef": 0.05},
    })
    cfg = Qwen3Adapter().hf_config(config, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    return TorchActor(config=config, runtime=default_runtime(config), adapter=Qwen3Adapter(), model=Qwen3ForCausalLM(cfg))


def samples_for(step: int) -> list[Sample]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(4):
        r = int(torch.randint(2, 6, (1,), generator=g))
        out.append(Sample(id=f"p{i}/0", prompt_ids=torch.randint(2, VOCAB, (3,), generator=g).tolist(),
                          response_ids=torch.randint(2, VOCAB, (r,), generator=g).tolist(), loss_mask=[1] * r))
    return out


def train(actor: TorchActor, steps: range) -> None:
    for step in steps:
        samples = samples_for(step)
        old = actor.logprobs(samples)
        # advantages drawn from the global RNG: resume must restore it too
        batch = {"old_logprobs": old, "advantages": [torch.randn(o.shape) for o in old]}
        if actor.value_head is not None:
            batch["returns"] = [torch.randn(o.shape) for o in old]
            batch["old_values"] = actor.values(samples)
        actor.train_step(samples, batch)
        if step == 1:
            actor.sft_step(samples)


def params(actor: TorchActor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor._train_params()]


@pytest.mark.parametrize("value_head", [False, True])
def test_resume_is_bit_exact(tmp_path, value_head):
    torch.manual_seed(7)
    random.seed(7)
    a = make_actor(value_head=value_head)
    train(a, range(3))
    a.save(str(tmp_path / "ckpt" / "step_3"), extra={"cursor": 12, "step": 3})
    train(a, range(3, 6))
    p6 = params(a)

    torch.manual_seed(123)  # a different RNG state: load must restore the saved one
    b = make_actor(value_head=value_head)
    extra = b.load(str(tmp_path / "ckpt"))  # via the latest pointer
    assert extra == {"cursor": 12, "step": 3}
    assert b.step == 3
    assert b.scheduler.last_epoch == 3
    train(b, range(3, 6))
    for x, y in zip(params(b), p6, strict=True):
        assert torch.equal(x, y)
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    a = make_actor()
    train(a, range(2))
    root = tmp_path / "ckpt"
    a.save(str(root / "step_2"), extra={"step": 2})
    saved = params(a)
    train(a, range(2, 3))

    real = ckpt._write_torch
    calls = {"n": 0}

    def failing(obj, path):
        calls["n"] += 1
        if calls["n"] == 2:  # after the weights and optim.pt were written
            raise OSError("disk full")
        real(obj, path)

    monkeypatch.setattr(ckpt, "_write_torch", failing)
    with pytest.raises(OSError, match="disk full"):
        a.save(str(root / "step_3"), extra={"step": 3})
    # an overwrite of the same checkpoint that crashes keeps the old one too
    calls["n"] = 0
    with pytest.raises(OSError, match="disk full"):
        a.save(str(root / "step_2"), extra={"step": 99})
    monkeypatch.setattr(ckpt, "_write_torch", real)

    assert (root / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no temp dirs left
    b = make_actor()
    assert b.load(str(root)) == {"step": 2}
    for x, y in zip(params(b), saved, strict=True):
        assert torch.equal(x, y)


def test_hard_crash_leftovers_are_ignored_and_cleaned(tmp_path):
    a = make_actor()
    root = tmp_path / "ckpt"
    a.save(str(root / "step_1"))
    # a process killed mid-save leaves a temp dir that no pointer names
    stale = root / "step_2.tmp-99999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"garbage")
    assert ckpt.latest_checkpoint(root) == root / "step_1"
    a.save(str(root / "step_2"))
    assert not stale.exists()
    assert ckpt.latest_checkpoint(root) == root / "step_2"


def test_crash_between_renames_recovers_old(tmp_path):
    """Killed after moving an overwritten checkpoint aside, before renaming the new one in."""
    a = make_actor()
    root = tmp_path / "ckpt"
    a.save(str(root / "step_1"), extra={"v": 1})
    (root / "step_1").rename(root / "step_1.old-424242")
    assert ckpt.latest_checkpoint(root) == root / "step_1.old-424242"
    b = make_actor()
    assert b.load(str(root)) == {"v": 1}
    a.save(str(root / "step_2"), extra={"v": 2})  # a later save of another name cleans nothing it shouldn't
    a.save(str(root / "step_1"), extra={"v": 3})  # the same name: restores then replaces
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]
    assert b.load(str(root)) == {"v": 3}


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        make_actor().load(str(tmp_path))


def test_rng_state_roundtrip(tmp_path):
    import numpy as np

    model = torch.nn.Linear(2, 2)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    ckpt.save_checkpoint(tmp_path / "c", model=model, extra={"a": [1, 2]})
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    with torch.no_grad():
        model.weight.zero_()
    assert ckpt.load_checkpoint(tmp_path, model=model) == {"a": [1, 2]}
    assert model.weight.abs().sum() > 0
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect[0]) and got[1:] == expect[1:]


# ------------------------------------------------------------------------------------------ retention


def fake_checkpoints(root, steps, latest):
    for s in steps:
        d = root / f"step_{s:06d}"
        d.mkdir(parents=True)
        (d / ckpt.META_FILE).write_text("{}")
    ckpt.write_pointer(root, f"step_{latest:06d}")


def test_retained_steps():
    assert ckpt.retained_steps(range(1, 11), keep_last=3, keep_every=0) == {8, 9, 10}
    assert ckpt.retained_steps(range(1, 11), keep_last=2, keep_every=4) == {4, 8, 9, 10}
    assert ckpt.retained_steps(range(1, 11), keep_last=0, keep_every=4) == set(range(1, 11))
    assert ckpt.retained_steps([1, 2, 3], keep_last=1, keep_every=0, latest=2) == {2, 3}


def test_prune_oldest_first_never_the_latest(tmp_path):
    fake_checkpoints(tmp_path, range(1, 8), latest=7)
    (tmp_path / "step_000009.tmp-1").mkdir()  # a crashed save is not a checkpoint and not pruned here
    removed = ckpt.prune_checkpoints(tmp_path, keep_last=2, keep_every=3)
    assert [p.name for p in removed] == ["step_000001", "step_000002", "step_000004", "step_000005"]
    assert sorted(ckpt.checkpoint_steps(tmp_path)) == [3, 6, 7]
    assert ckpt.prune_checkpoints(tmp_path, keep_last=0) == []


def test_prune_without_a_pointer_deletes_nothing(tmp_path):
    for s in (1, 2, 3, 4):
        (tmp_path / f"step_{s:06d}").mkdir()
        (tmp_path / f"step_{s:06d}" / ckpt.META_FILE).write_text("{}")
    assert ckpt.prune_checkpoints(tmp_path, keep_last=1) == []
    assert len(ckpt.checkpoint_steps(tmp_path)) == 4


def test_kill_mid_prune_keeps_what_was_promised(tmp_path, monkeypatch):
    """A kill between the rename and the rmtree: the kept checkpoints are whole, the leftover is no
    checkpoint, and the resume's cleanup removes it."""
    fake_checkpoints(tmp_path, range(1, 6), latest=5)

    def killed(path, *a, **k):
        raise KeyboardInterrupt("SIGKILL stand-in")

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(tmp_path, keep_last=3)
    monkeypatch.undo()
    assert sorted(ckpt.checkpoint_steps(tmp_path)) == [2, 3, 4, 5]
    assert list(tmp_path.glob(".prune-*"))
    (tmp_path / "step_000006.tmp-99").mkdir()
    (tmp_path / ".latest.tmp-99").write_text("x")
    ckpt.clean_checkpoint_root(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", *[f"step_{s:06d}" for s in (2, 3, 4, 5)]]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000005"


def test_phase_callback_sees_every_save_phase_in_order(tmp_path):
    """The soak drills kill at these labels: a renamed or skipped phase would move their kills."""
    seen: list[str] = []
    previous = ckpt.set_phase_callback(seen.append)
    try:
        ckpt.save_checkpoint(tmp_path / "step_000001", model=torch.nn.Linear(2, 2))
    finally:
        ckpt.set_phase_callback(previous)
    files = [ckpt.MODEL_FILE, ckpt.OPTIM_FILE, ckpt.RNG_FILE, ckpt.EXTRA_FILE]
    assert seen == ["save:step_000001:begin", *[f"save:step_000001:{f}" for f in files], "commit:step_000001"]
    ckpt.save_checkpoint(tmp_path / "step_000002", model=torch.nn.Linear(2, 2))
    assert len(seen) == 6  # uninstalled: the second save called nothing
