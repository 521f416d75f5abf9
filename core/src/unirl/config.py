"""Run configuration: pydantic models loaded from a YAML recipe plus ``key.sub=value`` overrides.

Every section forbids unknown keys, because a misspelt key that is silently ignored is the most
expensive bug in RL (you find out after the run). Errors name the file and the dotted field, and offer
the closest valid key. Components are chosen by registry name (``rollout.engine: vllm``); their
``options`` are validated later against the ``Config`` model the plugin declares (see
:mod:`unirl.preflight`), because only then do we know which plugin provides them.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from unirl.allocator import Mode as AllocatorMode
from unirl.config_bounds import SEED_MAX, StrictOptions
from unirl.config_diagnostics import DiagnosticsSection
from unirl.config_stream import StreamSection, stall_timeout_field
from unirl.kernel.errors import ConfigError
from unirl.recipe_files import (  # noqa: F401 - re-exported: recipe files moved to their own module
    PACKAGED_RECIPES,
    copy_recipe,
    load_yaml,
    packaged_recipes,
    read_recipe,
    recipe_summary,
    resolve_recipe,
    yaml_problem,
)

#: ``actor.activation_checkpointing`` (unirl.actor.activation_checkpointing says what each keeps)
CheckpointingMode = Literal[False, True, "selective"]


class Section(StrictOptions):
    """A config section: unknown keys and NaN / +-inf are refused (:mod:`unirl.config_bounds`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class RunSection(Section):
    name: str = "run"
    output_dir: str = "runs"
    seed: int = Field(0, ge=0, le=SEED_MAX, description="seeds every draw of the run (torch.manual_seed takes "
                      "64 bits; the run derives a few more seeds from it by small offsets)")
    resume: Literal[False, True, "auto"] = Field(
        False, description="true: continue from the newest whole checkpoint in the run directory (none is an "
        "error); auto: continue when there is one, else start fresh; false: start fresh (docs/checkpoints.md)")
    preempt_grace_s: float = Field(
        600.0, gt=0, description="after a first SIGTERM / SIGINT the run finishes its step, checkpoints and exits; "
        "past this many seconds it exits without saving, and says so (docs/operations.md)")
    on_save_error: Literal["fail", "warn"] = Field(
        "fail", description="a checkpoint or metrics write that fails (disk full, EIO, permission): fail the run "
        "naming the path, the bytes needed and the fix, or warn, keep training and retry at the next interval")
    max_restarts: int = Field(
        0, ge=0, description="a lost worker (FSDP rank, engine replica, environment worker) tears the run's "
        "components down, rebuilds them and resumes from the last checkpoint, up to this many times (0: the run "
        "fails with the named error, as before)")
    allocator: AllocatorMode = Field(
        "system", description="system: the C library's defaults, which give freed memory back; retain: the "
        "training process keeps the memory it frees (glibc: no mmap below 1 GiB, no heap trim). Set retain with "
        "bf16 compute; in fp32 it gains at most a few percent and can hold more memory (docs/operations.md)")
    memory_check: Literal["error", "warn", "off", False] = Field(
        "error", description="preflight's memory plan (unirl plan): error refuses a layout whose predicted peak "
        "exceeds a device's budget, naming the fixes; warn prints it and goes on; off (YAML: false) skips it")
    memory_budget_gb: float | None = Field(
        None, gt=0, le=1e6, description="the memory plan's budget in GiB: per GPU where the layout has GPUs, else the "
        "host's; None: detected (torch.cuda's device memory; the host's MemTotal)")


class ModelSection(Section):
    adapter: str = "qwen3"
    path: str | None = Field(None, description="local HF directory (safetensors); None builds from `build`")
    build: dict[str, Any] = Field(default_factory=dict, description="architecture overrides for a model built from scratch")
    dtype: Literal["float32", "bfloat16"] = "float32"
    tokenizer: str | None = Field(None, description="tokenizer directory; None builds the demo tokenizer")


class ArithSection(Section):
    n_train: int = Field(2000, ge=1)
    n_eval: int = Field(64, ge=1)
    max_operand: int = Field(20, ge=0, description="operands are drawn from 0..max_operand")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    seed: int = Field(1234, ge=0, le=SEED_MAX)


#: verl's names for the data keys (``data.train_files`` is a list there; one source here)
DATA_ALIASES = {"train": "source", "eval": "eval_source", "prompt_key": "prompt_field", "answer_key": "answer_field"}


class DataSection(Section):
    source: str = Field("arith", validation_alias=AliasChoices("source", "train"), description=(
        "the training prompts (alias data.train): 'arith' (built-in generator), a .jsonl / .json / .parquet / "
        ".csv file, a directory written by Dataset.save_to_disk, or a dataset name (owner/name) read from "
        "the local HF datasets cache with no network (docs/data.md)"))
    eval_source: str | None = Field(None, validation_alias=AliasChoices("eval_source", "eval"), description="the held-out prompts (alias data.eval); any source data.source takes")
    image_key: str | None = Field(None, description="the image column (a path, bytes or PIL image, or a list of them per row) of a vision-language model's prompts; None: text only (docs/vision-language.md)")
    prompt_field: str = Field("prompt", validation_alias=AliasChoices("prompt_field", "prompt_key"),
                              description="the prompt column (alias data.prompt_key)")
    answer_field: str = Field("answer", validation_alias=AliasChoices("answer_field", "answer_key"),
                              description="the gold-answer column (alias data.answer_key)")
    subset: str | None = Field(None, description="a cached HF dataset's configuration (load_dataset's name)")
    train_split: str = Field("train", description="the split data.source reads (DatasetDict directory, cached dataset)")
    eval_split: str = Field("test", description="the split data.eval_source reads (the same kinds of source)")
    max_prompt_tokens: int = Field(128, gt=0)
    overlong: Literal["reject", "truncate"] = "reject"
    chat_template: bool = Field(False, description="render each prompt as a user turn through the tokenizer's chat "
                                "template (with the generation prompt); the template's end-of-turn token stops a "
                                "turn, and agentic observations are rendered as turns too (docs/data.md)")
    system_prompt: str | None = Field(None, description="with chat_template: a system turn before every prompt")
    arith: ArithSection = Field(default_factory=ArithSection)

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_key(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for alias, name in DATA_ALIASES.items():
                if alias in data and name in data:
                    raise ValueError(f"data.{alias} and data.{name} are the same setting (data.{alias} is its "
                                     f"alias): give only one")
        return data


class BranchingSection(Section):
    """``rollout.branching``: fork every trajectory that reaches one of ``at_turns`` into ``n`` branches
    (:meth:`unirl.samples.Sample.fork`), each continued on its own; ``algorithm.group_layer: fork``
    compares the branches of one fork point with each other. Only a controller that declares
    ``supports_branching`` does it (the agentic one); docs/agentic.md."""

    at_turns: list[int] = Field(min_length=1, description="the model turns (0 = the first) before which a "
                                "trajectory forks; one that ends earlier does not fork")
    n: int = Field(2, ge=2, description="branches per fork point (they replace the trajectory that forked)")

    @model_validator(mode="after")
    def _turns(self) -> BranchingSection:
        if any(t < 0 for t in self.at_turns) or len(set(self.at_turns)) != len(self.at_turns):
            raise ValueError(f"at_turns {self.at_turns}: give distinct model-turn indices >= 0 (0 = the first turn)")
        return self


class RolloutSection(Section):
    engine: str = "torch"
    n: int = Field(8, ge=1, description="samples per prompt (a GRPO group)")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    logprobs: Literal["raw", "processed"] = Field(
        "raw", description="the distribution the sampled tokens' log-probs are taken under, by the engine and by "
        "the actor's replay: raw (log_softmax of the logits) or processed (after temperature, top-k, top-p in "
        "vLLM's order; unirl.logprobs)")
    stop: list[str] = Field(default_factory=list)
    max_response_tokens: int | None = Field(None, ge=1, description="cap on a whole trajectory's response; None: none")
    environment: str | None = Field(None, description="a registered multi-turn environment (agentic rollouts)")
    controller: str = Field("batch", description="the registered rollout controller that drives the engine: "
                            "batch (one generate per collect), or a plugin's (e.g. agentic: multi-turn environments)")
    tools: list[str] = Field(default_factory=list, description="registered tools the environment offers")
    options: dict[str, Any] = Field(default_factory=dict)
    ignore_eos: bool = Field(False, description="generate past eos (fixed-length benchmarks); stop strings and "
                             "non-eos stop ids still end a turn")
    min_new_tokens: int = Field(0, ge=0, description="no eos / stop token before this many tokens of a turn")
    mode: Literal["sync", "async", "stream"] = Field("sync", description="async, stream: docs/async.md")
    stream: StreamSection = Field(default_factory=StreamSection)
    stall_timeout_s: float = stall_timeout_field()
    max_staleness: int = Field(1, ge=0, description="async: most published versions a batch may lag; 0 = on-policy")
    weight_sync_interval: int = Field(1, ge=1, description="async: trainer steps between weight syncs")
    branching: BranchingSection | None = Field(
        None, description="fork trajectories at given turns into n branches (tree rollouts; needs "
        "algorithm.group_layer: fork and a controller that supports it, e.g. agentic); docs/agentic.md")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_inflight" in data:
            raise ValueError("rollout.max_inflight was removed: remove rollout.max_inflight (async keeps one "
                             "collect in flight; stream keeps rollout.stream.inflight requests)")
        return data

    @model_validator(mode="after")
    def _min_within_max(self) -> RolloutSection:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) is above max_new_tokens ({self.max_new_tokens}): "
                             "lower rollout.min_new_tokens or raise rollout.max_new_tokens")
        return self


