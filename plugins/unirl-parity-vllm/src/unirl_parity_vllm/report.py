"""``unirl parity report ARTIFACT [--png PATH]``: render a verification artifact.

Prints the verdict, each phase's numbers, the weight versions with their receipts' fingerprints, the
runtime versions and the vLLM-side manifest summary. For a non-exact run (any mismatch) it also
writes a PNG histogram of |diff| per phase (next to the artifact unless ``--png`` says where).
Exit status: 0 for verdict ``pass``, 1 otherwise (so CI can gate on it), 2 for an input it cannot
use: a file that is not a parity artifact (:func:`check_artifact` names the file and the field), or a
``--png`` path holding a file this command did not write (core's rule for user-named outputs,
:func:`unirl.api.claim_output_file`; ``--force`` overrides it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from unirl.api import ConfigError, atomic_write_with, claim_output_file
from unirl_parity_vllm.artifact import SCHEMA
from unirl_parity_vllm.gate import HIST_BINS, HIST_LOW

#: what every problem with the input is fixed by
ARTIFACT_FIX = ("pass the artifact.json a parity run wrote (RUN_DIR/parity/artifact.json, from a run with "
                "UNIRL_PARITY_ENABLE=1), unedited")
#: written into the histogram's PNG metadata: how a later report knows it may replace the file
PLOT_MARK = "unirl parity report histogram"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_NUMBER = ((int, float), "a number")
_INT = ((int,), "an integer")
#: per phase: what render() and the histogram read, with its JSON type
PHASE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "passed": ((bool,), "a boolean"), "tokens": _INT, "mismatches": _INT, "max_abs_diff": _NUMBER, "k3": _NUMBER,
    "steps": ((list,), "a list"), "weight_versions": ((list,), "a list"), "hist": ((list,), "a list")}
ROUTING_FIELDS = {"tokens": _INT, "mismatch_tokens": _INT, "missing": _INT}


def check_artifact(doc: Any, path: Path) -> dict[str, Any]:
    """``doc`` when it is a parity artifact this report can render, else a :class:`ConfigError` naming
    ``path``, the field and what it should be.

    Why: render() indexes the artifact directly, so a JSON list or a phase without ``passed`` used to
    end in an ``AttributeError`` / ``KeyError`` traceback that named neither the file nor the field."""
    def bad(field: str, problem: str) -> ConfigError:
        return ConfigError(f"parity artifact {path}: {field} {problem} (fix: {ARTIFACT_FIX})")

    def need(obj: dict[str, Any], key: str, kinds: tuple[type, ...], name: str, where: str) -> None:
        if key not in obj:
            raise bad(f"{where}{key}", f"is missing (expected {name})")
        v = obj[key]
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise bad(f"{where}{key}", f"is a JSON {_json_name(v)}, expected {name}")

    if not isinstance(doc, dict):
        raise ConfigError(f"parity artifact {path}: a JSON {_json_name(doc)}, not a parity artifact (an object with "
                          f"schema {SCHEMA!r}) (fix: {ARTIFACT_FIX})")
    if doc.get("schema") != SCHEMA:
        raise bad("schema", f"is {doc.get('schema')!r}, this report reads {SCHEMA!r}")
    need(doc, "verdict", (str,), "a string", "")
    if doc["verdict"] not in ("pass", "fail", "incomplete"):
        raise bad("verdict", f"is {doc['verdict']!r}, expected pass, fail or incomplete")
    need(doc, "phases", (dict,), "an object", "")
    for name, phase in doc["phases"].items():
        if not isinstance(phase, dict):
            raise bad(f"phases.{name}", f"is a JSON {_json_name(phase)}, expected an object")
        for key, (kinds, what) in PHASE_FIELDS.items():
            need(phase, key, kinds, what, f"phases.{name}.")
        if len(phase["hist"]) != HIST_BINS:
            raise bad(f"phases.{name}.hist", f"has {len(phase['hist'])} bins, expected {HIST_BINS}")
        if phase.get("routing") is not None:
            need(phase, "routing", (dict,), "an object", f"phases.{name}.")
            for key, (kinds, what) in ROUTING_FIELDS.items():
                need(phase["routing"], key, kinds, what, f"phases.{name}.routing.")
    for key in ("run", "runtime"):
        if key in doc:
            need(doc, key, (dict,), "an object", "")
    if "weights" in doc:
        need(doc, "weights", (list,), "a list", "")
        for i, w in enumerate(doc["weights"]):
            if not isinstance(w, dict):
                raise bad(f"weights[{i}]", f"is a JSON {_json_name(w)}, expected an object")
            need(w, "version", (int,), "an integer", f"weights[{i}].")
    return doc


def _json_name(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _bin_labels() -> list[str]:
    return ["0"] + [f"1e{HIST_LOW + i}" for i in range(HIST_BINS - 1)]


def render(doc: dict[str, Any]) -> str:
    lines = [f"parity artifact ({doc.get('schema')}): verdict {doc.get('verdict', '?').upper()}"]
    run = doc.get("run", {})
    lines.append(f"  run {run.get('name')}: engine {run.get('engine')}, actor {run.get('actor')}, "
                 f"dtype {run.get('dtype')}, {run.get('steps_done')} steps, {run.get('optimizer_steps')} optimizer steps")
    for name in ("initial_checkpoint", "post_update_reload"):
        p = doc.get("phases", {}).get(name)
        if p is None:
            lines.append(f"  {name}: MISSING")
            continue
        frac = p.get("bit_equal_fraction")
        lines.append(
            f"  {name}: {'pass' if p['passed'] else 'FAIL'} - {p['tokens']} tokens, {p['mismatches']} mismatches"
            f" ({'-' if frac is None else f'{100 * frac:.2f} % bit-equal'}), max |diff| {p['max_abs_diff']:.3g}, "
            f"k3 {p['k3']:.3g}; steps {p['steps']}, weight versions {p['weight_versions']}, "
            f"optimizer steps before {p.get('optimizer_steps_before')}..{p.get('max_optimizer_steps_before')}")
        r = p.get("routing")
        if r:  # a Mixture-of-Experts model: engine vs replay top-k sets, and expert load
            lines.append(f"    routing: {r['mismatch_tokens']} of {r['tokens']} tokens with a different top-k expert "
                         f"set, {r['missing']} without an engine record; busiest expert vs uniform per layer "
                         f"{r.get('max_load_vs_uniform')}")
    for w in doc.get("weights", []):
        fps = sorted({r.get("fingerprint", "?") for r in w.get("receipts", [])})
        lines.append(f"  version {w['version']}: {len(w.get('receipts', []))} receipt(s), fingerprint "
                     f"{', '.join(str(f)[:16] for f in fps)}, after {w.get('optimizer_steps_before')} optimizer steps")
    pk = doc.get("runtime", {}).get("packages", {})
    lines.append("  runtime: " + ", ".join(f"{k} {v}" for k, v in pk.items() if v))
    man = doc.get("manifest")
    if isinstance(man, dict):
        keys = ", ".join(sorted(man)[:8])
        lines.append(f"  vLLM manifest: {keys}")
    if doc.get("skipped_updates"):
        lines.append(f"  skipped (off-policy) updates: {doc['skipped_updates']}")
    return "\n".join(lines)


def histogram_png(doc: dict[str, Any], path: Path) -> Path | None:
    """A bar chart of |diff| per phase (log10 bins); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = _bin_labels()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    phases = [(n, p) for n, p in doc.get("phases", {}).items()]
    width = 0.8 / max(1, len(phases))
    for i, (name, p) in enumerate(phases):
        ax.bar([x + i * width for x in range(len(labels))], p["hist"], width=width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=45, fontsize=7)
    ax.set_yscale("symlog")
    ax.set_xlabel("|replay - rollout| (bin lower edge; 0 = bit-equal)")
    ax.set_ylabel("tokens")
    ax.set_title(f"parity |diff| histogram - verdict {doc.get('verdict')}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:  # format given: the suffix of a user-named path decides nothing; atomic: no half-written plot
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png",
                                                               metadata={"Description": PLOT_MARK}))
    finally:
        plt.close(fig)


