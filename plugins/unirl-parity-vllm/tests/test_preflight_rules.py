"""Every parity preflight rule, one bad recipe (a shipped parity recipe plus overrides) each (issue 31,
items 3-5).

Why one test per rule: a rule is only worth what proves it fires. Each case asserts that the rule's
violation, and nothing else, comes back from ``unirl_preflight`` on a recipe that is clean without the
overrides (``test_shipped_parity_recipes_are_clean``), and that it names the field, the value and a
fix. The opt-in rules (item 4) also go through ``unirl train`` itself, to show the refusal comes before
Ray starts, before the run directory exists and before any model is built.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from unirl.api import Qwen3Adapter, hookimpl, load_config, load_kernel
from unirl.models.qwen3_moe import Qwen3MoeAdapter
from unirl_parity_vllm import plugin, profile
from unirl_parity_vllm.artifact import SCHEMA

ROOT = Path(__file__).resolve().parents[3]
FLAG = "UNIRL_PARITY_ENABLE"


def cfg(recipe: str, *overrides: str):
    return load_config(str(ROOT / "recipes" / f"{recipe}.yaml"), list(overrides))


def check(config, adapter=None, kernel=None) -> list:
    return plugin.unirl_preflight(config, adapter if adapter is not None else Qwen3Adapter(),
                                  kernel if kernel is not None else load_kernel())


@pytest.fixture
def flag_on(monkeypatch):
    monkeypatch.setenv(FLAG, "1")
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)


@pytest.fixture
def flag_off(monkeypatch):
    monkeypatch.delenv(FLAG, raising=False)
    monkeypatch.delenv("UNIRL_PARITY_DIR", raising=False)


def only(violations: list, field: str, *words: str, fix: str):
    """The one violation, at ``field``, its message holding ``words`` (the values) and its fix ``fix``."""
    assert [v.field for v in violations] == [field], [str(v) for v in violations]
    v = violations[0]
    assert v.source == "unirl-parity-vllm"
    for w in words:
        assert w in v.message, (w, str(v))
    assert fix in v.fix, (fix, str(v))
    return v


@pytest.mark.parametrize("recipe", ["parity-tiny", "parity-tiny-embedded", "parity-moe-tiny",
                                    "parity-moe-tiny-embedded", "parity-tiny-tp2", "parity-moe-tiny-tp2",
                                    "parity-tiny-bf16-embedded", "parity-tiny-bf16", "parity-moe-tiny-bf16-tp2",
                                    "parity-moe-tiny-bf16-embedded"])
def test_shipped_parity_recipes_are_clean(flag_on, recipe):
    """The baseline every case below breaks in one place: no violation, so each case's one is its own."""
    adapter = Qwen3MoeAdapter() if "moe" in recipe else Qwen3Adapter()
    assert check(cfg(recipe), adapter) == []


def test_raw_logprobs_stay_available(flag_on):
    """processed_logprobs is the profile's default; a profile that declares raw_logprobs runs raw, on both
    paths (and the recorded profile says which)."""
    assert profile.ParityProfile().logprobs_mode == profile.CONTRACT.logprobs_modes[0] == "processed_logprobs"
    raw = ["rollout.logprobs=raw", "plugins.parity.logprobs_mode=raw_logprobs"]
    assert check(cfg("parity-tiny-embedded", *raw)) == []
    vllm = [*raw, "rollout.options.logprobs_mode=raw_logprobs", "plugins.parity.engine_switches.logprobs_mode=raw_logprobs"]
    assert check(cfg("parity-tiny", *vllm)) == []
    assert profile.profile_of(cfg("parity-tiny", *vllm)).logprobs_mode == "raw_logprobs"
    assert profile.profile_of(cfg("parity-tiny")).logprobs_mode == "processed_logprobs"
    assert profile.profile_of(cfg("parity-tiny-embedded")).logprobs_mode == "processed_logprobs"


# --------------------------------------------------------------------------------- item 4: opt-in rules
def test_recipe_opt_in_without_the_flag_is_refused(flag_off):
    """Today's hole: a recipe that says parity, run without the flag, trained with no gate."""
    only(check(cfg("parity-tiny-embedded")), f"plugins.parity.enabled, env {FLAG}",
         "plugins.parity.enabled: true", f"{FLAG} is not set", "no parity check",
         fix=f"run with {FLAG}=1")