class LoraSection(Section):
    """``actor.lora``: train a LoRA adapter through peft instead of every weight (docs/lora.md).

    Why a section and not the plugin's ``options``: the embedded and the FSDP actor read the same keys,
    and weight sync, checkpoints and export all change with it."""

    r: int = Field(8, ge=1, description="adapter rank: an adapted W gets W + (alpha / r) * B A, B: [out, r], A: [r, in]")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training; 0 keeps the "
                           "training forward equal to the replay's (pi_old without a separate replay)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]), or all-linear: every linear "
        "layer but the output head")
    sync: Literal["merged", "adapter"] = Field(
        "merged", description="what a weight sync publishes: merged weights W + (alpha / r) B A (any engine), or "
        "the adapter alone, served through the engine's LoRA support (an engine whose capabilities declare "
        "lora_adapters, e.g. vllm); docs/lora.md has the measured costs of both")

    @model_validator(mode="after")
    def _targets(self) -> LoraSection:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError("target_modules is empty: nothing would train; list module names (e.g. "
                                 "[q_proj, v_proj]) or use all-linear")
            tied = sorted({"lm_head", "embed_tokens"} & set(self.target_modules))
            if tied:
                raise ValueError(f"target_modules {tied}: the embedding and output head are not adapted (they are "
                                 "tied in the tiny models, and merged weights must stay tied); remove them")
        return self


