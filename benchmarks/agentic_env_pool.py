"""Environment steps/s: in-process against a Ray worker pool of 1 and 2 env workers (``plugins.agentic.env_workers``).

What is timed is the environment side of a drive only (no model): ``--threads`` driver threads (the
controller's step threads) each take trajectories, ``reset``, ``--steps`` steps of scripted turns, ``close``,
through either the environment object itself (in-process) or :class:`unirl_agentic.pool.EnvPool`.
The environments are the real ones:

* ``search``: each turn is a ``search`` tool call on the bm25s index (parse, BM25, render);
* ``textworld``: each turn is a command in a real TextWorld game (one-room quests, generated on first use
  into .cache/textworld).

The sides are interleaved (in-process, 1 worker, 2 workers; ``--repeats`` rounds) and the median steps/s
of each is printed, then each pool side's ratio to in-process. Ray starts locally (``connect_ray``).

    .venv/bin/python benchmarks/agentic_env_pool.py --env search --trajectories 64 --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def search_factory():
    from unirl_agentic.search.environment import SearchEnvironment

    from unirl.api import load_config

    return SearchEnvironment(config=load_config(None, ["plugins.agentic.tools.search.k=3",
                                                       "plugins.agentic.max_turns=100"]))


def textworld_factory():
    from unirl_agentic.games.environment import TextWorldEnvironment
    from unirl_agentic.games.options import TextWorldOptions

    return TextWorldEnvironment(options=TextWorldOptions(max_steps=200))


FACTORIES = {"search": search_factory, "textworld": textworld_factory}


def turns(env_name: str, i: int, steps: int) -> tuple[str, list[str]]:
    """(the sample's answer, its scripted turns)."""
    if env_name == "search":
        from unirl_agentic.environment import render_call

        return "x", [render_call("search", {"query": f"capital of person{i} step{j} born"}) for j in range(steps)]
    return f"train/{i % 4}", [("look", "inventory", "examine box", "go north")[j % 4] for j in range(steps)]


def drive(env, env_name: str, trajectories: int, steps: int, threads: int, offset: int) -> float:
    from unirl.api import Sample

    def one(i: int) -> int:
        answer, script = turns(env_name, i, steps)
        s = Sample(id=f"p{offset + i}/0", prompt_ids=[1], answer=answer)
        env.reset(s)
        try:
            for text in script:
                if env.step(s, text).done:
                    break
        finally:
            env.close(s)
        return len(script)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(one, range(trajectories)))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", choices=sorted(FACTORIES), default="search")
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4, help="driver threads (the controller's step threads)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import os

    from unirl_agentic.pool import EnvPool

    from unirl.api import connect_ray

    factory = FACTORIES[args.env]
    local = factory()
    if args.env == "textworld":  # generate the games once, outside the timing
        for i in range(4):
            local.game(f"train/{i}")
    started = connect_ray(num_cpus=os.cpu_count() or 2)
    pools = {1: EnvPool(factory, 1), 2: EnvPool(factory, 2)}
    sides = {"in-process": local, "1 worker": pools[1], "2 workers": pools[2]}
    for env in sides.values():  # warm-up: imports, index builds, first games
        drive(env, args.env, 4, 2, 2, offset=10_000)
    rates: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for r in range(args.repeats):
            for name, env in sides.items():
                rates[name].append(drive(env, args.env, args.trajectories, args.steps, args.threads,
                                         offset=r * 100_000))
    finally:
        for p in pools.values():
            p.shutdown()
        if started:
            import ray

            ray.shutdown()
    load = os.getloadavg()[0]
    base = statistics.median(rates["in-process"])
    print(f"env {args.env}: {args.trajectories} trajectories x {args.steps} steps, {args.threads} driver threads, "
          f"{args.repeats} interleaved repeats, load average {load:.1f}, {os.cpu_count()} cores")
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(f"  {name:10s} {med:9.1f} env steps/s (runs {', '.join(f'{x:.0f}' for x in xs)})  "
              f"{med / base:5.2f}x in-process")


if __name__ == "__main__":
    main()
