"""Contract tests for the core seams the trainer owns: preflight traits and pairings, the one hook
caller, and validation of every engine's output. Each fails if its seam breaks."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from unirl.config import load_config
from unirl.contracts import EngineCapabilities, traits_of
from unirl.kernel import PreflightError, SampleError, load_kernel
from unirl.kernel.hookspecs import hookimpl
from unirl.preflight import preflight
from unirl.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.steps=1", "trainer.prompts_per_step=2", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.plot=false", "data.arith.n_train=8", "data.arith.n_eval=2", "rollout.n=2",
        "rollout.max_new_tokens=3", "trainer.eval_k=1", "model.build={hidden_size: 64, intermediate_size: 128}"]


def tiny(tmp_path, *extra):
    return load_config(ROOT / "recipes" / "arith-tiny.yaml",
                       [*TINY, f"run.output_dir={tmp_path}", "run.name=t", "sft.steps=0", *extra])


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


# ------------------------------------------------------------------------------------- preflight


def test_bad_estimator_options_fail_in_preflight_before_any_model_is_built(tmp_path, monkeypatch):
    built = []
    from unirl.models.qwen3 import Qwen3Adapter

    monkeypatch.setattr(Qwen3Adapter, "build_model", lambda *a, **k: built.append(1))
    config = tiny(tmp_path, "algorithm.estimator_options={scope: everywhere, colour: red}")
    with pytest.raises(PreflightError) as err:
        train(config, load_kernel())
    fields = {v.field for v in err.value.violations}
    assert {"algorithm.estimator_options.scope", "algorithm.estimator_options.colour"} <= fields
    assert not built and not (tmp_path / "t").exists()


def test_estimator_traits_replace_name_checks():
    kernel = load_kernel()
    grpo = traits_of(kernel.get("advantage_estimators", "grpo").load())
    gae = traits_of(kernel.get("advantage_estimators", "gae").load())
    assert grpo.needs_groups and grpo.min_n == 2 and not grpo.needs_values
    assert gae.needs_values and not gae.needs_groups
    # a plugin estimator declaring min_n=3 is enforced by preflight from its traits alone
    from unirl.algorithms.advantages import estimator, group_layers

    @group_layers("root", "fork")
    @estimator(needs_groups=True, min_n=3)
    def trio(samples, *, options, algorithm, values=None):  # pragma: no cover - never called
        raise AssertionError

    plugin = _module("trio_plugin", unirl_advantage_estimators=hookimpl(lambda: {"trio": trio}))
    k = load_kernel(extra=[("trio", plugin)])
    fields = {v.field for v in preflight(load_config(None, ["algorithm.estimator=trio", "rollout.n=2"]), k)}
    assert "rollout.n" in fields
    assert "rollout.n" not in {v.field for v in preflight(load_config(None, ["algorithm.estimator=trio",
                                                                             "rollout.n=3"]), k)}
    # under group_layer: fork a group is one fork point's branches: rollout.branching.n must reach min_n too
    def fork_fields(branches: int) -> set[str]:
        return {v.field for v in preflight(load_config(None, [
            "algorithm.estimator=trio", "rollout.n=3", "algorithm.group_layer=fork",
            f"rollout.branching={{at_turns: [1], n: {branches}}}"]), k)}

    assert "rollout.branching.n" in fork_fields(2) and "rollout.branching.n" not in fork_fields(3)


def test_engine_capabilities_checked_against_weight_sync_and_logp_source():
    from unirl.engine.torch_engine import TorchEngine

    class Processed(TorchEngine):
        @classmethod
        def capabilities(cls, config, options=None):
            return EngineCapabilities(weight_syncs=("inprocess",), logprobs="processed")

    plugin = _module("processed_plugin", unirl_rollout_engines=hookimpl(lambda: {"processed": Processed}))
    k = load_kernel(extra=[("processed", plugin)])
    cfg = load_config(None, ["rollout.engine=processed", "algorithm.old_logp_source=rollout",
                             "weight_sync.name=inprocess"])
    fields = {v.field: v for v in preflight(cfg, k)}
    assert "rollout.logprobs" in fields and "set rollout.logprobs: processed" in fields["rollout.logprobs"].fix
    # the actor replays processed log-probs too: then they are pi_old, and the pairing holds
    agreed = load_config(None, ["rollout.engine=processed", "algorithm.old_logp_source=rollout",
                                "weight_sync.name=inprocess", "rollout.logprobs=processed"])
    assert not [v for v in preflight(agreed, k) if v.field in ("rollout.logprobs", "algorithm.old_logp_source")]
    cfg = load_config(None, ["rollout.engine=torch", "weight_sync.name=inprocess"])
    assert not [v for v in preflight(cfg, k) if v.field in ("weight_sync.name", "rollout.logprobs")]


def test_unknown_environment_tool_and_exporter_names_are_violations():
    cfg = load_config(None, ["rollout.environment=nowhere", "rollout.tools=[hammer]", "trace.exporter=nope"])
    fields = {v.field for v in preflight(cfg, load_kernel())}
    assert {"rollout.environment", "rollout.tools[0]", "trace.exporter"} <= fields


def test_non_contract_factory_is_a_violation():
    class NotAnEngine:
        pass

    plugin = _module("bad_engine", unirl_rollout_engines=hookimpl(lambda: {"bad": NotAnEngine}))
    k = load_kernel(extra=[("bad", plugin)])
    v = [v for v in preflight(load_config(None, ["rollout.engine=bad"]), k) if v.field == "rollout.engine"]
    assert v and "not a RolloutEngine subclass" in v[0].message


# ------------------------------------------------------------------------------------- hooks


def test_kernel_call_passes_declared_args_and_names_the_plugin_that_raised():
    seen = []
    a = _module("hook_a", unirl_on_step_end=hookimpl(lambda step: seen.append(("a", step))))
    b = _module("hook_b", unirl_on_step_end=hookimpl(lambda step, metrics, config: seen.append(("b", metrics))))
    k = load_kernel(discover=False, extra=[("a", a), ("b", b)])
    k.call("unirl_on_step_end", step=3, metrics={"x": 1}, config=None)
    assert seen == [("a", 3), ("b", {"x": 1})]

    def boom(step):
        raise RuntimeError("gate")

    c = _module("hook_c", unirl_on_step_end=hookimpl(boom))
    k = load_kernel(discover=False, extra=[("c", c)])
    with pytest.raises(RuntimeError) as err:
        k.call("unirl_on_step_end", step=0, metrics={}, config=None)
    assert "plugin 'c'" in "".join(getattr(err.value, "__notes__", []))


def test_kernel_spec_rebuilds_in_process_registrations(tmp_path):
    mod_dir = tmp_path / "pkgroot"
    mod_dir.mkdir()
    (mod_dir / "spec_probe_plugin.py").write_text(
        "from unirl.kernel import hookimpl\n@hookimpl\ndef unirl_rewards():\n    return {'probe': len}\n")
    sys.path.insert(0, str(mod_dir))
    try:
        import spec_probe_plugin

        kernel = load_kernel(discover=False, extra=[("probe", spec_probe_plugin)])
        spec = kernel.spec()
        sys.modules.pop("spec_probe_plugin")
        sys.path.remove(str(mod_dir))
        rebuilt = spec.load()  # a fresh process would do exactly this
        assert rebuilt.names("rewards") == ["probe"]
    finally:
        if str(mod_dir) in sys.path:
            sys.path.remove(str(mod_dir))


def test_on_rollout_gets_phase_step_version_and_timed_samples(tmp_path):
    calls = []

    def on_rollout(phase, step, version, samples):
        calls.append((phase, step, version, len(samples), all(s.requests and s.requests[-1].finished_ms > 0
                                                              for s in samples)))

    plugin = _module("rollout_probe", unirl_on_rollout=hookimpl(on_rollout))
    train(tiny(tmp_path), load_kernel(extra=[("probe", plugin)]))
    assert [(c[0], c[1]) for c in calls] == [("eval", 0), ("train", 0), ("eval", 1)]
    assert [c[2] for c in calls] == [1, 1, 2]  # the version each batch was served with
    assert all(c[4] for c in calls)


# ------------------------------------------------------------------------------------- engine output


def test_malformed_engine_output_is_caught_naming_the_sample_and_engine(tmp_path):
    from unirl.engine.torch_engine import TorchEngine

    class Sloppy(TorchEngine):
        merges_jobs = False  # its _run is the point: every job runs through it (no merged batches)

        def _run(self, samples, sampling, should_stop, version):
            super()._run(samples, sampling, should_stop, version)
            samples[-1].rollout_logprobs.pop()  # one log-prob short: an engine bug

    plugin = _module("sloppy", unirl_rollout_engines=hookimpl(lambda: {"sloppy": Sloppy}))
    with pytest.raises(SampleError) as err:
        train(tiny(tmp_path, "rollout.engine=sloppy"), load_kernel(extra=[("sloppy", plugin)]))
    msg = str(err.value)
    assert "sloppy" in msg and "rollout_logprobs" in msg and "@eval-0/" in msg


def test_loss_modifier_reweights_tokens_and_reports_metrics(tmp_path):
    import torch

    def zero_weights(samples, batch, config):
        batch["token_weights"] = [torch.zeros(len(s.response_ids)) for s in samples]
        return {"probe_weight_mean": 0.0}

    plugin = _module("zero_mod", unirl_loss_modifiers=hookimpl(lambda: {"zero": zero_weights}))
    result = train(tiny(tmp_path, "algorithm.modifiers=[zero]"), load_kernel(extra=[("zero", plugin)]))
    step = result.history[-1]
    assert step["probe_weight_mean"] == 0.0
    assert step["pg_loss"] == 0.0  # every token weighted 0: the policy-gradient term vanishes


def test_fingerprint_is_the_documented_sha256_and_sees_every_field():
    """The receipt's oracle: sha256 over the ordered (name, shape, dtype, bytes) of the tensors."""
    import hashlib

    import torch

    from unirl.contracts import fingerprint

    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(16391, generator=g), torch.randn(3, 5, generator=g)
    named = [("a.weight", big), ("b.bias", small)]
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.numpy().tobytes())
    assert fingerprint(named) == h.hexdigest()
    base = fingerprint(named)
    flipped = big.clone()
    flipped[-1] = torch.nextafter(flipped[-1], torch.tensor(float("inf")))  # one ulp of one element
    for changed in ([("a.weight", flipped), ("b.bias", small)], [("b.bias", small), ("a.weight", big)],
                    [("a.weight2", big), ("b.bias", small)], [("a.weight", big), ("b.bias", small.reshape(5, 3))],
                    [("a.weight", big), ("b.bias", small.double())]):
        assert fingerprint(changed) != base