class ActorSection(Section):
    name: str = "torch"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay (AdamW refuses < 0)")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field((0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1) as AdamW requires")
    freeze: list[Literal["vision"]] = Field(default_factory=list, description="parts of the model that do not train: [vision] keeps a vision-language model's vision tower as loaded (docs/vision-language.md)")
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 disables clipping")
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    micro_batch_size: int = Field(64, ge=1, description=(
        "sequences per forward/backward; attention is per sequence, so memory grows with tokens, not "
        "with the square of the packed row; on CPU, fewer and larger micro-batches cost less per token"))
    micro_batch_tokens: int | None = Field(None, ge=1, description=(
        "also at most this many tokens (prompt + response) per micro-batch; a longer sequence runs alone. "
        "None: micro_batch_size alone. For long responses: memory grows with a micro-batch's tokens "
        "(docs/operations.md, \"Micro-batches by tokens\")"))
    activation_checkpointing: CheckpointingMode = Field(False, description=(
        "true: recompute each decoder layer in backward (least memory); selective: recompute it but keep "
        "its matmul and attention outputs (most of full's memory saving at a fraction of its recompute; "
        "docs/operations.md, \"Selective activation checkpointing\"); false: keep every activation"))
    value_head: bool = False
    lora: LoraSection | None = Field(None, description="train a LoRA adapter (peft) instead of every weight; "
                                     "None: full fine-tuning (docs/lora.md)")
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
    group_layer: Literal["root", "turn", "fork"] = Field(
        "root", description="the layer of the sample tree that forms an estimator's group: root (the samples of "
        "one launch), turn (each turn of those samples), fork (the branches of one fork point); docs/algorithms.md")
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
    nonfinite: Literal["abort", "skip"] = Field(
        "abort", description="an update whose loss or gradient is NaN / Inf is always dropped (weights and optimizer "
        "untouched); abort: stop the run after nonfinite_patience such steps in a row, with a debug bundle; skip: "
        "never stop (docs/operations.md)")
    nonfinite_patience: int = Field(1, ge=1, description="consecutive steps with a dropped non-finite update before "
                                    "algorithm.nonfinite: abort stops the run")
    value_coef: float = Field(0.5, ge=0, description="weight of the value loss (with actor.value_head)")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="MoE router load-balancing loss weight "
                                        "(Switch Transformer; e.g. 0.001); 0 = off. Needs an MoE model")
    routing_replay: bool = Field(False, description="MoE: route as the rollout did (docs/routing-replay.md)")
    value_clip: float = Field(0.2, gt=0, description="the value loss's clip range around the old values")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per token (GAE)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    modifiers: list[str] = Field(default_factory=list)
    rollout_is_threshold: float | None = Field(
        None, ge=1, description="the seed's one-key rollout correction: token-level truncated IS with this cap, >= 1 "
        "(a cap below 1 would scale down every on-policy token too) "
        "(the rollout_correction modifier of unirl-rollout-correction, mode token_tis); needs old_logp_source: "
        "replay. None: off (docs/rollout-correction.md)")
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

    @model_validator(mode="before")
    @classmethod
    def _rollout_is_threshold_lists_its_modifier(cls, data: Any) -> Any:
        """``rollout_is_threshold`` is an alias (the seed's key): it puts the ``rollout_correction`` loss
        modifier in ``modifiers`` (once; its plugin reads the threshold, and preflight checks the pairing
        with ``plugins.rollout_correction``). Only the list is expanded here, so the trainer needs no alias."""
        if isinstance(data, dict) and data.get("rollout_is_threshold") is not None:
            mods = data.get("modifiers") or []
            if isinstance(mods, list) and "rollout_correction" not in mods:
                data = {**data, "modifiers": [*mods, "rollout_correction"]}
        return data


