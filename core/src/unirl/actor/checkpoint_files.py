"""The layout of a checkpoint directory: the name of each file (see :mod:`unirl.actor.checkpoint`).

Why a module of its own: the save and load code (:mod:`unirl.actor.checkpoint`) and the health check a
resume runs first (:mod:`unirl.actor.checkpoint_health`) both name these files; neither imports the other.
All names are re-exported by :mod:`unirl.actor.checkpoint`.
"""

from __future__ import annotations

import re

FORMAT = 1
LATEST = "latest"
MODEL_FILE = "model.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"
REFERENCE_FILE = "reference.safetensors"
OPTIM_FILE = "optim.pt"
RNG_FILE = "rng.pt"
EXTRA_FILE = "extra.pt"
META_FILE = "meta.json"
ADAPTER_FILE = "adapter.safetensors"  # unirl.actor.lora.ADAPTER_FILE (that module imports peft lazily)
REFERENCE_ADAPTER_FILE = "reference_adapter.safetensors"
PRUNE_PREFIX = ".prune-"
#: public aliases (``unirl.api``) for an actor that writes its own checkpoint directory
CHECKPOINT_EXTRA_FILE = EXTRA_FILE
CHECKPOINT_META_FILE = META_FILE
#: a checkpoint directory of the trainer: ``step_<N>``
STEP_DIR = re.compile(r"^step_(\d+)$")
