"""The options of ``plugins.rollout_correction`` (no torch: preflight imports this).

```yaml
algorithm:
  old_logp_source: replay          # required for any mode but none
  modifiers: [rollout_correction]
plugins:
  rollout_correction:
    mode: token_tis                # none | token_tis | seq_tis | token_mask | seq_mask | geo_mask
    threshold: 2.0                 # TIS cap / upper edge of the mask band
    threshold_lower: 0.5           # mask modes only: lower edge of the band (default 1 / threshold)
```

or the seed's one key, ``algorithm.rollout_is_threshold: 2.0``: the same as ``mode: token_tis,
threshold: 2.0`` with the modifier listed (core's config lists it).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from unirl.api import StrictOptions, plugin_section

#: every mode, ``none`` first (the default: weights untouched, diagnostics only)
MODES = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask")
TIS_MODES = ("token_tis", "seq_tis")
MASK_MODES = ("token_mask", "seq_mask", "geo_mask")

Mode = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask"]

#: the section name under ``RunConfig.plugins`` and the loss-modifier name
SECTION = "rollout_correction"


class RolloutCorrectionOptions(StrictOptions):
    """``plugins.rollout_correction``. Unknown keys are errors (typos are caught in preflight)."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode = "none"
    #: token_tis / seq_tis: the cap C of w = min(ratio, C) (>= 1, preflight); mask modes: the band's upper edge
    threshold: float = Field(2.0, gt=0)
    #: mask modes: the lower edge of the band (None: 1 / threshold); must stay None for the TIS modes
    threshold_lower: float | None = Field(None, ge=0)

    @field_validator("threshold")
    @classmethod
    def _positive_finite(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"must be a finite number > 0, got {v}")
        return v

    @field_validator("threshold_lower")
    @classmethod
    def _non_negative_finite(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"must be a finite number >= 0, got {v}")
        return v

    @property
    def lower(self) -> float:
        """The lower edge of the mask band."""
        return 1.0 / self.threshold if self.threshold_lower is None else self.threshold_lower


def alias_threshold(config: object) -> float | None:
    """``algorithm.rollout_is_threshold`` (the seed's one key), or None when unset."""
    return getattr(getattr(config, "algorithm", None), "rollout_is_threshold", None)


def section_of(config: object) -> dict | None:
    """The raw ``plugins.rollout_correction`` mapping as the user wrote it (None when absent)."""
    return (getattr(config, "plugins", None) or {}).get(SECTION)


def merged_options(section: RolloutCorrectionOptions, alias: float | None) -> RolloutCorrectionOptions:
    """The typed section on top of what ``algorithm.rollout_is_threshold: C`` means (``{mode: token_tis,
    threshold: C}``): the keys the section sets win. Keys given in both places must agree; preflight
    refuses a disagreement, so the merge never has to pick a winner."""
    if alias is None:
        return section
    given = section.model_dump(include=section.model_fields_set)
    return RolloutCorrectionOptions.model_validate({"mode": "token_tis", "threshold": alias, **given})


def options_of(config: object) -> RolloutCorrectionOptions:
    """The options of a run config: ``plugins.rollout_correction`` as the kernel validated it against the
    declared :class:`RolloutCorrectionOptions` (:func:`unirl.api.plugin_section`; defaults when absent),
    merged with the alias (:func:`merged_options`)."""
    return merged_options(plugin_section(config, SECTION), alias_threshold(config))
