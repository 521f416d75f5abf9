"""The HF directory a server engine (vLLM, SGLang) starts from.

Why core owns it: a server engine loads weights from a directory, not from a module. With
``model.path`` set that is the user's checkpoint; without it the adapter's seeded model (the same one
the actor builds from ``run.seed``) is saved to ``<run_dir>/engine_init`` so engine and actor start
from equal weights. Each engine plugin once carried its own copy of this; one place keeps them equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def engine_init_dir(config: Any, adapter: Any, tokenizer: Any = None) -> tuple[str, Any]:
    """The start-up directory for ``config`` and the tokenizer it was written with.

    ``tokenizer`` is built by the adapter when ``None`` (and returned, so the engine keeps the one it
    saved). With ``model.path`` set nothing is written and the tokenizer is returned as given."""
    if config.model.path:
        return str(config.model.path), tokenizer
    out = Path(config.run_dir) / "engine_init"
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else adapter.build_tokenizer(config)
    model = adapter.build_model(config, tok)
    model.save_pretrained(str(out))
    if hasattr(tok, "save_pretrained"):  # a tokenizer built by code may have no files to save
        tok.save_pretrained(str(out))
    if adapter.vision:  # a server engine builds the model's processor from the directory (issue 71)
        adapter.image_processor(config).save_pretrained(str(out))
    del model
    return str(out), tok