@pytest.mark.parametrize("value", ["0", "true", ""])
def test_a_flag_that_is_not_1_is_named_with_its_value(monkeypatch, value):
    monkeypatch.setenv(FLAG, value)
    v = only(check(cfg("parity-tiny-embedded")), f"plugins.parity.enabled, env {FLAG}", f"{FLAG} is {value!r}",
             fix="or set plugins.parity.enabled: false")
    assert f"{FLAG}=1" in v.fix


def test_no_recipe_opt_in_and_no_flag_is_todays_behaviour(flag_off):
    """The flag absent, the recipe not opting in: nothing to say (every hook a no-op)."""
    assert check(cfg("parity-tiny-embedded", "plugins.parity.enabled=false")) == []
    assert check(cfg("arith-tiny")) == []


def test_flag_without_the_recipe_opt_in_keeps_todays_violation(flag_on):
    only(check(cfg("parity-tiny-embedded", "plugins.parity.enabled=false")), "plugins.parity.enabled",
         f"{FLAG}=1 but the recipe does not opt in", fix="add plugins: {parity: {enabled: true}}")


def test_a_non_boolean_opt_in_is_named(flag_off):
    only(check(cfg("parity-tiny-embedded", "plugins.parity.enabled=maybe")), "plugins.parity.enabled",
         "'maybe' is not a boolean", fix="set plugins.parity.enabled: true")


