"""Every number a user can set is finite and bounded, checked at config time (issue 66, item 2).

The walk covers ``RunConfig`` and every options model the installed plugins declare: each component's
``Config`` in every kernel registry and each ``plugins.<name>`` section model (``unirl_config_sections``).
So a numeric field added without a bound, or a float field that accepts NaN / +-inf, fails here by name.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from unirl.config import RunConfig, format_validation_error, load_config
from unirl.config_bounds import SEED_MAX, StrictOptions, nonfinite_values, numeric_fields
from unirl.kernel.errors import ConfigError, OptionsError
from unirl.kernel.manager import load_kernel
from unirl.kernel.options import options_model, validate_options

NONFINITE = [float("nan"), float("inf"), float("-inf")]


def _value_for(ann: Any, v: float) -> Any:
    """A value of annotation ``ann`` that holds ``v`` wherever a number goes."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        return _value_for(args[0], v)
    if origin is typing.Annotated:
        return _value_for(args[0], v)
    if origin is tuple:
        return [_value_for(a, v) for a in args]
    if origin is list:
        return [_value_for(args[0], v)]
    if origin is dict:
        return {"k": _value_for(args[1], v)}
    return v


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _models() -> list[tuple[str, type[BaseModel], Any]]:
    """(id, model, kernel route or None): RunConfig, every component options model, every section model."""
    kernel = load_kernel()
    out: list[tuple[str, type[BaseModel], Any]] = [("RunConfig", RunConfig, None)]
    for kind, registry in sorted(kernel.registries.items()):
        for name, entry in sorted(registry.items()):
            factory = entry.load()
            model = factory if kind == "config_sections" else options_model(factory)
            if model is not None:
                out.append((f"{kind}:{name}", model, None if kind == "config_sections" else (kernel, kind, name)))
    return out


MODELS = _models()


def test_the_walk_sees_the_plugins_models():
    """The walk is not vacuous: the core and plugin option models and sections are in it."""
    ids = {i for i, _, _ in MODELS}
    assert {"RunConfig", "rollout_engines:torch", "rollout_engines:vllm", "actors:fsdp", "trackers:wandb",
            "config_sections:agentic", "config_sections:rollout_correction", "config_sections:parity"} <= ids
    assert sum(len(list(numeric_fields(m))) for _, m, _ in MODELS) > 100


@pytest.mark.parametrize(("model", "route"), [pytest.param(m, r, id=i) for i, m, r in MODELS])
def test_every_numeric_field_declares_a_bound(model, route):
    """A bound (ge / gt / le / lt) on each numeric field, or a stated reason it has none."""
    unbounded = [dotted for dotted, _, _, _, bounded in numeric_fields(model) if not bounded]
    assert not unbounded, f"{model.__name__}: numeric fields without a bound: {unbounded}"


@pytest.mark.parametrize(("model", "route"), [pytest.param(m, r, id=i) for i, m, r in MODELS])
def test_nan_and_infinities_are_refused_naming_the_field(model, route):
    """NaN, +inf and -inf in every numeric field are refused when the config is validated, and the error
    names the field. Component options go through the kernel (what preflight and a build run)."""
    checked = 0
    for dotted, *_ in numeric_fields(model):
        ann = _annotation(model, dotted)
        for v in NONFINITE:
            raw = _nested(dotted, _value_for(ann, v))
            if route is None:
                with pytest.raises(ValidationError) as err:
                    model.model_validate(raw)
                text = format_validation_error(err.value, "test")
                assert dotted in text, f"{dotted}={v}: {text}"
            else:
                kernel, kind, comp = route
                with pytest.raises(OptionsError) as oerr:
                    kernel.options(kind, comp, raw, "opts")
                fields = [x.field for x in oerr.value.violations]
                # the field, or the section a model-level validator reports it under (vllm's placement)
                assert any(f.startswith(f"opts.{dotted}") or dotted.startswith(f.removeprefix("opts.") + ".")
                           for f in fields), (dotted, v, fields)
            checked += 1
    assert checked == 3 * len(list(numeric_fields(model)))


def _annotation(model: type[BaseModel], dotted: str) -> Any:
    node: Any = model
    *parents, last = dotted.split(".")
    for part in parents:
        ann = node.model_fields[part].annotation
        node = next(a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel))
    return node.model_fields[last].annotation


