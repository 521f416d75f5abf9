"""``unirl export``: take an RL result out of a run directory as a plain Hugging Face model directory.

Why a command and not "copy the checkpoint": a checkpoint is the actor's private format (a DCP shard
set for FSDP, safetensors without config or tokenizer for the embedded actor). The export is the
public one: ``config.json``, ``model.safetensors`` in HF names with the tied head written once (as
``save_pretrained`` does; the loader re-ties it), the tokenizer and a generation config, so plain
transformers and plain vLLM load it with no UniRL import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.kernel.errors import ConfigError


def checkpoint_dir(run_dir: Path, step: int | None) -> Path:
    """The checkpoint to export: ``step_N`` when given, else the one ``checkpoints/latest`` names."""
    from unirl.actor.checkpoint import checkpoint_steps, latest_checkpoint

    root = run_dir / "checkpoints"
    steps = checkpoint_steps(root) if root.is_dir() else {}
    if step is None:
        latest = latest_checkpoint(root) if root.is_dir() else None
        if latest is None:
            raise ConfigError(f"{run_dir}: no checkpoint to export (no {root}/latest); train first, "
                              "or pass --step N")
        return latest
    if step not in steps:
        have = ", ".join(str(s) for s in sorted(steps)) or "none"
        raise ConfigError(f"--step {step}: {run_dir} has no checkpoint step_{step:06d} (kept steps: {have})")
    return steps[step]


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Any:
    """The config the run was trained with (``RUN_DIR/config.yaml``, written by ``unirl train``)."""
    from unirl.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.yaml); pass the directory "
                          "`unirl train` wrote (run.dir)")
    return load_config(str(path), list(overrides or []))


def finish_hf_dir(out: Path, tokenizer: Any) -> None:
    """Make the directory an inference model: ``use_cache`` on (training turns it off) and a generation
    config that stops on the tokenizer's EOS."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["use_cache"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        gen["eos_token_id"] = eos
        gen.setdefault("pad_token_id", getattr(tokenizer, "pad_token_id", None) or eos)
    gen.setdefault("bos_token_id", cfg.get("bos_token_id"))
    gen_path.write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2, sort_keys=True) + "\n")


def export_run(run_dir: str | Path, *, step: int | None = None, out: str | Path | None = None,
               overrides: list[str] | None = None) -> Path:
    """Export checkpoint ``step`` (default: latest) of ``run_dir`` to ``out`` (default ``RUN_DIR/hf``).

    The run's own actor loads the checkpoint (so any actor's format works) and writes the HF directory
    atomically; no engine is started."""
    from unirl.kernel.manager import load_kernel
    from unirl.trainer.loop import build_components

    run_dir = Path(run_dir)
    config = load_run_config(run_dir, [*(overrides or []), "trainer.progress=false"])
    ckpt = checkpoint_dir(run_dir, step)
    dest = Path(out) if out is not None else run_dir / "hf"
    c = build_components(config, load_kernel(), rollouts=False)
    try:
        c.actor.load(str(ckpt))
        c.actor.export_hf(str(dest))
    finally:
        c.close()
    finish_hf_dir(dest, c.tokenizer)
    return dest