#: the negative verdict forms, matched first (docs/rewards.md): "not correct" and "incorrect" never score 1
JUDGE_NEGATIVE = [
    r"\b(?:not|never|hardly|nowhere\s+near)\s+(?:\w+\s+){0,2}(?:correct|right|true|valid|accurate)\b",
    r"n't\s+(?:\w+\s+){0,2}(?:correct|right|true|valid|accurate)\b",
    r"\bin[\s-]?correct(?:ly)?\b", r"\bwrong(?:ly)?\b", r"\bfalse\b", r"\binaccurate\b", r"\binvalid\b",
    r"\b(?:partially|partly|almost|nearly|mostly|half|somewhat)\s+(?:correct|right)\b",
    r"\bthe\s+(?:correct|right)\s+(?:answer|result|value|sum|difference)\s+(?:is|was|would\s+be|should\s+be)\b",
    r"(?:^|[.?!:;,]\s*)\W*no\b(?!\s+(?:doubts?|mistakes?|errors?|problems?|issues?)\b)",  # a clause opening "no"
]
JUDGE_POSITIVE = [r"\bcorrect(?:ly)?\b", r"\byes\b", r"\bright\b", r"\btrue\b"]


class VerdictSection(Section):
    """How a judge's output becomes a score: negative forms first (any match scores 0), then positive (1)."""

    negative: list[str] = Field(default_factory=lambda: list(JUDGE_NEGATIVE),
                                description="regexes (case-insensitive) that make the verdict 0; checked first")
    positive: list[str] = Field(default_factory=lambda: list(JUDGE_POSITIVE),
                                description="regexes that make the verdict 1 when no negative one matched")
    scope: Literal["all", "first_line"] = Field("all", description="the judge output the rule reads")
    unparsed: Literal["fail", "zero"] = Field("fail", description="neither matched: fail the sample (NaN) or 0")

    @model_validator(mode="after")
    def _patterns_compile(self) -> VerdictSection:
        import re

        for field in ("negative", "positive"):
            for i, pat in enumerate(getattr(self, field)):
                try:
                    re.compile(pat)
                except re.error as exc:
                    raise ValueError(f"{field}[{i}] {pat!r} is not a valid regex ({exc}); fix the pattern") from None
        if not self.positive:
            raise ValueError("positive is empty: no output could ever score 1; list at least one pattern")
        return self


