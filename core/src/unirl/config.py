"""Run configuration: pydantic models loaded from a YAML recipe plus ``key.sub=value`` overrides.

Every section forbids unknown keys, because a misspelt key that is silently ignored is the most
expensive bug in RL (you find out after the run). Errors name the file and the dotted field, and offer
the closest valid key. Components are chosen by registry name (``rollout.engine: vllm``); their
``options`` are validated later against the ``Config`` model the plugin declares (see
:mod:`unirl.preflight`), because only then do we know which plugin provides them.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from unirl.kernel.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    resume: bool = Field(False, description="continue from the latest checkpoint in the run directory")


class ModelSection(Section):
    adapter: str = "qwen3"
    path: str | None = Field(None, description="local HF directory (safetensors); None builds from `build`")
    build: dict[str, Any] = Field(default_factory=dict, description="architecture overrides for a model built from scratch")
    dtype: Literal["float32", "bfloat16"] = "float32"
    tokenizer: str | None = Field(None, description="tokenizer directory; None builds the demo tokenizer")


class ArithSection(Section):
    n_train: int = 2000
    n_eval: int = 64
    max_operand: int = 20
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    seed: int = 1234


class DataSection(Section):
    source: str = Field("arith", description="'arith' (built-in generator) or a .jsonl/.parquet path")
    eval_source: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    max_prompt_tokens: int = Field(128, gt=0)
    overlong: Literal["reject", "truncate"] = "reject"
    arith: ArithSection = Field(default_factory=ArithSection)


class RolloutSection(Section):
    engine: str = "torch"
    n: int = Field(8, ge=1, description="samples per prompt (a GRPO group)")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    stop: list[str] = Field(default_factory=list)
    max_response_tokens: int | None = Field(
        None, ge=1, description="cap on a whole trajectory's response (all turns and observations); None: none")
    environment: str | None = Field(None, description="a registered multi-turn environment (agentic rollouts)")
    controller: str | None = Field(None, description="a registered rollout controller that drives the engine "
                                   "(e.g. agentic: multi-turn environments); None: one generate per batch")
    tools: list[str] = Field(default_factory=list, description="registered tools the environment offers")
    options: dict[str, Any] = Field(default_factory=dict)
    ignore_eos: bool = Field(False, description="generate past eos (fixed-length benchmarks); stop strings and "
                             "non-eos stop ids still end a turn")
    min_new_tokens: int = Field(0, ge=0, description="no eos / stop token before this many tokens of a turn")
    # async rollout (docs/async.md): one-step-off is max_staleness 1, weight_sync_interval 1
    mode: Literal["sync", "async"] = Field("sync", description="async: the engine generates while the trainer trains")
    max_staleness: int = Field(1, ge=0, description="async: most published versions a batch may lag; 0 = on-policy")
    weight_sync_interval: int = Field(1, ge=1, description="async: trainer steps between weight syncs")
    max_inflight: int = Field(2, ge=1, description="async: most rollout launches (batches) in flight at once")

    @model_validator(mode="after")
    def _min_within_max(self) -> RolloutSection:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) is above max_new_tokens ({self.max_new_tokens}): "
                             "lower rollout.min_new_tokens or raise rollout.max_new_tokens")
        return self


class ActorSection(Section):
    name: str = "torch"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 disables clipping")
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    micro_batch_size: int = Field(32, ge=1)
    activation_checkpointing: bool = False
    value_head: bool = False
    options: dict[str, Any] = Field(default_factory=dict)


class DynamicSamplingSection(Section):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): drop groups that teach nothing."""

    enabled: bool = Field(False, description="drop groups whose rewards are all equal and draw more prompts")
    max_draws: int = Field(4, ge=1, description="rollout rounds per step at most, the first included")


class OverlongSection(Section):
    """DAPO's overlong reward shaping: a soft penalty over the last ``buffer_tokens`` of the budget."""

    enabled: bool = False
    buffer_tokens: int = Field(4, ge=1, description="L_cache: the soft-penalty zone before rollout.max_new_tokens")
    penalty: float = Field(1.0, ge=0, description="the penalty at the full budget (DAPO: 1)")