def _is_plot(path: Path, *, legacy: bool) -> bool:
    """An earlier histogram: a PNG carrying :data:`PLOT_MARK`; at the default path next to the artifact
    (the run's parity directory) any PNG, as histograms written before the mark existed carry none."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    return head.startswith(PNG_SIGNATURE) and (legacy or PLOT_MARK.encode() in head)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unirl parity", description="parity artifact tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="render a parity artifact (runs/<name>/parity/artifact.json)")
    r.add_argument("artifact")
    r.add_argument("--png", default=None, help="where the |diff| histogram goes (non-exact runs)")
    r.add_argument("--force", action="store_true",
                   help="overwrite --png even when the file there is not a histogram this command wrote")
    args = p.parse_args(argv)
    path = Path(args.artifact)
    if path.is_dir():
        path = path / "parity" / "artifact.json" if (path / "parity").is_dir() else path / "artifact.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"not valid JSON: {exc}"
        raise ConfigError(f"cannot read parity artifact {path}: {why} (fix: {ARTIFACT_FIX})") from None
    doc = check_artifact(doc, path)
    png_path = None
    if any(ph["mismatches"] for ph in doc["phases"].values()):
        default = path.with_name("diff_hist.png")
        png_path = claim_output_file(Path(args.png) if args.png else default, field="--png", force=args.force,
                                     what="parity |diff| histogram",
                                     is_ours=lambda f: _is_plot(f, legacy=f.resolve() == default.resolve()))
    print(render(doc))
    if png_path is not None:
        png = histogram_png(doc, png_path)
        print(f"  |diff| histogram: {png}" if png else "  (matplotlib missing: no histogram)")
    return 0 if doc["verdict"] == "pass" else 1
