"""What the Dynamo mocker is told about the engine fleet: the scheduling limits the trace records, and the
what-if knobs of ``unirl trace replay --workers N --engine KEY=VALUE --router-mode MODE``.

Why a module of its own: a replay has two sources of engine arguments that must not be confused.

* **Known limits** (:func:`known_engine_args`): facts of the captured engine that the mocker has a
  parameter for (its batch limit ``max_num_seqs``, its per-step token budget ``max_num_batched_tokens``,
  chunked prefill and prefix caching switches). They come from the trace's provenance (the engine's
  options as the run wrote them), never from the engine's name, and are passed in every replay, fitted
  or not, so a calibration fits speed, not scheduling.
* **What-if knobs** (:class:`Fleet`): a fleet other than the captured one (more workers, another
  router, another batch limit). With any knob set the replay is a *prediction for a fleet that was not
  measured*, so the report compares it with the prediction at the captured fleet, never with the
  measurements (:func:`whatif_summary`).

The mocker's own vocabulary (Dynamo 1.6.1, ``dynamo.mocker.config.build_mocker_engine_args``) names the
engine keys accepted here (:data:`ENGINE_KNOBS`); ``speedup_ratio`` / ``decode_speedup_ratio`` are the
calibration's and are not what-if knobs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from unirl.api import ConfigError

#: mocker engine arguments that describe the scheduler (not its speed), with their Python types
ENGINE_KNOBS: dict[str, type] = {"max_num_seqs": int, "max_num_batched_tokens": int, "num_gpu_blocks": int,
                                 "enable_chunked_prefill": bool, "enable_prefix_caching": bool}
#: Dynamo 1.6.1 ``run_trace_replay(router_mode=...)`` values for aggregated workers
ROUTER_MODES = ("round_robin", "kv_router")


@dataclass(frozen=True)
class Fleet:
    """A what-if fleet: ``None`` / empty fields keep what the trace captured."""

    workers: int | None = None
    router_mode: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def is_whatif(self) -> bool:
        return self.workers is not None or self.router_mode is not None or bool(self.engine)

    def describe(self) -> dict[str, Any]:
        return {"workers": self.workers, "router_mode": self.router_mode, "engine": dict(self.engine)}


def parse_fleet(workers: int | None = None, router_mode: str | None = None,
                engine: list[str] | None = None) -> Fleet:
    """The CLI's what-if flags, checked before any replay (one line naming the flag and the fix)."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers}: give the number of engine workers to predict for (>= 1)")
    if router_mode is not None and router_mode not in ROUTER_MODES:
        raise ConfigError(f"--router-mode {router_mode!r}: use one of {', '.join(ROUTER_MODES)}")
    out: dict[str, Any] = {}
    for item in engine or []:
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in ENGINE_KNOBS or not value:
            raise ConfigError(f"--engine {item!r}: write KEY=VALUE with KEY one of {', '.join(ENGINE_KNOBS)} "
                              "(the mocker's scheduler arguments; speed is fitted by `unirl trace calibrate`)")
        out[key] = _cast(key, value, item)
    return Fleet(workers=workers, router_mode=router_mode, engine=out)


def _cast(key: str, value: str, item: str) -> Any:
    kind = ENGINE_KNOBS[key]
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"--engine {item!r}: {key} takes true or false")
        return value.lower() in ("true", "1")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--engine {item!r}: {key} takes a positive integer") from None
    if n < 1:
        raise ConfigError(f"--engine {item!r}: {key} takes a positive integer")
    return n


def known_engine_args(manifest: dict[str, Any]) -> dict[str, Any]:
    """The captured engine's scheduling limits that the mocker has a parameter for (see the module doc).

    ``provenance.engine.max_num_seqs`` is the exporter's reading of the batch limit; an engine option
    spelled like a mocker scheduler argument (top level or under ``engine_args``, as the run's config
    wrote it) is passed as that argument."""
    engine = manifest["provenance"].get("engine") or {}
    opts = engine.get("options") if isinstance(engine.get("options"), dict) else {}
    nested = opts.get("engine_args") if isinstance(opts.get("engine_args"), dict) else {}
    out: dict[str, Any] = {}
    for source in (opts, nested):
        for key, kind in ENGINE_KNOBS.items():
            v = source.get(key)
            if isinstance(v, kind) and (kind is bool or not isinstance(v, bool)):
                out[key] = v
    if isinstance(engine.get("max_num_seqs"), int):
        out["max_num_seqs"] = engine["max_num_seqs"]
    return out


def captured_workers(manifest: dict[str, Any]) -> int:
    """Engine workers that served the capture (distinct ``worker`` ids in its outcomes)."""
    return max(1, len((manifest["provenance"].get("engine") or {}).get("workers") or [None]))


def replay_args(manifest: dict[str, Any], fleet: Fleet | None, params: dict[str, Any] | None) -> dict[str, Any]:
    """``run_trace_replay`` keyword arguments for the fleet: workers, router, engine (limits, knobs, speed)."""
    fleet = fleet or Fleet()
    engine = {"block_size": int(manifest["block_size"]), **known_engine_args(manifest), **fleet.engine,
              **(params or {})}
    out: dict[str, Any] = {"num_workers": fleet.workers or captured_workers(manifest),
                           "extra_engine_args": {"engine": engine}}
    if fleet.router_mode:
        out["router_mode"] = fleet.router_mode
    return out


def whatif_summary(at_capture: dict[str, Any], whatif: dict[str, Any], fleet: Fleet,
                   manifest: dict[str, Any]) -> dict[str, Any]:
    """Predicted rollout time at the what-if fleet against the prediction at the captured fleet (both
    from the same replay parameters): per batch, and the sum over batches (the run's rollout time)."""
    base = {b["batch"]: b["predicted_ms"] for b in at_capture["batch_readiness"]}
    rows = [{"batch": b["batch"], "predicted_ms_captured_fleet": base[b["batch"]], "predicted_ms_whatif": b["predicted_ms"],
             "measured_ms_captured_fleet": b["measured_ms"]} for b in whatif["batch_readiness"]]
    tot_base = sum(r["predicted_ms_captured_fleet"] for r in rows)
    tot_new = sum(r["predicted_ms_whatif"] for r in rows)
    ratios = [r["predicted_ms_whatif"] / r["predicted_ms_captured_fleet"] for r in rows
              if r["predicted_ms_captured_fleet"] > 0]
    return {"fleet": fleet.describe(), "captured_workers": captured_workers(manifest),
            "captured_engine_args": known_engine_args(manifest), "batches": rows,
            "rollout_ms_predicted_captured_fleet": tot_base, "rollout_ms_predicted_whatif": tot_new,
            "rollout_ms_measured_captured_fleet": sum(r["measured_ms_captured_fleet"] for r in rows),
            "median_batch_ratio_whatif_over_captured": statistics.median(ratios) if ratios else None,
            "note": "a prediction for a fleet that was not measured: compared with the replay of the captured "
                    "fleet under the same timing parameters, not with measurements"}