class AlgorithmSection(Section):
    """What the RL step optimises. See docs/algorithms.md for every choice with its formula and paper."""

    estimator: str = "grpo"
    estimator_options: dict[str, Any] = Field(default_factory=dict)
    loss: str = "ppo_clip"
    loss_options: dict[str, Any] = Field(default_factory=dict, description="validated by the loss's Config "
                                         "(ppo_clip: clip_ratio_c; gspo: clip_low, clip_high)")
    clip_low: float = Field(0.2, gt=0, lt=1, description="lower clip: the ratio floor 1 - clip_low stays in (0, 1)")
    clip_high: float = Field(0.2, ge=0, description="upper clip; > clip_low is DAPO's clip-higher")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="estimator dr_grpo defaults it to seq-mean-token-sum-norm")
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float | None = Field(10.0, gt=0, description="clamp of the k3 estimate (verl: 10); null = off")
    kl_form: Literal["loss", "reward"] = Field("loss", description="KL penalty in the loss, or folded into "
                                               "the rewards before the estimator")
    old_logp_source: Literal["replay", "rollout"] = "replay"
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps per rollout batch (disjoint mini-batches)")
    value_coef: float = 0.5
    router_aux_loss_coef: float = Field(0.0, ge=0, description="MoE router load-balancing loss weight "
                                        "(Switch Transformer; e.g. 0.001); 0 = off. Needs an MoE model")
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    modifiers: list[str] = Field(default_factory=list)
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)
    overlong: OverlongSection = Field(default_factory=OverlongSection)

    @model_validator(mode="before")
    @classmethod
    def _dr_grpo_is_one_name(cls, data: Any) -> Any:
        """``estimator: dr_grpo`` means Dr. GRPO, both halves: without an explicit ``loss_agg`` it gets
        ``seq-mean-token-sum-norm`` (preflight rejects a half-set pairing)."""
        if isinstance(data, dict) and data.get("estimator") == "dr_grpo" and "loss_agg" not in data:
            data = {**data, "loss_agg": "seq-mean-token-sum-norm"}
        return data


class RewardSection(Section):
    name: str = Field("exact_int", description="a registered reward: fn(completion, sample) -> float")


class WeightSyncSection(Section):
    name: str = "inprocess"
    options: dict[str, Any] = Field(default_factory=dict)


class TraceSection(Section):
    exporter: str | None = Field(None, description="a registered trace exporter; None records no trace")
    options: dict[str, Any] = Field(default_factory=dict)


class TrainerSection(Section):
    steps: int = Field(60, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    eval_every: int = Field(10, ge=0, description="0 evaluates only before and after training")
    eval_k: int = Field(4, ge=1, description="samples per held-out prompt for avg@k")
    eval_temperature: float = 1.0
    save_every: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    keep_last: int = Field(3, ge=0, description="checkpoints kept: the newest N (plus keep_every's); 0 keeps all")
    keep_every: int = Field(0, ge=0, description="also keep every checkpoint whose step is a multiple of N "
                            "permanently; 0 = off")
    tensorboard: bool = False
    plot: bool = True
    export_hf: bool = Field(True, description="when RL ends, write RUN_DIR/hf: a Hugging Face model directory "
                            "plain transformers and vLLM load (also: unirl export RUN_DIR)")
    progress: bool = True


class SFTSection(Section):
    steps: int = Field(0, ge=0, description="supervised warm-start steps before RL; 0 skips")
    lr: float = 1e-3
    batch_size: int = 32


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    actor: ActorSection = Field(default_factory=ActorSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    trace: TraceSection = Field(default_factory=TraceSection)
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="free-form sections owned by plugins, keyed by plugin name"
    )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# ------------------------------------------------------------------------------------------ loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"rollout.n=4"`` -> (["rollout", "n"], 4). The value is parsed as YAML (so lists work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key.sub=value (e.g. rollout.n=4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {exc}") from exc
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config in {source}:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            model = _model_at(loc)
            known = list(model.model_fields) if model else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            lines.append(f"  {field}: unknown key.{hint} Valid keys here: {', '.join(known)}")
        else:
            lines.append(f"  {field}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a dict. ``extends: other.yaml`` (relative to the recipe) is merged underneath, so a
    variant recipe states only what differs from its base."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"recipe {path}: 'extends' loops back to itself")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(loaded).__name__}")
    base = loaded.pop("extends", None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"recipe {path}: 'extends' must be a file name, got {base!r}")
    return _deep_merge(read_recipe(p.parent / base, (*_seen, p.resolve())), loaded)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_recipe(path)
    data = apply_overrides(data, list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        if overrides:
            source += f" (with overrides {' '.join(overrides)})"
        raise ConfigError(format_validation_error(exc, source)) from None


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