def test_a_model_not_built_on_the_base_is_still_refused_by_the_kernel():
    """The safety net: a plugin's plain pydantic model (allow_inf_nan left on) gets NaN refused anyway."""

    class Plain(BaseModel):
        rate: float = 1.0
        nested: dict[str, float] = {}

    class Component:
        Config = Plain

    for raw, field in (({"rate": math.inf}, "x.rate"), ({"nested": {"a": math.nan}}, "x.nested.a")):
        with pytest.raises(OptionsError) as err:
            validate_options(Component, raw, name="c", source="dist", field="x")
        assert [v.field for v in err.value.violations] == [field]
        assert "finite number" in err.value.violations[0].fix
    assert validate_options(Component, {"rate": 2.0}, name="c", source="dist", field="x").rate == 2.0


def test_a_field_may_say_it_takes_infinity():
    from pydantic import Field

    class Opt(StrictOptions):
        limit: float = Field(math.inf, allow_inf_nan=True, ge=0)

    assert Opt(limit=math.inf).limit == math.inf
    assert nonfinite_values(Opt(limit=math.inf)) == []


@pytest.mark.parametrize(("override", "field"), [
    ("run.seed=18446744073709551616", "run.seed"),  # 2**64: beyond torch.manual_seed
    (f"run.seed={SEED_MAX + 1}", "run.seed"),
    ("run.seed=-1", "run.seed"),
    ("actor.weight_decay=-1", "actor.weight_decay"),  # AdamW: "Invalid weight_decay value"
    ("actor.betas=[0.9, 1.0]", "actor.betas.1"),  # AdamW: "Invalid beta parameter at index 1"
    ("actor.betas=[-0.1, 0.9]", "actor.betas.0"),
    ("sft.lr=-1", "sft.lr"),
    ("sft.lr=0", "sft.lr"),
    ("sft.batch_size=0", "sft.batch_size"),  # the cursor's batch
    ("trainer.eval_temperature=-0.5", "trainer.eval_temperature"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.rollout_is_threshold=0.5", "algorithm.rollout_is_threshold"),  # a TIS cap below 1
    ("actor.lr=.inf", "actor.lr"),
    ("actor.lora.alpha=.nan", "actor.lora.alpha"),
    ("algorithm.kl_coef=.inf", "algorithm.kl_coef"),
    ("rollout.temperature=.nan", "rollout.temperature"),
])
def test_the_consumers_bounds_are_config_time_errors(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    text = str(err.value)
    assert f"{field}:" in text and "\n" not in text, text


def test_the_largest_seed_runs_every_derived_seed():
    """The largest accepted seed leaves room for the seeds the run derives from it (torch takes 64 bits)."""
    import torch

    from unirl.samples import eval_seed

    cfg = load_config(None, [f"run.seed={SEED_MAX}"])
    for seed in (cfg.run.seed, cfg.run.seed + 1, eval_seed(cfg.run.seed)):
        torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("override", ["model.build.rope_theta=.nan", "rollout.options={batch_size: 4, x: .inf}",
                                      "actor.options={a: [1.0, -.inf]}", "algorithm.loss_options={clip_ratio_c: .nan}",
                                      "reward.judge.options={a: {b: .nan}}"])
def test_free_form_sections_refuse_nonfinite_values_too(override):
    """``model.build`` and every ``*.options`` dict hold numbers no typed field checks at config time."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    key = override.partition("=")[0].rsplit(".", 1)[0] if override.startswith("model.build") else \
        override.partition("=")[0]
    assert f"{key}:" in str(err.value) and "finite number" in str(err.value)


def test_plugin_sections_are_left_to_the_declaring_models():
    """``plugins.<name>`` is validated by the model its plugin declares, which names the key itself."""
    cfg = load_config(None, ["plugins.agentic={over_generate: .inf}"])
    assert math.isinf(cfg.plugins["agentic"]["over_generate"])
    from unirl_agentic.options import AgenticOptions

    with pytest.raises(ValidationError, match="over_generate"):
        AgenticOptions.model_validate(cfg.plugins["agentic"])
