"""Settings that do nothing under the rest of the config: one table of rules (:data:`INERT`).

Why violations and not warnings: a setting the run ignores is a user believing the run does something
it does not (a KL estimator with no KL, a DAPO buffer with the penalty off, a dataset split on a JSONL
file), found after the run; a recipe states only what takes effect. Each rule is data: the field, when
it is ignored, why, and the fix. Preflight reports every rule that fires (:func:`inert_violations`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl.config import RunConfig
from unirl.data.datasets import source_kind
from unirl.kernel.errors import Violation

CORE = "unirl-core"

#: the rollout keys that only apply with ``rollout.mode: async``
ASYNC_KEYS = ("max_staleness", "weight_sync_interval")


def _sources(c: RunConfig) -> list[str]:
    """The kinds of the sources the run reads (``arith``, ``file``, ``directory``, ``name``); with
    ``data.source: arith`` the held-out split is generated too, and ``data.eval_source`` is not read."""
    if c.data.source == "arith":
        return ["arith"]
    return [source_kind(s) for s in (c.data.source, c.data.eval_source) if s]


_HF_FIX = "remove {field}; it applies to a save_to_disk directory or a cached dataset name (docs/data.md)"


@dataclass(frozen=True)
class Inert:
    """A setting that does nothing under the rest of the config: ``field`` is set explicitly (in a
    recipe, an ``extends`` base or an override) while ``when(config)`` holds. ``why`` and ``fix`` are
    formatted with ``c`` (the config) and ``field``."""

    field: str
    when: Callable[[RunConfig], bool]
    why: str
    fix: str


_KL_OFF = "algorithm.kl_coef is 0, so no KL term is computed"
_SET_KL = "set algorithm.kl_coef > 0, or remove {field}"

#: Every "set, but ignored" rule in one table. Why violations and not warnings: a setting the run
#: ignores is a user believing the run does something it does not (a KL estimator with no KL, a DAPO
#: buffer with the penalty off), found after the run; a recipe states only what takes effect.
#: A rule is here only when nothing reads the field under ``when``: core's code does not, and the value
#: reaches no plugin that could (no KL reference exists at kl_coef 0, for instance). Not here, on purpose: ``algorithm.clip_low/clip_high`` under ``loss: gspo``
#: (gspo reads ``loss_options``, but recipes extend a base that sets both), ``sft.lr`` with
#: ``sft.steps: 0`` (the same), ``algorithm.gamma/lam`` off GAE (a plugin estimator may read them), and a
#: single-turn ``rollout.max_response_tokens`` (engine plugins size their context with it).
INERT: tuple[Inert, ...] = (
    Inert("algorithm.kl_estimator", lambda c: c.algorithm.kl_coef == 0, _KL_OFF, _SET_KL),
    Inert("algorithm.kl_form", lambda c: c.algorithm.kl_coef == 0, _KL_OFF + " (in the loss or in the reward)",
          _SET_KL),
    Inert("algorithm.kl_clamp", lambda c: c.algorithm.kl_coef == 0, _KL_OFF, _SET_KL),
    Inert("algorithm.kl_clamp", lambda c: c.algorithm.kl_coef > 0 and c.algorithm.kl_estimator != "k3",
          "only the k3 estimate is clamped, and algorithm.kl_estimator is {c.algorithm.kl_estimator}",
          "remove {field}, or set algorithm.kl_estimator: k3"),
    *(Inert(f"algorithm.overlong.{key}", lambda c: not c.algorithm.overlong.enabled,
            "algorithm.overlong.enabled is false, so no overlong penalty is applied",
            "set algorithm.overlong.enabled: true, or remove {field}") for key in ("buffer_tokens", "penalty")),
    Inert("algorithm.dynamic_sampling.max_draws", lambda c: not c.algorithm.dynamic_sampling.enabled,
          "algorithm.dynamic_sampling.enabled is false, so each step draws one round",
          "set algorithm.dynamic_sampling.enabled: true, or remove {field}"),
    *(Inert(f"algorithm.{key}", lambda c: not c.actor.value_head,
            "actor.value_head is false, so there is no value loss",
            "set actor.value_head: true (with a value estimator such as gae), or remove {field}")
      for key in ("value_coef", "value_clip")),
    *(Inert(f"rollout.{key}", lambda c: c.rollout.mode == "sync", "only applies with rollout.mode: async",
            "set rollout.mode: async, or remove {field}") for key in ASYNC_KEYS),
    *(Inert(f"rollout.{key}", lambda c: c.rollout.mode != "stream", "only applies with rollout.mode: stream",
            "set rollout.mode: stream, or remove {field}") for key in ("stream",)),
    Inert("rollout.tools", lambda c: not c.rollout.environment,
          "tools are offered by an environment, but rollout.environment is not set",
          "set rollout.environment (e.g. a tool environment) or remove the tools"),
    Inert("data.system_prompt", lambda c: not c.data.chat_template,
          "data.chat_template is false, so prompts are used as they are and no system turn is rendered",
          "set data.chat_template: true, or put the text in the prompts and remove {field}"),
    Inert("trace.options", lambda c: not c.trace.exporter, "options given but trace.exporter is not set",
          "set trace.exporter or remove them"),
    Inert("algorithm.nonfinite_patience", lambda c: c.algorithm.nonfinite == "skip",
          "algorithm.nonfinite is skip, so no number of dropped updates stops the run",
          "set algorithm.nonfinite: abort, or remove {field}"),
    Inert("model.build", lambda c: bool(c.model.path),
          "model.path {c.model.path} is loaded as it is; model.build only shapes a model built from scratch",
          "remove model.build, or unset model.path to build one from scratch"),
    Inert("algorithm.group_layer", lambda c: c.algorithm.group_layer == "fork" and c.rollout.branching is None,
          "fork groups the branches of one fork point, but rollout.branching is not set, so nothing forks",
          "set rollout.branching (at_turns, n) with a controller that branches (agentic), or remove {field}"),
    Inert("data.eval_source", lambda c: c.data.source == "arith", "data.source is arith, whose held-out prompts "
          "are generated too, so data.eval_source is not read", "remove {field}, or set data.source to a dataset"),
    *(Inert(f"data.{key}", lambda c: set(_sources(c)) == {"arith"},
            "the built-in arith generator writes its own prompt and answer fields; no file is read",
            "remove {field}, or point data.source at a dataset file") for key in ("prompt_field", "answer_field")),
    Inert("data.subset", lambda c: "name" not in _sources(c),
          "data.subset picks a configuration of a cached HF dataset, and no source is a dataset name", _HF_FIX),
    Inert("data.train_split", lambda c: source_kind(c.data.source) not in ("directory", "name"),
          "data.source {c.data.source} is not a DatasetDict directory or a cached dataset, so it has no splits",
          _HF_FIX),
    Inert("data.eval_split", lambda c: "arith" in _sources(c) or not c.data.eval_source or source_kind(c.data.eval_source) not in
          ("directory", "name"), "data.eval_source is not a DatasetDict directory or a cached dataset, so it has no "
          "splits", _HF_FIX),
)


def is_set(config: RunConfig, dotted: str) -> bool:
    """Whether ``dotted`` was given explicitly (pydantic's ``model_fields_set`` of its section), not a default."""
    *parents, key = dotted.split(".")
    node: Any = config
    for part in parents:
        node = getattr(node, part)
    return key in node.model_fields_set


def inert_violations(config: RunConfig) -> list[Violation]:
    """One violation per :data:`INERT` rule whose field is set while the rest of the config ignores it."""
    return [Violation(CORE, rule.field, rule.why.format(c=config, field=rule.field),
                      rule.fix.format(c=config, field=rule.field))
            for rule in INERT if is_set(config, rule.field) and rule.when(config)]


def reinforce_pp_gamma_violations(config: RunConfig) -> list[Violation]:
    """``reinforce_pp`` with ``algorithm.gamma != 1``: refused, not ignored.

    Why: core's REINFORCE++ gives every response token the whole outcome reward (no discount), while
    verl's discounts it by ``gamma`` per token back from the end; a recipe carried over from verl with
    ``gamma: 0.99`` would train differently from what its author believes, silently."""
    a = config.algorithm
    if a.estimator != "reinforce_pp" or a.gamma == 1.0:
        return []
    return [Violation(CORE, "algorithm.gamma",
                      f"estimator reinforce_pp does not discount: every response token gets the whole outcome "
                      f"reward, so gamma={a.gamma} would be ignored",
                      "remove algorithm.gamma (or set it to 1.0), or use estimator: gae, which discounts by gamma")]


def sft_only_violations(config: RunConfig) -> list[Violation]:
    """``unirl sft`` with ``sft.steps: 0`` would train nothing and still write the model as warm-started."""
    if config.sft.steps > 0:
        return []
    return [Violation(CORE, "sft.steps", "unirl sft runs only the supervised warm start, and sft.steps is 0: it "
                      "would write the untrained model as a warm-started one", "set sft.steps > 0 (e.g. sft.steps=50)")]
