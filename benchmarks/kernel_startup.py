"""Wall time of `unirl plugins` (all installed plugins) against `python -c "import pluggy"`.

Target: under 0.5 s absolute on a 2-core CPU machine. Each command runs in a fresh interpreter, best
of N, so the numbers include interpreter start-up exactly as a user sees it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time


def best_of(cmd: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    unirl = shutil.which("unirl", path=str(__import__("pathlib").Path(sys.executable).parent)) or "unirl"
    baseline = best_of([sys.executable, "-c", "import pluggy"], args.repeats)
    plugins = best_of([unirl, "plugins"], args.repeats)
    plugins_json = best_of([unirl, "plugins", "--json"], args.repeats)
    print(f"{'command':<28}{'seconds':>10}{'x pluggy':>10}")
    print(f"{'python -c import pluggy':<28}{baseline:>10.3f}{1.0:>10.2f}")
    print(f"{'unirl plugins':<28}{plugins:>10.3f}{plugins / baseline:>10.2f}")
    print(f"{'unirl plugins --json':<28}{plugins_json:>10.3f}{plugins_json / baseline:>10.2f}")
    print(f"target: unirl plugins < 0.5 s -> {'met' if plugins < 0.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