class JudgeSamplingSection(Section):
    max_new_tokens: int = Field(8, ge=1, description="the verdict's token budget")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy (a deterministic, cacheable judge)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)


class JudgeSection(Section):
    """``reward.judge``: a generative judge served by a registered rollout engine (reward ``judge``)."""

    engine: str = Field("torch", description="a registered rollout engine that serves the judge")
    model: ModelSection = Field(default_factory=ModelSection, description="the judge's model: set model.path")
    options: dict[str, Any] = Field(default_factory=dict, description="the judge engine's options")
    sampling: JudgeSamplingSection = Field(default_factory=JudgeSamplingSection)
    template: str = Field("Question: {prompt}\nAnswer: {completion}\nIs the answer correct?",
                          description="the judge's prompt; fields: {prompt}, {completion}, {answer}")
    chat_template: bool = Field(False, description="wrap the prompt as a user turn with the tokenizer's chat template")
    max_prompt_tokens: int | None = Field(None, gt=0, description="a longer judge prompt fails that sample (NaN); "
                                          "None: the judge's context less sampling.max_new_tokens")
    verdict: VerdictSection = Field(default_factory=VerdictSection)
    timeout_s: float = Field(120.0, gt=0, description="per rollout batch; unfinished verdicts fail (NaN)")
    cache_size: int = Field(100_000, ge=0, description="verdicts kept (LRU) by (prompt, completion, version); 0: off")
    version: str | None = Field(None, description="the judge version in cache keys; None: derived from the "
                                "model files, template, sampling and verdict rule")


class RewardModelSection(Section):
    """``reward.reward_model``: a sequence-classification model scored in batches (reward ``reward_model``)."""

    path: str | None = Field(None, description="HF directory of an AutoModelForSequenceClassification")
    tokenizer: str | None = Field(None, description="tokenizer directory; None: the model's")
    template: str = Field("{prompt}{completion}", description="text scored; fields: {prompt}, {completion}, {answer}")
    batch_size: int = Field(32, ge=1)
    max_tokens: int = Field(512, gt=0, description="a longer text fails that sample (NaN), never truncated")
    label: int = Field(0, ge=0, description="the logit used when the head has several labels")
    normalize: Literal["none", "sigmoid", "batch", "running"] = Field(
        "none", description="sigmoid; batch: z-score in the rollout batch; running: z-score over the run so far")
    dtype: Literal["float32", "bfloat16"] = "float32"


class RewardSection(Section):
    name: str = Field("exact_int", description="a registered reward: fn(completion, sample) -> float, or a "
                      "BatchReward (judge, reward_model, weighted)")
    terms: dict[str, float] = Field(default_factory=dict, json_schema_extra={
        "unbounded": "a term's weight may be negative (a penalty); finite is the only rule"}, description="reward weighted: {registered reward: "
                                    "weight}, summed, each term logged as reward/<name>")
    judge: JudgeSection = Field(default_factory=JudgeSection)
    reward_model: RewardModelSection = Field(default_factory=RewardModelSection)


class WeightSyncSection(Section):
    name: str = "inprocess"
    options: dict[str, Any] = Field(default_factory=dict)


class TraceSection(Section):
    exporter: str | None = Field(None, description="a registered trace exporter; None records no trace")
    options: dict[str, Any] = Field(default_factory=dict)


class LoggingSection(Section):
    """Where each step's metrics go besides ``metrics.jsonl`` (always written; docs/operations.md)."""

    trackers: list[str] = Field(default_factory=list, description="registered experiment trackers that get every "
                                "metrics row, the run's parameters and artifacts: tensorboard (core), wandb / mlflow "
                                "(pip install unirl-trackers); a tracker that fails is reported once and never stops "
                                "the run")
    options: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-tracker options keyed by "
                                               "tracker name (e.g. wandb: {project: my-proj})")

    @model_validator(mode="after")
    def _unique(self) -> LoggingSection:
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            raise ValueError(f"logging.trackers lists {', '.join(twice)} more than once; list each tracker once")
        return self


