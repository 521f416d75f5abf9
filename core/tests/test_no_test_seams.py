"""Production code carries no entry points that only tests call (issue 34 item 5).

Why: a seam kept for tests (``train(stop_after=)``, ``RankGroup.kill_rank``, a public
``SGLangEngine.update_from_dir``) is API that no run uses, so nothing keeps it honest, and a test that
goes through it proves the seam, not the path a run takes. The tests now stop a run by preemption
(SIGTERM through the trainer's own handler) or a shorter ``trainer.steps``, kill a rank's Ray actor
themselves, and load weights through ``load_weights``. This guard keeps the names from coming back.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for p in [ROOT / "core" / "src", *ROOT.glob("plugins/*/src")] if p.is_dir())
#: functions that only tests called, and parameters that only tests passed
GONE_FUNCTIONS = {"kill_rank", "update_from_dir"}
GONE_PARAMETERS = {"stop_after"}


def test_test_only_seams_stay_out_of_production():
    assert len(SOURCES) >= 5, SOURCES
    found = []
    for src in SOURCES:
        for f in sorted(src.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                where = f"{f.relative_to(ROOT)}:{node.lineno}"
                if node.name in GONE_FUNCTIONS:
                    found.append(f"{where}: def {node.name}")
                args = node.args
                names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
                found += [f"{where}: {node.name}({p}=...)" for p in sorted(names & GONE_PARAMETERS)]
    assert not found, "test-only seams in production code (drive the real path from the test):\n" + "\n".join(found)
