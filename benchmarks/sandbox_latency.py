"""``python_sandbox`` latency: session start, first call (start included), steady calls, calls/s.

Three sides, interleaved in one process on this machine's cores:

* ``unisolated`` (the baseline): the old mode (rlimits + audit hook, no bubblewrap), what
  ``allow_unisolated: true`` runs;
* ``bwrap``: every session starts its own bubblewrap sandbox (namespaces, seccomp, cgroup) on demand;
* ``bwrap+pool``: the same with a warm pool (``pool_size``) of pre-started sandboxes.

Per side it prints p50/p99 of ``session_start``, of start + first call (what a trajectory's first tool
call waits), of a steady call (``print(1)`` in a live session), of ``session_end``, and steady calls/s
with ``--concurrency`` sessions in parallel; then each side's ratio against the baseline. Target: p50
of start + first call <= 100 ms (with the warm pool where a cold start is slower).

    .venv/bin/python benchmarks/sandbox_latency.py --sessions 30 --calls 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(box, sessions: int, calls: int, concurrency: int, gap: float) -> dict[str, list[float] | float]:
    start, first, steady, end = [], [], [], []
    for i in range(sessions):
        sid = f"b{i}"
        t0 = time.perf_counter()
        box.session_start(sid)
        t1 = time.perf_counter()
        assert box.execute(sid, {"code": "print(1)"}).content == "1\n"
        t2 = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            box.execute(sid, {"code": "x = sum(range(100)); print(x)"})
            steady.append(time.perf_counter() - t)
        t3 = time.perf_counter()
        box.session_end(sid)
        end.append(time.perf_counter() - t3)
        start.append(t1 - t0)
        first.append(t2 - t0)
        time.sleep(gap)  # a trajectory's model turn between tool sessions (lets the pool refill)
    done = [0]
    lock = threading.Lock()

    def worker(k: int) -> None:
        sid = f"c{k}"
        box.session_start(sid)
        t_end = time.perf_counter() + 2.0
        n = 0
        while time.perf_counter() < t_end:
            box.execute(sid, {"code": "print(1)"})
            n += 1
        box.session_end(sid)
        with lock:
            done[0] += n

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"start": start, "first": first, "steady": steady, "end": end, "calls_per_s": done[0] / 2.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=30, help="sessions per side")
    ap.add_argument("--calls", type=int, default=20, help="steady calls per session")
    ap.add_argument("--concurrency", type=int, default=2, help="parallel sessions for calls/s")
    ap.add_argument("--pool", type=int, default=2, help="warm pool size of the pooled side")
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between sessions (a model turn)")
    args = ap.parse_args()

    from unirl_agentic.sandbox import PythonSandbox, SandboxOptions

    sides = {
        "unisolated": SandboxOptions(allow_unisolated=True, bwrap="/nonexistent/bwrap", pool_size=0),
        "bwrap": SandboxOptions(pool_size=0),
        "bwrap+pool": SandboxOptions(pool_size=args.pool),
    }
    boxes = {name: PythonSandbox(options=o) for name, o in sides.items()}
    print(f"cores: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")
    for name, box in boxes.items():
        print(f"  {name}: {box.isolation}")
    time.sleep(1.0)  # the pool fills
    results: dict[str, dict] = {}
    for name, box in boxes.items():
        results[name] = measure(box, args.sessions, args.calls, args.concurrency, args.gap)
        box.close()
    base = results["unisolated"]
    print(f"\n{'side':<12} {'start p50/p99 ms':>18} {'start+call p50/p99':>20} {'call p50/p99 ms':>17} "
          f"{'end p50 ms':>11} {'calls/s':>8}")
    for name, r in results.items():
        print(f"{name:<12} {1e3 * pct(r['start'], .5):8.1f}/{1e3 * pct(r['start'], .99):<8.1f} "
              f"{1e3 * pct(r['first'], .5):10.1f}/{1e3 * pct(r['first'], .99):<8.1f} "
              f"{1e3 * pct(r['steady'], .5):8.2f}/{1e3 * pct(r['steady'], .99):<8.2f} "
              f"{1e3 * statistics.median(r['end']):10.1f} {r['calls_per_s']:8.0f}")
    print("\nratio against the unisolated baseline (same run):")
    for name, r in results.items():
        if name == "unisolated":
            continue
        print(f"  {name}: start+call p50 {pct(r['first'], .5) / pct(base['first'], .5):.2f}x, "
              f"call p50 {pct(r['steady'], .5) / pct(base['steady'], .5):.2f}x, "
              f"calls/s {r['calls_per_s'] / max(base['calls_per_s'], 1e-9):.2f}x")
    best = min(pct(results[n]["first"], .5) for n in ("bwrap", "bwrap+pool"))
    print(f"\ntarget p50 start+call <= 100 ms: {'met' if best <= 0.1 else 'NOT met'} ({1e3 * best:.1f} ms)")


if __name__ == "__main__":
    main()