class TrainerSection(Section):
    steps: int = Field(60, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    eval_every: int = Field(10, ge=0, description="0 evaluates only before and after training")
    eval_k: int = Field(4, ge=1, description="samples per held-out prompt for avg@k")
    eval_temperature: float = Field(1.0, ge=0, description="the held-out evaluation's sampling temperature; 0: greedy")
    save_every: int = Field(10, ge=0, description="checkpoint every N steps (and at the end); 0 = only at the "
                            "end. The default keeps a Ctrl-C from losing more than 10 steps")
    keep_last: int = Field(3, ge=0, description="checkpoints kept: the newest N (plus keep_every's); 0 keeps all")
    keep_every: int = Field(0, ge=0, description="also keep every checkpoint whose step is a multiple of N; 0 = off")
    tensorboard: bool = Field(False, description="deprecated: use logging.trackers: [tensorboard] (true adds it there)")
    plot: bool = True
    export_hf: bool = Field(True, description="when RL ends, write RUN_DIR/hf: a Hugging Face model directory "
                            "plain transformers and vLLM load (also: unirl export RUN_DIR)")
    progress: bool = True
    max_failed_frac: float = Field(0.5, ge=0, le=1, description="stop when more than this fraction of a step's "
                                   "samples failed (reward raised / engine error) for max_failed_steps steps in "
                                   "a row; 1 never stops")
    max_failed_steps: int = Field(3, ge=1, description="consecutive steps above max_failed_frac before the stop")


class SFTSection(Section):
    steps: int = Field(0, ge=0, description="supervised warm-start steps before RL; 0 skips")
    lr: float = Field(1e-3, gt=0, description="the warm start's AdamW learning rate")
    batch_size: int = Field(32, ge=1, description="prompts (with their gold answers) per warm-start step")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="decay of sft.lr over sft.steps (after sft.warmup_steps): a decaying warm start "
        "settles instead of ending wherever a constant step left it")
    warmup_steps: int = Field(0, ge=0, description="linear ramp of sft.lr over the first steps")


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
    logging: LoggingSection = Field(default_factory=LoggingSection)
    diagnostics: DiagnosticsSection = Field(default_factory=DiagnosticsSection)  # unirl.config_diagnostics
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="free-form sections owned by plugins, keyed by plugin name",
        # each section is validated by the model its plugin declares (a StrictOptions: NaN named per key)
        json_schema_extra={"finite_checked_by": "unirl_config_sections"},
    )

    @model_validator(mode="after")
    def _tensorboard_alias(self) -> RunConfig:
        """``trainer.tensorboard: true`` (before logging.trackers existed) still works: it adds the
        ``tensorboard`` tracker, with a DeprecationWarning that names the new key."""
        if self.trainer.tensorboard and "tensorboard" not in self.logging.trackers:
            import warnings

            warnings.warn("trainer.tensorboard is deprecated: use logging.trackers: [tensorboard]",
                          DeprecationWarning, stacklevel=2)
            self.logging.trackers.append("tensorboard")
        return self

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
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({yaml_problem(exc)}); quote it, "
                          f"e.g. {key}='\"...\"'") from exc
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
        # an optional section (``actor.lora: LoraSection | None``) is the model inside the union
        options = [ann, *typing.get_args(ann)]
        model = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
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
        elif err["type"] == "finite_number":
            lines.append(f"  {field}: NaN and infinity are not accepted here (got {err.get('input')!r}); fix: give a "
                         "finite number")
        else:
            lines.append(f"  {field}: {err['msg']} (got {err.get('input')!r})")
    if len(lines) == 2:  # one problem: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe (a file, or a packaged recipe's name; the defaults when ``path`` is None), apply
    overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_recipe(resolve_recipe(path))
    data = apply_overrides(data, list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        fields = [".".join(str(p) for p in err["loc"]) for err in exc.errors()]
        # only the overrides that set an invalid field (or a section holding one), not the whole list
        mine = [o for o in overrides or [] if any(f == (k := o.partition("=")[0].strip()) or f.startswith(k + ".")
                                                  or k.startswith(f + ".") for f in fields)]
        if mine:
            source += f" (with override{'s' if len(mine) > 1 else ''} {' '.join(mine)})"
        raise ConfigError(format_validation_error(exc, source)) from None


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
