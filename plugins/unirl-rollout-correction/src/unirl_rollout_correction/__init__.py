"""Importance-sampling rollout correction for UniRL (loss modifier ``rollout_correction``).

Light at import: the torch code lives in :mod:`unirl_rollout_correction.correction`."""

from unirl_rollout_correction.options import MODES, RolloutCorrectionOptions

__all__ = ["MODES", "RolloutCorrectionOptions"]
