"""Preflight of the model-based rewards: cheap checks that a judge or reward model will load and fit.

Why before the run: a judge whose directory is missing a file, whose template misses ``{completion}``,
or whose engine rejects its options would otherwise fail after the policy's warm start, or worse,
fail every sample quietly (NaN) once training runs. Nothing here loads weights: configs, tokenizers
and file sizes only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from unirl.config import RunConfig
from unirl.kernel.errors import OptionsError, PluginError, Violation
from unirl.rewards.judging import CORE, judge_run_config, template_violations

_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def model_dir_violations(path: str | None, where: str, what: str) -> list[Violation]:
    """``path`` is a model directory: it exists, has a config.json and weight files."""
    if not path:
        return [Violation(CORE, where, f"{what} needs a model directory, and none is set",
                          f"set {where} to a local HF model directory (config.json + weights)")]
    p = Path(path)
    if not p.is_dir():
        return [Violation(CORE, where, f"{what} directory {path} does not exist", f"point {where} at a model directory")]
    if not (p / "config.json").is_file():
        return [Violation(CORE, where, f"{path} has no config.json: not a model directory",
                          f"point {where} at a model directory")]
    if not any(any(p.glob(g)) for g in _WEIGHTS):
        return [Violation(CORE, where, f"{path} has no weight files ({', '.join(_WEIGHTS)})",
                          "export the model there (save_pretrained) or point at another directory")]
    return []


def weights_bytes(path: str) -> int:
    return sum(f.stat().st_size for g in _WEIGHTS for f in Path(path).glob(g))


def memory_available() -> int | None:
    """Bytes of host memory available now (Linux MemAvailable), or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fit_violations(paths: list[str], where: str, what: str) -> list[Violation]:
    """The extra model's weights (plus the policy's, when it is loaded from a directory) must fit in half
    of the host memory available now: the rest is for the policy's actor, optimizer and engine copy."""
    avail = memory_available()
    need = sum(weights_bytes(p) for p in paths if p and Path(p).is_dir())
    if avail is None or need * 2 <= avail:
        return []
    gib = 1 << 30
    return [Violation(CORE, where, f"{what} and policy weights ({need / gib:.1f} GiB) do not fit in half of the "
                      f"available host memory ({avail / gib:.1f} GiB) beside the policy's actor and engine",
                      "use a smaller judge / reward model, or a machine with more memory")]


def judge_violations(config: RunConfig, kernel: Any) -> list[Violation]:
    from unirl.contracts import RolloutEngine

    j = config.reward.judge
    out: list[Violation] = []
    try:
        engine = kernel.get("rollout_engines", j.engine).load()
    except PluginError as exc:
        out.append(Violation(CORE, "reward.judge.engine", str(exc),
                             f"pick one of: {', '.join(kernel.names('rollout_engines'))}"))
        engine = None
    if engine is not None:
        if not (isinstance(engine, type) and issubclass(engine, RolloutEngine)):
            out.append(Violation(CORE, "reward.judge.engine", f"'{j.engine}' is not a RolloutEngine", "pick another"))
        else:
            try:  # the kernel's one validation, the one building the judge's engine runs
                kernel.options("rollout_engines", j.engine, j.options, "reward.judge.options", factory=engine)
            except OptionsError as exc:
                out += exc.violations
    out += template_violations(j.template, "reward.judge.template")
    path_bad = model_dir_violations(j.model.path, "reward.judge.model.path", "the judge")
    out += path_bad
    if path_bad:
        return out
    jc = judge_run_config(config)
    try:
        adapter = kernel.build("model_adapters", j.model.adapter)
    except PluginError as exc:
        return out + [Violation(CORE, "reward.judge.model.adapter", str(exc),
                                f"pick one of: {', '.join(kernel.names('model_adapters'))}")]
    try:
        hf = adapter.hf_config(jc)
    except Exception as exc:  # noqa: BLE001 - a config that does not load is the violation
        return out + [Violation(CORE, "reward.judge.model.path", f"the judge's config does not load: "
                                f"{type(exc).__name__}: {exc}", "point it at a model of the adapter's family")]
    try:
        tok = adapter.build_tokenizer(jc)
    except Exception as exc:  # noqa: BLE001
        return out + [Violation(CORE, "reward.judge.model.tokenizer", f"the judge's tokenizer does not load: "
                                f"{type(exc).__name__}: {exc}", "set reward.judge.model.tokenizer or save one in the model dir")]
    if j.chat_template and not getattr(tok, "chat_template", None):
        out.append(Violation(CORE, "reward.judge.chat_template", "the judge's tokenizer has no chat template",
                             "set reward.judge.chat_template: false, or use a tokenizer with one"))
    if len(tok) > getattr(hf, "vocab_size", len(tok)):
        out.append(Violation(CORE, "reward.judge.model.tokenizer", f"tokenizer has {len(tok)} tokens, the judge's "
                             f"embedding {hf.vocab_size}", "use the tokenizer the judge was trained with"))
    ctx = getattr(hf, "max_position_embeddings", None)
    need = (j.max_prompt_tokens or 1) + j.sampling.max_new_tokens
    if ctx is not None and need > ctx:
        out.append(Violation(CORE, "reward.judge.max_prompt_tokens", f"max_prompt_tokens + sampling.max_new_tokens "
                             f"= {need} exceeds the judge's context ({ctx})", "lower reward.judge.max_prompt_tokens"))
    out += fit_violations([j.model.path, config.model.path or ""], "reward.judge.model.path", "the judge")
    return out


def reward_model_violations(config: RunConfig) -> list[Violation]:
    s = config.reward.reward_model
    out = template_violations(s.template, "reward.reward_model.template")
    bad = model_dir_violations(s.path, "reward.reward_model.path", "the reward model")
    if bad:
        return out + bad
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(s.path)
    except Exception as exc:  # noqa: BLE001
        return out + [Violation(CORE, "reward.reward_model.path", f"its config does not load: {type(exc).__name__}: "
                                f"{exc}", "point it at a transformers sequence-classification model")]
    archs = getattr(hf, "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        out.append(Violation(CORE, "reward.reward_model.path", f"{s.path} is a {archs[0]}, not a sequence-"
                             "classification model", "point it at an AutoModelForSequenceClassification checkpoint"))
    if s.label >= hf.num_labels:
        out.append(Violation(CORE, "reward.reward_model.label", f"label {s.label} but the head has "
                             f"{hf.num_labels} label(s)", f"set reward.reward_model.label below {hf.num_labels}"))
    try:
        from unirl.models.tokenizer import load_tokenizer

        load_tokenizer(s.tokenizer or s.path)
    except Exception as exc:  # noqa: BLE001
        out.append(Violation(CORE, "reward.reward_model.tokenizer", f"its tokenizer does not load: "
                             f"{type(exc).__name__}: {exc}", "set reward.reward_model.tokenizer"))
    out += fit_violations([s.path, config.model.path or ""], "reward.reward_model.path", "the reward model")
    return out
