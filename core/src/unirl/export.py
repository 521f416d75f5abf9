"""``unirl export``: take an RL result out of a run directory as a plain Hugging Face model directory.

Why a command and not "copy the checkpoint": a checkpoint is the actor's private format (a DCP shard
set for FSDP, safetensors without config or tokenizer for the embedded actor). The export is the
public one: ``config.json``, ``model.safetensors`` in HF names with the tied head written once (as
``save_pretrained`` does; the loader re-ties it), the tokenizer and a generation config, so plain
transformers and plain vLLM load it with no UniRL import.

Why it never writes into ``--out`` directly: ``--out`` is a path the user names, and it may hold their
files. The export is staged in a hidden sibling, marked as an export (:data:`unirl.outputs.MARKER`),
and swapped in only when ``--out`` is absent, empty or an earlier export; anything else is refused
before any model is built (``--force`` replaces it). See :mod:`unirl.outputs`.

A vision-language run (the adapter declares ``vision``) also gets the image processor's
``preprocessor_config.json``, so transformers' ``AutoImageProcessor`` and vLLM build the processor the
run trained with; the chat template (image placeholders included) rides in the tokenizer's files.

A LoRA run (``actor.lora``) exports the merged model by default (base + adapter, the same HF directory
as a full fine-tune), or with ``--adapter`` the adapter alone as a peft directory
(``PeftModel.from_pretrained(base, dir)``; default ``RUN_DIR/adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.kernel.errors import ConfigError
from unirl.outputs import claim_output_dir, mark_output_dir, replace_output_dir

#: the :func:`unirl.outputs.mark_output_dir` kind of an HF export (``unirl export``, and a run's ``hf/``)
KIND = "export"
FIELD = "--out"


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
                          "`unirl train` wrote (run.output_dir/run.name)")
    return load_config(str(path), list(overrides or []))


def finish_hf_dir(out: Path, tokenizer: Any, **marker: object) -> None:
    """Make the directory an inference model: ``use_cache`` on (training turns it off) and a generation
    config that stops on the tokenizer's EOS. It is marked as an export (``marker``: what it came from),
    so a later ``unirl export`` may replace it and never anything else."""
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
    mark_output_dir(out, KIND, **marker)


def claim_export_dir(dest: Path, run_dir: Path, *, force: bool) -> Path:
    """Refuse, before any model is built, an ``--out`` that holds the run itself (even with --force: the
    swap would delete the checkpoint being exported) or files an export did not write."""
    here, run = dest.absolute(), run_dir.absolute()
    if here == run or here in run.parents:
        raise ConfigError(f"{FIELD} {dest}: it holds the run directory {run_dir} being exported; it is left "
                          "untouched (fix: choose another directory, e.g. the default RUN_DIR/hf)")
    return claim_output_dir(dest, kind=KIND, field=FIELD, force=force)


def export_run(run_dir: str | Path, *, step: int | None = None, out: str | Path | None = None,
               overrides: list[str] | None = None, force: bool = False, adapter: bool = False) -> Path:
    """Export checkpoint ``step`` (default: latest) of ``run_dir`` to ``out`` (default ``RUN_DIR/hf``, with
    ``adapter`` ``RUN_DIR/adapter``: the LoRA adapter alone, refused unless the run set ``actor.lora``).

    The run's own actor loads the checkpoint (so any actor's format works) and writes the HF directory
    into a staged sibling of ``out``, which then replaces ``out`` (see the module docstring for what it
    may replace; ``force``: anything). No engine is started."""
    import os
    import shutil

    from unirl.actor.checkpoint import ADAPTER_FILE, MODEL_FILE
    from unirl.kernel.manager import load_kernel
    from unirl.trainer import components
    from unirl.writable import check_free, disk_errors

    run_dir = Path(run_dir)
    config = load_run_config(run_dir, [*(overrides or []), "trainer.progress=false"])
    if adapter and config.actor.lora is None:
        raise ConfigError(f"--adapter: {run_dir} trained every weight (its config has no actor.lora), so there "
                          "is no adapter to export (fix: export without --adapter)")
    if adapter and config.model.path is None:
        raise ConfigError(f"--adapter: {run_dir} built its base model from scratch (model.path is unset), so an "
                          "adapter alone has no base directory to load onto (fix: export the merged model, without "
                          "--adapter, or train from a saved base with model.path)")
    ckpt = checkpoint_dir(run_dir, step)
    default = run_dir / ("adapter" if adapter else "hf")
    dest = claim_export_dir(Path(out) if out is not None else default, run_dir, force=force)
    weights = ckpt / (ADAPTER_FILE if adapter else MODEL_FILE)  # the export is about this size
    check_free(dest, weights.stat().st_size if weights.is_file() else None, FIELD, "the export")
    staged = dest.absolute().parent / f".{dest.name}.unirl-export-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)  # a crashed export of this pid; the name is ours
    c = components.build_components(config, load_kernel(), rollouts=False)
    try:
        c.actor.load(str(ckpt))
        with disk_errors(dest, FIELD, "the export"):  # a full disk: one line, the old --out as it was
            if adapter:
                c.actor.export_adapter(str(staged))
                mark_output_dir(staged, KIND, run=str(run_dir.absolute()), checkpoint=ckpt.name, adapter=True)
            else:
                c.actor.export_hf(str(staged))
                if c.adapter.vision:  # the model's own image processor, as the engine's start-up dir has it
                    c.adapter.image_processor(config).save_pretrained(str(staged))
                finish_hf_dir(staged, c.tokenizer, run=str(run_dir.absolute()), checkpoint=ckpt.name)
            return replace_output_dir(staged, dest, kind=KIND, field=FIELD, force=force)
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # gone already unless the export failed
        c.close()
