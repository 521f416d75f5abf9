"""``unirl parity report ARTIFACT [--png PATH]``: render a verification artifact.

Prints the verdict, each phase's numbers, the weight versions with their receipts' fingerprints, the
runtime versions and the vLLM-side manifest summary. For a non-exact run (any mismatch) it also
writes a PNG histogram of |diff| per phase (next to the artifact unless ``--png`` says where).
Exit status: 0 for verdict ``pass``, 1 otherwise (so CI can gate on it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from unirl.api import UniRLError
from unirl_parity_vllm.gate import HIST_BINS, HIST_LOW


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="unirl parity", description="parity artifact tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="render a parity artifact (runs/<name>/parity/artifact.json)")
    r.add_argument("artifact")
    r.add_argument("--png", default=None, help="where the |diff| histogram goes (non-exact runs)")
    args = p.parse_args(argv)
    path = Path(args.artifact)
    if path.is_dir():
        path = path / "parity" / "artifact.json" if (path / "parity").is_dir() else path / "artifact.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UniRLError(f"cannot read parity artifact {path}: {exc}") from None
    print(render(doc))
    if any(ph.get("mismatches") for ph in doc.get("phases", {}).values()):
        png = histogram_png(doc, Path(args.png) if args.png else path.with_name("diff_hist.png"))
        print(f"  |diff| histogram: {png}" if png else "  (matplotlib missing: no histogram)")
    return 0 if doc.get("verdict") == "pass" else 1
