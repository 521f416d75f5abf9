"""unirl-parity-vllm: bitwise train-inference parity for UniRL.

* :mod:`unirl_parity_vllm.ops` - batch-invariant reference ops (pure torch, autograd-able), used by
  the trainer, the embedded engine and (through ``vllm_side``) vLLM;
* :mod:`unirl_parity_vllm.providers` - the ``qwen3`` :class:`~unirl.contracts.ParityProvider`;
* :mod:`unirl_parity_vllm.gate` - the before-backward parity gate;
* :mod:`unirl_parity_vllm.artifact` - the verification artifact (atomic JSON);
* :mod:`unirl_parity_vllm.profile` - the parity profile and its preflight;
* :mod:`unirl_parity_vllm.plugin` - the ``unirl.plugins`` entry point (no torch import).

Nothing is installed unless ``UNIRL_PARITY_ENABLE=1``.
"""

from __future__ import annotations

import os

ENV_FLAG = "UNIRL_PARITY_ENABLE"


def parity_enabled() -> bool:
    """``UNIRL_PARITY_ENABLE == "1"`` in this process's environment."""
    return os.environ.get(ENV_FLAG) == "1"


__all__ = ["ENV_FLAG", "parity_enabled"]
