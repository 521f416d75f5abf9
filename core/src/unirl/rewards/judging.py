"""The pure parts of a judge: its template check and rendering, and the run config its engine is built from.

Why a leaf module: the judge's preflight (:mod:`unirl.rewards.checks`) and the judge itself
(:mod:`unirl.rewards.judge`) both need these; with them in ``judge.py`` the two imported each other.
This module imports neither.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from unirl.kernel.errors import Violation

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import RunConfig
    from unirl.samples import Sample

CORE = "unirl-core"
#: the fields a judge or reward-model template may name
TEMPLATE_FIELDS = ("prompt", "completion", "answer")


def template_violations(template: str, where: str) -> list[Violation]:
    """The template parses, names only known fields and includes ``{completion}`` (what is judged)."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return [Violation(CORE, where, f"template does not parse ({exc})",
                          "write literal braces as {{ and }}; fields are {prompt}, {completion}, {answer}")]
    out = []
    unknown = sorted({n for n in names if n not in TEMPLATE_FIELDS})
    if unknown:
        out.append(Violation(CORE, where, f"template names unknown fields {unknown}",
                             f"use only {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}"))
    if "completion" not in names:
        out.append(Violation(CORE, where, "template has no {completion} field: the judge would never see "
                             "what it judges", "add {completion} to the template"))
    return out


def render(template: str, completion: str, sample: Sample) -> str:
    return template.format(prompt=sample.prompt_text, completion=completion, answer=sample.answer)


def judge_run_config(config: RunConfig) -> RunConfig:
    """The run config the judge's engine is built from: the run's, with the judge's model, engine,
    options and sampling, single-turn and synchronous (no environment, no controller)."""
    j = config.reward.judge
    rollout = config.rollout.model_copy(update=dict(
        engine=j.engine, options=dict(j.options), n=1, max_new_tokens=j.sampling.max_new_tokens,
        temperature=j.sampling.temperature, top_p=j.sampling.top_p, top_k=j.sampling.top_k,
        stop=list(j.sampling.stop), max_response_tokens=None, environment=None, controller=None, tools=[],
        ignore_eos=False, min_new_tokens=0, mode="sync"))
    data = config.data.model_copy(update=dict(max_prompt_tokens=j.max_prompt_tokens or config.data.max_prompt_tokens))
    return config.model_copy(update=dict(model=j.model, rollout=rollout, data=data))