def test_unirl_train_refuses_before_ray_the_run_dir_or_a_model(flag_off, tmp_path, monkeypatch, capsys):
    """Through the CLI, on the vLLM + FSDP recipe (the one that would start Ray): exit 2 with the one
    line, no run directory, Ray not initialised, no model built."""
    from unirl.cli import main

    built = []
    for cls in (Qwen3Adapter, Qwen3MoeAdapter):
        monkeypatch.setattr(cls, "build_model", lambda self, *a, **k: built.append(1))
    assert main(["train", str(ROOT / "recipes" / "parity-tiny.yaml"), f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: preflight: [unirl-parity-vllm] plugins.parity.enabled, env {FLAG}: ")
    assert f"fix: run with {FLAG}=1" in err and "plugins.parity.enabled: false" in err
    assert list(tmp_path.iterdir()) == [] and built == []
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
    # the fix works: with the recipe's opt-in off, preflight passes
    assert main(["preflight", str(ROOT / "recipes" / "parity-tiny-embedded.yaml"), "plugins.parity.enabled=false"]) == 0


# ---------------------------------------------------------------------- item 5: one bad recipe per rule
RULES = [
    # (rule, recipe, overrides, field, words in the message, words in the fix)
    ("updates_per_batch", "parity-tiny-embedded", ["algorithm.updates_per_batch=2"], "algorithm.updates_per_batch",
     ["2 updates per batch"], "set it to 1"),
    ("dtype", "parity-tiny-bf16-embedded", ["actor.name=fsdp", "plugins.parity.topology={}"], "model.dtype",
     ["bfloat16 parity is experimental with rollout.engine torch and actor.name fsdp"],
     "plugins.parity.experimental: true"),
    ("switch enforce_eager", "parity-tiny", ["rollout.options.enforce_eager=false", "plugins.parity.engine_switches={}"],
     "rollout.options.enforce_eager", ["enforce_eager=False", "needs True"], "set enforce_eager: True"),
    ("switch prefix caching", "parity-tiny",
     ["rollout.options.enable_prefix_caching=true", "plugins.parity.engine_switches={}"],
     "rollout.options.enable_prefix_caching", ["enable_prefix_caching=True"], "set enable_prefix_caching: False"),
    ("logprobs_mode: raw_logits", "parity-tiny", ["rollout.options.logprobs_mode=raw_logits",
                                                   "plugins.parity.engine_switches={}"],
     "rollout.options.logprobs_mode", ["logprobs_mode 'raw_logits' is not supported", "return logits"],
     "set rollout.options.logprobs_mode: processed_logprobs"),
    ("logprobs_mode: processed_logits", "parity-tiny", ["rollout.options.logprobs_mode=processed_logits",
                                                         "plugins.parity.engine_switches={}"],
     "rollout.options.logprobs_mode", ["logprobs_mode 'processed_logits' is not supported"],
     "set rollout.options.logprobs_mode: processed_logprobs"),
    ("logprobs_mode: the default is processed", "parity-tiny-embedded",
     ["rollout.logprobs=raw", "plugins.parity.logprobs_mode=processed_logprobs"], "plugins.parity.logprobs_mode",
     ["profile says 'processed_logprobs' (the default), the run has 'raw_logprobs'"], "set rollout.logprobs: processed"),
    ("logprobs_mode: vLLM's against the profile", "parity-tiny",
     ["rollout.options.logprobs_mode=raw_logprobs", "plugins.parity.engine_switches={}"], "plugins.parity.logprobs_mode",
     ["the run has 'raw_logprobs'"], "set rollout.options.logprobs_mode: processed_logprobs"),
    ("logprobs_mode: a raw profile", "parity-tiny-embedded", ["plugins.parity.logprobs_mode=raw_logprobs"],
     "plugins.parity.logprobs_mode", ["profile says 'raw_logprobs', the run has 'processed_logprobs'"],
     "set rollout.logprobs: raw, or declare plugins.parity.logprobs_mode: processed_logprobs"),
    ("min_new_tokens with processed", "parity-tiny-embedded", ["rollout.min_new_tokens=2"], "rollout.min_new_tokens",
     ["min_new_tokens 2 with processed log-probs"], "set rollout.min_new_tokens: 0"),
    ("package pin", "parity-tiny-embedded", ["plugins.parity.packages={torch: 0.0.1}"], "plugins.parity.packages.torch",
     ["profile pins torch==0.0.1, installed: 2.13"], "pip install torch==0.0.1"),
    ("profile mismatch: topology", "parity-tiny", ["plugins.parity.topology.actor_ranks=4"],
     "plugins.parity.topology.actor_ranks", ["profile says 4, the run has 2"], "make the recipe match its profile"),
    ("profile mismatch: sampling", "parity-tiny-embedded", ["plugins.parity.sampling.temperature=0.5"],
     "plugins.parity.sampling.temperature", ["profile says 0.5, the run has 0.8"], "make the recipe match"),
    ("profile mismatch: weight sync", "parity-tiny-embedded", ["plugins.parity.weight_sync=vllm"], "weight_sync.name",
     ["profile says 'vllm', the run has 'inprocess'"], "make the recipe match"),
    ("profile mismatch: engine workers", "parity-tiny", ["plugins.parity.topology.engine_workers=2"],
     "plugins.parity.topology.engine_workers", ["profile says 2, the run has 1"], "make the recipe match"),
    ("compute_dtype", "parity-tiny", ["actor.options.compute_dtype=bfloat16"], "actor.options.compute_dtype",
     ["compute_dtype bfloat16 with model.dtype float32"], "leave compute_dtype unset"),
    ("compute_dtype: the embedded actor's autocast", "parity-tiny-embedded", ["actor.options.compute_dtype=bfloat16"],
     "actor.options.compute_dtype", ["compute_dtype bfloat16 with model.dtype float32"], "leave compute_dtype unset"),
    ("compute_dtype: fp32 parameters on the bf16 profile", "parity-tiny-bf16", ["actor.options.compute_dtype=float32"],
     "actor.options.compute_dtype", ["compute_dtype float32 with model.dtype bfloat16", "one mixed-precision setup"],
     "leave compute_dtype unset"),
    ("compile: the embedded actor's regions", "parity-tiny-embedded", ["actor.options.compile=true"],
     "actor.options.compile", ["torch.compile fuses the MLP and RMSNorm ops"], "leave actor.options.compile unset"),
    # a bf16 engine against an fp32 replay: vLLM told to serve bf16 apart from model.dtype (it passed before)
    ("engine dtype: bf16 engine, fp32 replay", "parity-tiny", ["rollout.options.engine_args={dtype: bfloat16}"],
     "rollout.options.engine_args.dtype", ["the engine would serve bfloat16 weights while the actor replays in "
                                            "model.dtype float32"], "remove it"),
    ("engine dtype: the embedded engine", "parity-tiny-embedded", ["rollout.options.dtype=bfloat16"],
     "rollout.options.dtype", ["the engine would serve bfloat16 weights while the actor replays in model.dtype float32"],
     "set model.dtype: bfloat16"),
    ("TP size", "parity-tiny", ["rollout.options.tensor_parallel_size=3"], "rollout.options.tensor_parallel_size",
     ["tensor_parallel_size 3", "verified with 1, 2 only"], "set tensor_parallel_size to one of 1, 2"),
    ("TP size via engine_args", "parity-tiny", ["rollout.options.engine_args={tensor_parallel_size: 4}"],
     "rollout.options.tensor_parallel_size", ["tensor_parallel_size 4"], "set tensor_parallel_size to one of 1, 2"),
    ("revision", "parity-tiny-embedded", ["plugins.parity.model.revision=0123abc"], "plugins.parity.model.revision",
     ["profile says '0123abc', the run has 'build:"], "make the recipe match"),
    ("fingerprint format", "parity-tiny-embedded", ["plugins.parity.model.fingerprint=abc123"],
     "plugins.parity.model.fingerprint", ["'abc123' is not a weights fingerprint"], "weights.log"),
    ("invalid profile field", "parity-tiny-embedded", ["plugins.parity.dtype=float16"], "plugins.parity.dtype",
     ["(got 'float16')"], "fields of plugins.parity"),
    ("unknown profile key", "parity-tiny-embedded", ["plugins.parity.stirct=false"], "plugins.parity.stirct",
     ["Extra inputs are not permitted"], "strict"),
    ("engine", "parity-tiny-embedded", ["rollout.engine=sglang", "plugins.parity.topology={}"], "rollout.engine",
     ["engine 'sglang' has no parity installer"], "set rollout.engine to one of: torch, vllm"),
    ("actor", "parity-tiny-embedded", ["actor.name=megatron", "plugins.parity.topology={}"], "actor.name",
     ["actor 'megatron'"], "set actor.name to one of: torch, fsdp"),
    ("weight sync for the engine", "parity-tiny-embedded", ["weight_sync.name=vllm", "plugins.parity.weight_sync=null"],
     "weight_sync.name", ["'vllm' is not the verified sync for torch"], "set weight_sync.name: inprocess"),
    ("model feature: activation", "parity-tiny-embedded", ["model.build.hidden_act=gelu"], "model.build.hidden_act",
     ["hidden_act 'gelu'"], "hidden_act: silu"),
    ("LoRA", "parity-tiny-embedded", ["actor.lora={r: 4}"], "actor.lora",
     ["LoRA is not supported under the parity gate", "merged weights"], "remove actor.lora"),
    ("model feature: RoPE", "parity-tiny-embedded",
     ["model.build.rope_parameters={rope_type: linear, factor: 2.0, rope_theta: 10000.0}"],
     "model.build.rope_parameters", ["RoPE type 'linear'"], "default RoPE"),
]


@pytest.mark.parametrize(("rule", "recipe", "overrides", "field", "words", "fix"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_names_field_value_and_fix(flag_on, rule, recipe, overrides, field, words, fix):
    only(check(cfg(recipe, *overrides)), field, *words, fix=fix)


def test_strict_mode_refuses_an_unverified_version_and_non_strict_admits_it(flag_on, monkeypatch):
    """strict (the default) refuses a package outside the verified prefixes; ``strict: false`` admits
    it (the vLLM side still checks every symbol and op, ``test_strict_mode_on_the_vllm_side``)."""
    real = profile._version
    monkeypatch.setattr(profile, "_version", lambda n: "2.99.0" if n == "torch" else real(n))
    only(check(cfg("parity-tiny-embedded")), "packages", "torch 2.99.0 is not a verified version (2.13.*)",
         "the profile is strict", fix="plugins.parity.strict: false")
    assert check(cfg("parity-tiny-embedded", "plugins.parity.strict=false")) == []
    # a version that is missing altogether is refused in both modes
    monkeypatch.setattr(profile, "_version", lambda n: None if n == "transformers" else real(n))
    for mode in ("true", "false"):
        only(check(cfg("parity-tiny-embedded", f"plugins.parity.strict={mode}")), "packages", "transformers None",
             fix="install transformers 5.*")


def test_strict_mode_reaches_the_vllm_side(flag_on, monkeypatch, tmp_path):
    """The vLLM side reads the profile's strict mode from the worker env the trainer sets."""
    from unirl_parity_vllm.vllm_side import STRICT_ENV, strict

    over = [f"run.output_dir={tmp_path}"]
    assert plugin.unirl_worker_env(cfg("parity-tiny", *over))[STRICT_ENV] == "1"
    assert plugin.unirl_worker_env(cfg("parity-tiny", *over, "plugins.parity.strict=false"))[STRICT_ENV] == "0"
    monkeypatch.delenv(STRICT_ENV, raising=False)
    assert strict()  # unset: fail closed
    monkeypatch.setenv(STRICT_ENV, "0")
    assert not strict()


def test_strict_mode_on_the_vllm_side(monkeypatch):
    """Phase 1 of the vLLM installer: a version outside the verified set is a problem only when strict;
    non-strict records it as unverified. A missing symbol is a problem either way."""
    pytest.importorskip("vllm")
    from unirl_parity_vllm.vllm_side import STRICT_ENV, installer, symbols

    monkeypatch.setitem(installer._STATE, "unverified", [])  # restored afterwards: no stale manifest entry
    monkeypatch.setattr(symbols, "SUPPORTED_VLLM", frozenset({"0.0.1"}))
    monkeypatch.setenv(STRICT_ENV, "1")
    strict = installer.preflight(adapters=[])
    assert any("is not a supported version (0.0.1)" in p and "strict" in p for p in strict), strict
    monkeypatch.setenv(STRICT_ENV, "0")
    loose = installer.preflight(adapters=[])
    assert not any("supported version" in p for p in loose), loose
    assert any("is not a supported version" in u for u in installer.manifest()["unverified"])
    assert installer.manifest()["strict"] is False
    moved = dataclasses.replace(symbols.COMMON[2], path="RMSNorm.no_such_forward")
    monkeypatch.setattr(symbols, "COMMON", (*symbols.COMMON, moved))
    problems = installer.preflight(adapters=[])
    assert any("no_such_forward" in p for p in problems), problems  # refused in non-strict mode too


# ----------------------------------------------------------------- item 3: families, providers, evidence
class _Family(Qwen3Adapter):
    def __init__(self, family):
        self.parity_adapter = family


def test_tp2_is_verified_for_the_listed_families_only(flag_on, monkeypatch):
    """TP2 (CONTRACT.tensor_parallel_sizes 1, 2) passes for qwen3 and qwen3_moe (the shipped TP2 recipes);
    a family outside CONTRACT.tensor_parallel_adapters is refused by name."""
    assert check(cfg("parity-tiny-tp2")) == []
    assert check(cfg("parity-moe-tiny-tp2"), Qwen3MoeAdapter()) == []
    monkeypatch.setattr(profile, "CONTRACT", profile.CONTRACT.model_copy(update={"tensor_parallel_adapters": ("qwen3",)}))
    only(check(cfg("parity-moe-tiny-tp2"), Qwen3MoeAdapter()),
         "rollout.options.tensor_parallel_size", "model family 'qwen3_moe'", "verified for qwen3 only",
         fix="set tensor_parallel_size: 1")


def test_unknown_family_is_refused(flag_on):
    only(check(cfg("parity-tiny-embedded"), _Family(None)), "model.adapter", "declares no parity_adapter",
         "qwen3, qwen3_moe", fix="add a parity provider")
    only(check(cfg("parity-tiny-embedded"), _Family("gpt2")), "model.adapter", "parity adapter 'gpt2'",
         "no installed plugin registers", fix="install the plugin that provides it")


def test_contract_parity_adapters_is_the_one_list():
    """What this distribution registers and what the contract calls profiled are the same list."""
    assert tuple(plugin.unirl_parity_providers()) == profile.CONTRACT.parity_adapters == ("qwen3", "qwen3_moe")


def _artifact(directory, verdict="pass", adapter="qwen3"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "artifact.json"
    path.write_text(json.dumps({"schema": SCHEMA, "verdict": verdict, "run": {"model_adapter": adapter}}))
    return path


def test_a_registered_family_without_profile_or_evidence_is_refused(flag_on, monkeypatch, tmp_path):
    """RFC: "new support enters through explicit profiles with reproducible parity evidence"."""
    monkeypatch.setattr(profile, "registered_parity_adapters", lambda kernel: {"qwen3", "qwen3_moe", "llamaish"})
    monkeypatch.setattr(profile, "provider_problem", lambda name, kernel: None)
    fam = _Family("llamaish")
    only(check(cfg("parity-tiny-embedded"), fam), "plugins.parity.evidence", "parity adapter 'llamaish'",
         "no plugins.parity.evidence is given", fix="plugins.parity.experimental: true")
    good = _artifact(tmp_path)
    assert check(cfg("parity-tiny-embedded", f"plugins.parity.evidence={good}"), fam) == []
    assert check(cfg("parity-tiny-embedded", "plugins.parity.experimental=true"), fam) == []
    for bad, words in ((_artifact(tmp_path / "f", "fail"), "verdict 'fail'"),
                       (_artifact(tmp_path / "o", adapter="other"), "of model adapter 'other'"),
                       (tmp_path / "missing.json", "cannot be read")):
        only(check(cfg("parity-tiny-embedded", f"plugins.parity.evidence={bad}"), fam), "plugins.parity.evidence",
             words, fix="plugins.parity.evidence")


class _BadProviders:
    """A plugin registering one provider that is no ParityProvider and one that is the bare ABC."""

    @hookimpl
    def unirl_parity_providers(self):
        return {"not_a_provider": "collections:OrderedDict", "abstract": "unirl.api:ParityProvider"}


def test_provider_registrations_are_checked_against_the_abc(flag_on, monkeypatch, tmp_path):
    """Checked in the run's kernel (the one preflight is given), where a test's registration lives."""
    from unirl.preflight import preflight

    kernel = load_kernel()
    kernel.register(_BadProviders(), entry_point="bad-providers", dist="test-bad-providers", version="0")
    assert "not a unirl.api.ParityProvider subclass" in profile.provider_problem("not_a_provider", kernel)
    assert "does not implement enabled, exact_context, install_engine" in profile.provider_problem("abstract", kernel)
    assert profile.provider_problem("qwen3", kernel) is None and profile.provider_problem("qwen3_moe", kernel) is None
    assert "not_a_provider" not in profile.registered_parity_adapters(load_kernel())  # a fresh kernel has none
    evidence = f"plugins.parity.evidence={_artifact(tmp_path)}"
    bad = [v for v in preflight(cfg("parity-tiny-embedded", evidence), kernel) if v.source == "unirl-parity-vllm"]
    assert bad == []  # qwen3 (the recipe's family) is fine; the bad registrations are not selected
    only(check(cfg("parity-tiny-embedded", evidence), _Family("not_a_provider"), kernel), "model.adapter",
         "parity adapter 'not_a_provider'", "collections:OrderedDict", "not a unirl.api.ParityProvider subclass",
         fix="a plugin bug")


# ------------------------------------------------------------------ item 3: revision and fingerprint
def test_the_profile_records_revision_engine_workers_and_the_initial_fingerprint(flag_on, tmp_path):
    from unirl.api import Receipt
    from unirl_parity_vllm.artifact import Recorder

    c = cfg("parity-tiny-embedded", f"run.output_dir={tmp_path}")
    p = profile.profile_of(c)
    assert p.model.revision.startswith("build:") and p.topology.engine_workers == 1
    assert profile.profile_of(cfg("parity-tiny-embedded", "run.seed=7")).model.revision != p.model.revision
    assert profile.profile_of(cfg("parity-tiny", "rollout.options.placement=ray", "rollout.options.replicas=3")
                              ).topology.engine_workers == 3
    assert profile.profile_of(cfg("parity-tiny", "rollout.options.tensor_parallel_size=2")).topology.engine_workers == 2
    rec = Recorder(c)
    rec.on_weights_published(1, [Receipt(worker=0, version=1, fingerprint="ab" * 32)])
    doc = rec.document()
    assert doc["profile"]["model"]["fingerprint"] == "ab" * 32 and doc["profile"]["model"]["revision"] == p.model.revision


def test_a_hub_snapshot_directory_gives_its_commit_as_the_revision(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--x--y" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert profile.model_revision(cfg("parity-tiny-embedded", f"model.path={snap}")) == commit
    other = tmp_path / "plain"
    other.mkdir()
    (other / "config.json").write_text('{"a": 1}')
    first = profile.model_revision(cfg("parity-tiny-embedded", f"model.path={other}"))
    (other / "config.json").write_text('{"a": 2}')
    assert first.startswith("local:") and profile.model_revision(cfg("parity-tiny-embedded", f"model.path={other}")) != first


def test_a_declared_fingerprint_is_compared_with_the_initial_publish(flag_on, tmp_path):
    """The declared ``model.fingerprint`` against the receipts of version 1, before any rollout."""
    from unirl.api import Receipt
    from unirl_parity_vllm.artifact import Recorder

    want, other = "ab" * 32, "cd" * 32
    c = cfg("parity-tiny-embedded", f"run.output_dir={tmp_path}", f"plugins.parity.model.fingerprint={want}")
    assert check(c) == []  # well-formed: preflight has nothing to say
    Recorder(c).on_weights_published(1, [Receipt(worker=0, version=1, fingerprint=want)])  # equal: fine
    with pytest.raises(profile.FingerprintMismatchError) as info:
        Recorder(c).on_weights_published(1, [Receipt(worker=0, version=1, fingerprint=other)])
    msg = str(info.value)
    assert "plugins.parity.model.fingerprint" in msg and want in msg and other in msg and "fix:" in msg


def test_the_example_adapter_family_needs_evidence_or_experimental(flag_on, monkeypatch, tmp_path):
    """A real third-party family (docs/examples/unirl-example-adapter, registered in-process): refused
    with neither evidence nor ``experimental``; its provider passes the ABC check; admitted with either."""
    from unirl.api import load_kernel

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples" / "unirl-example-adapter" / "src"))
    from unirl_example_adapter import plugin as example
    from unirl_example_adapter.adapter import LlamaAdapter

    kernel = load_kernel()
    kernel.register(example, entry_point="example_adapter", dist="unirl-example-adapter", version="0")
    assert profile.provider_problem("example-llama", kernel) is None
    base = ("model.adapter=example-llama", f"run.output_dir={tmp_path}")
    only(check(cfg("parity-tiny-embedded", *base), LlamaAdapter(), kernel), "plugins.parity.evidence",
         "parity adapter 'example-llama' (model adapter 'example-llama') has no profile in this release",
         fix="plugins.parity.experimental: true")
    assert check(cfg("parity-tiny-embedded", *base, "plugins.parity.experimental=true"), LlamaAdapter(), kernel) == []
    evidence = _artifact(tmp_path / "ev", adapter="example-llama")
    assert check(cfg("parity-tiny-embedded", *base, f"plugins.parity.evidence={evidence}"), LlamaAdapter(),
                 kernel) == []


def test_a_wrong_fingerprint_stops_the_run_at_the_initial_publish_and_the_right_one_runs(flag_on, tmp_path):
    """End to end on the embedded recipe: a declared fingerprint that is not the initial publish's stops
    the run there (no rollout, no gate record, no optimizer step); the fingerprint it names lets the same
    recipe run, and the artifact's profile records it with the revision."""
    from unirl.api import load_kernel, train

    quiet = ["trainer.progress=false", "trainer.plot=false"]
    bad = cfg("parity-tiny-embedded", f"run.output_dir={tmp_path / 'bad'}", *quiet,
              f"plugins.parity.model.fingerprint={'ab' * 32}")
    with pytest.raises(profile.FingerprintMismatchError) as info:
        train(bad, load_kernel())
    msg = str(info.value)
    real = msg.split(" has ")[1].split(":")[0]
    assert profile.is_fingerprint(real) and real != "ab" * 32
    assert not list((bad.run_dir / "parity").glob("gate-rank*.json")) and not (bad.run_dir / "metrics.jsonl").exists()
    good = cfg("parity-tiny-embedded", f"run.output_dir={tmp_path / 'good'}", *quiet, "trainer.steps=1",
               "trainer.prompts_per_step=2", f"plugins.parity.model.fingerprint={real}")
    assert train(good, load_kernel()).steps_done == 1
    doc = json.loads((good.run_dir / "parity" / "artifact.json").read_text())
    assert doc["profile"]["model"]["fingerprint"] == real
    assert doc["profile"]["model"]["revision"] == profile.model_revision(good)
    assert doc["phases"]["initial_checkpoint"]["mismatches"] == 0 and doc["phases"]["initial_checkpoint"]["tokens"] > 0
