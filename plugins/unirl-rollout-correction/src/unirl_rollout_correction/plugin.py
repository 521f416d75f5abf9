"""The ``unirl.plugins`` entry point of ``unirl-rollout-correction``.

Registers the loss modifier ``rollout_correction`` (a lazy string: no torch at import) and checks
``plugins.rollout_correction`` in preflight, before anything is built.
"""

from __future__ import annotations

from typing import Any

from unirl.api import Violation, hookimpl

SOURCE = "unirl-rollout-correction"


@hookimpl
def unirl_loss_modifiers() -> dict[str, str]:
    return {"rollout_correction": "unirl_rollout_correction.correction:rollout_correction"}


@hookimpl
def unirl_config_sections() -> dict[str, str]:
    return {"rollout_correction": "unirl_rollout_correction.options:RolloutCorrectionOptions"}


@hookimpl
def unirl_preflight(config: Any, kernel: Any = None) -> list[Violation]:
    """Every problem with ``plugins.rollout_correction`` and its pairing with ``algorithm.*``."""
    from unirl.api import OptionsError, plugin_section, section_options
    from unirl_rollout_correction.options import (
        MASK_MODES,
        SECTION,
        TIS_MODES,
        RolloutCorrectionOptions,
        alias_threshold,
        merged_options,
        section_of,
    )

    section = section_of(config)
    modifiers = list(config.algorithm.modifiers)
    listed = SECTION in modifiers
    if section is None and not listed:
        return []  # the run does not use this plugin
    where = f"plugins.{SECTION}"
    known = ", ".join(RolloutCorrectionOptions.model_fields)
    if section is not None and not isinstance(section, dict):
        return [Violation(SOURCE, where, f"must be a mapping, got {type(section).__name__}",
                          f"e.g. {{mode: token_tis, threshold: 2.0}} (fields: {known})")]
    section = section or {}
    alias = alias_threshold(config)
    if alias is not None:
        clash = _alias_conflicts(alias, section)
        if clash:
            return clash  # the two spellings disagree: nothing below would be meaningful
    try:  # the kernel validates the declared section (typed, kept for the modifier's reader)
        typed = section_options(kernel, config, SECTION) if kernel is not None else plugin_section(config, SECTION)
        opts = merged_options(typed, alias)
    except OptionsError as exc:
        fixes = {f"{where}.mode": "one of: none, token_tis, seq_tis, token_mask, seq_mask, geo_mask",
                 f"{where}.threshold": "a finite number > 0 (2.0 is typical for token_tis)",
                 f"{where}.threshold_lower": "a finite number >= 0 below threshold, or remove it (default 1/threshold)"}
        return [Violation(SOURCE, v.field, v.message, fixes.get(v.field, f"known fields: {known}"))
                for v in exc.violations]
    if alias is not None:  # the keys the run sets, the alias's included
        section = {"mode": "token_tis", "threshold": alias, **section}
    out: list[Violation] = []
    if listed and "mode" not in section:
        out.append(Violation(SOURCE, f"{where}.mode", "algorithm.modifiers lists rollout_correction but no mode is set",
                             "set plugins.rollout_correction.mode (none = diagnostics only, or token_tis, seq_tis, "
                             "token_mask, seq_mask, geo_mask), or remove it from algorithm.modifiers"))
    if opts.mode != "none" and not listed:
        out.append(Violation(SOURCE, "algorithm.modifiers", f"plugins.rollout_correction.mode is {opts.mode} but "
                             "the rollout_correction modifier is not listed, so nothing would be corrected",
                             "add rollout_correction to algorithm.modifiers, or set the mode to none"))
    if opts.mode != "none" and config.algorithm.old_logp_source == "rollout":
        why = "algorithm.rollout_is_threshold enables token_tis, which" if alias is not None else f"mode {opts.mode}"
        out.append(Violation(SOURCE, "algorithm.old_logp_source", f"{why} compares pi_old with the "
                             "rollout policy, but with old_logp_source: rollout they are the same log-probs "
                             "(every weight would be 1)", "set algorithm.old_logp_source: replay, or mode: none"
                             if alias is None else "set algorithm.old_logp_source: replay, or remove "
                             "algorithm.rollout_is_threshold"))
    if opts.mode in TIS_MODES and opts.threshold < 1:
        out.append(Violation(SOURCE, "algorithm.rollout_is_threshold" if alias is not None and "threshold" not in
                             section else f"{where}.threshold", f"{opts.mode} caps each weight at the threshold; a "
                             f"cap of {opts.threshold:g} is below 1, so every on-policy token (ratio 1) would be "
                             "scaled down too", "set the cap >= 1 (2.0 is typical)"))
    if opts.mode in TIS_MODES and opts.threshold_lower is not None:
        out.append(Violation(SOURCE, f"{where}.threshold_lower", f"{opts.mode} truncates from above only; "
                             "threshold_lower would be ignored", "remove it, or use a mask mode"))
    if opts.mode in MASK_MODES and opts.lower > opts.threshold:
        out.append(Violation(SOURCE, f"{where}.threshold_lower", f"the band's lower edge {opts.lower:g} is above "
                             f"its upper edge threshold {opts.threshold:g}: every token would be masked",
                             "set threshold_lower <= threshold"))
    if listed and modifiers.count(SECTION) > 1:
        out.append(Violation(SOURCE, "algorithm.modifiers", "rollout_correction is listed more than once "
                             "(the weights would be applied twice)", "list it once"))
    return out


def _alias_conflicts(alias: float, section: dict) -> list[Violation]:
    """``algorithm.rollout_is_threshold: C`` means ``{mode: token_tis, threshold: C}``; the section may
    repeat either key, but a different value is two answers to one question (which correction runs?)."""
    out = []
    fix = ("set them equal, or keep one spelling: algorithm.rollout_is_threshold alone, or "
           "plugins.rollout_correction.{mode, threshold} alone")
    mode = section.get("mode", "token_tis")
    if mode != "token_tis":
        out.append(Violation(SOURCE, "algorithm.rollout_is_threshold", f"the alias enables mode token_tis but "
                             f"plugins.rollout_correction.mode is {mode}", fix))
    cap = section.get("threshold", alias)
    if cap != alias:
        out.append(Violation(SOURCE, "algorithm.rollout_is_threshold", f"the alias sets the cap to {alias:g} but "
                             f"plugins.rollout_correction.threshold is {cap!r}", fix))
    return out
