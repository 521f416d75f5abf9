"""The ``unirl`` command line.

Errors UniRL raises on purpose (bad recipe, bad plugin, failed preflight) print as one message and exit
2; ``--debug`` shows the traceback. ``unirl plugins`` imports neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from unirl import __version__
from unirl.kernel.errors import UniRLError

EXAMPLES = """examples:
  unirl plugins                          what is installed and what each plugin registers
  unirl recipes                          the recipes that ship with unirl-core (run one by name)
  unirl recipes copy arith-tiny my/      write one (and the recipes it extends) to edit
  unirl train arith-tiny                 a packaged recipe by name, or a path to a YAML file
  unirl config recipes/arith-tiny.yaml rollout.n=4
  unirl preflight recipes/arith-tiny.yaml rollout.engine=vllm
  unirl train recipes/arith-tiny.yaml trainer.steps=10
  unirl export runs/arith-tiny --out my-model     an HF directory plain transformers / vLLM load
  unirl eval recipes/arith-tiny.yaml model.path=my-model --k 8

outputs (--out, run.output_dir) never replace files UniRL did not write; see docs/cli.md.
plugins may add commands (hook unirl_commands); `unirl plugins` lists them under "commands".
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unirl", description="UniRL: RL post-training for language models.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"unirl {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks for UniRL errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser("plugins", help="list discovered plugins and what they register")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    def recipe_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_, description=help_)
        c.add_argument("recipe", help="YAML recipe file, or the name of a packaged recipe (`unirl recipes`)")
        c.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides, e.g. rollout.n=4")
        return c

    rp = sub.add_parser("recipes", help="list the packaged recipes; `unirl recipes copy NAME [DIR]` writes one",
                        description="list the recipes that ship with unirl-core; `unirl train NAME` runs one")
    rsub = rp.add_subparsers(dest="recipes_command", metavar="ACTION")
    rc = rsub.add_parser("copy", help="write a packaged recipe (and the recipes it extends) to DIR, to edit",
                         description="write a packaged recipe (and the recipes it extends) to DIR, to edit")
    rc.add_argument("name", help="a name `unirl recipes` lists")
    rc.add_argument("dir", nargs="?", default=".", help="directory to write to (default: the current one)")
    rc.add_argument("--force", action="store_true", help="replace earlier, unedited copies in DIR (never a file you edited or wrote)")

    recipe_cmd("config", "print the resolved config (recipe + overrides + defaults)")
    recipe_cmd("preflight", "check a recipe against every installed plugin; exit 2 on any violation")
    recipe_cmd("plan", "predict each device's peak memory (no model built, no GPU needed): items, total, budget")
    recipe_cmd("train", "run RL training (SFT warm start first when sft.steps > 0)")
    recipe_cmd("sft", "run only the supervised warm start (on the rollout controller's demonstrations)")

    ex = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory",
                        description="write a run's checkpoint as a Hugging Face model directory "
                                    "(config, safetensors, tokenizer, generation config)")
    ex.add_argument("run_dir", help="the directory `unirl train` wrote (run.output_dir/run.name)")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ex.add_argument("--out", default=None, help="output directory (default: RUN_DIR/hf); it must be absent, "
                    "empty or an earlier export")
    ex.add_argument("--force", action="store_true", help="write into --out even when it holds other files (they "
                    "are kept; only an earlier export's files are replaced)")
    ex.add_argument("--adapter", action="store_true", help="a LoRA run (actor.lora): write the adapter alone as a "
                    "peft directory (default --out: RUN_DIR/adapter) instead of the merged model")

    ev = recipe_cmd("eval", "avg@k and pass@k of model.path on a data split, with per-prompt results")
    ev.add_argument("--k", type=int, default=None, help="samples per prompt (default: trainer.eval_k)")
    ev.add_argument("--split", choices=("eval", "train"), default="eval", help="data split (default: eval)")
    ev.add_argument("--out", default=None, help="per-prompt JSONL (default: RUN_DIR/eval-SPLIT.jsonl); it "
                    "must be absent or an earlier eval's")
    ev.add_argument("--force", action="store_true", help="overwrite --out even when it is another file")
    ev.add_argument("--threshold", type=float, default=1.0,
                    help="reward counted as correct for pass@k (default 1.0); inside the reward's range")
    return p


def cmd_plugins(args: argparse.Namespace) -> int:
    from unirl.kernel.manager import load_kernel

    kernel = load_kernel()
    if args.json:
        print(json.dumps([p.as_dict() for p in kernel.plugins], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="UniRL plugins", show_lines=False)
    for col in ("entry point", "distribution", "version", "status", "registers"):
        table.add_column(col)
    for rec in kernel.plugins:
        regs = "; ".join(f"{k}: {', '.join(v)}" for k, v in rec.registers.items()) or "-"
        status = {"loaded": "[green]loaded[/]", "failed": "[red]failed[/]", "disabled": "[yellow]disabled[/]"}[rec.status]
        if rec.error:
            status += f"\n{rec.error}"
        table.add_row(rec.entry_point, rec.dist, rec.version, status, regs)
    Console().print(table)
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from unirl.config import PACKAGED_RECIPES, copy_recipe, packaged_recipes, recipe_summary

    if getattr(args, "recipes_command", None) == "copy":
        written = copy_recipe(args.name, args.dir, force=args.force)
        extra = f" (and the recipes it extends: {', '.join(w.name for w in written[1:])})" if written[1:] else ""
        print(f"wrote {written[0]}{extra}; run it with: unirl train {written[0]}")
        return 0
    recipes = packaged_recipes()
    width = max(map(len, recipes), default=0)
    for name, path in recipes.items():
        print(f"{name:<{width}}  {recipe_summary(path)}".rstrip())
    print(f"{len(recipes)} recipes in {PACKAGED_RECIPES}; run one with `unirl train NAME`, edit one after "
          "`unirl recipes copy NAME [DIR]`")
    return 0


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from unirl.config import load_config
    from unirl.kernel.manager import load_kernel

    return load_config(args.recipe, args.overrides), load_kernel()


def cmd_config(args: argparse.Namespace) -> int:
    from unirl.config import dump_config, load_config

    print(dump_config(load_config(args.recipe, args.overrides)), end="")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from unirl.preflight import check

    config, kernel = _load(args)
    check(config, kernel)
    print("preflight: ok")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from unirl.memory_plan.plan import plan, table

    config, kernel = _load(args)
    print(table(plan(config, kernel, kernel.get("model_adapters", config.model.adapter).load()())))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from unirl.trainer.loop import train

    config, kernel = _load(args)
    train(config, kernel)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from unirl.trainer.loop import train

    config, kernel = _load(args)
    train(config, kernel, rl=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from unirl.export import export_run

    out = export_run(args.run_dir, step=args.step, out=args.out, force=args.force, adapter=args.adapter)
    if args.adapter:
        print(f"exported {out} (load it with peft's PeftModel.from_pretrained(base_model, '{out}'))")
    else:
        print(f"exported {out} (load it with transformers' from_pretrained or vllm.LLM)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from unirl.evaluation import evaluate_model, summary

    config, kernel = _load(args)
    print(summary(evaluate_model(config, kernel, k=args.k, split=args.split, out=args.out,
                                 threshold=args.threshold, force=args.force)))
    return 0


COMMANDS = {"plugins": cmd_plugins, "recipes": cmd_recipes, "config": cmd_config, "preflight": cmd_preflight, "plan": cmd_plan,
            "train": cmd_train,
            "sft": cmd_sft, "export": cmd_export, "eval": cmd_eval}


def _plugin_command(argv: list[str]) -> tuple[Any, list[str], bool] | None:
    """``(factory, rest, debug)`` when ``argv`` names a command a plugin registered
    (``unirl_commands``) rather than a built-in one; None otherwise (argparse then handles it)."""
    i, debug = 0, False
    while i < len(argv) and argv[i] == "--debug":
        i, debug = i + 1, True
    if i >= len(argv) or argv[i].startswith("-") or argv[i] in COMMANDS:
        return None
    from unirl.kernel.manager import load_kernel

    kernel = load_kernel()
    if argv[i] not in kernel.registries["commands"]:
        return None
    return kernel.get("commands", argv[i]).load(), argv[i + 1:], debug


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # UniRL's own bars say what a run does; transformers' per-shard "Writing model shards" bars are noise
    # (read when transformers is imported, so set here; HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and "transformers" in sys.modules:
        from transformers.utils import (
            logging as hf_logging,  # imported earlier in this process (a test, a notebook)
        )

        hf_logging.disable_progress_bar()
    try:
        plugin = _plugin_command(argv)
    except UniRLError as exc:  # e.g. a bad UNIRL_PLUGINS allowlist, found while looking the command up
        if "--debug" in argv:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plugin is not None:
        factory, rest, debug = plugin
        try:
            return int(factory(rest) or 0)
        except UniRLError as exc:
            if debug:
                raise
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # ``key=value`` overrides may follow options (``unirl eval R --k 8 rollout.n=2``): argparse would
    # stop collecting positionals at the first option, so pick them up here.
    late = [e for e in extra if "=" in e and not e.startswith("-")]
    if extra != late or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(e for e in extra if e not in late or not hasattr(args, 'overrides'))}")
    if late:
        args.overrides = [*args.overrides, *late]
    if not args.command:
        parser.print_help()
        return 0
    from unirl.trainer.preempt import Preempted

    try:
        return COMMANDS[args.command](args)
    except Preempted as exc:  # SIGTERM / SIGINT: a clean stop at a step boundary, 143 / 130 as the shell expects
        print(f"unirl: {exc}\n{next_command(args)}", file=sys.stderr)
        return exc.exit_code
    except UniRLError as exc:
        if args.debug:
            raise
        print(f"error: {one_problem(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupt_hint(args), file=sys.stderr)
        return 130


def one_problem(exc: UniRLError) -> str:
    """A preflight report of one violation as one line (several stay a list, one per line)."""
    from unirl.kernel.errors import PreflightError

    if isinstance(exc, PreflightError) and len(exc.violations) == 1:
        return f"preflight: {exc.violations[0]}"
    return str(exc)


def resume_command(args: argparse.Namespace) -> str:
    """The exact ``unirl train`` command line that continues this run (its overrides, ``run.resume=true``)."""
    import shlex

    kept = [o for o in args.overrides if not o.startswith("run.resume=")]
    return shlex.join(["unirl", args.command, args.recipe, *kept, "run.resume=true"])


def next_command(args: argparse.Namespace) -> str:
    """After a preemption: the command that resumes the run when its directory holds a whole checkpoint
    (read from the disk now), else the one that starts it again: a resume command with nothing to resume
    would only fail."""
    import shlex

    from unirl.actor.checkpoint import latest_checkpoint
    from unirl.config import load_config

    try:
        root = load_config(args.recipe, args.overrides).run_dir / "checkpoints"
    except UniRLError:
        return f"Resume with:\n  {resume_command(args)}"
    if root.is_dir() and latest_checkpoint(root) is not None:
        return f"Resume with:\n  {resume_command(args)}"
    kept = [o for o in args.overrides if not o.startswith("run.resume=")]
    return f"No checkpoint was written, so there is nothing to resume. Start again with:\n  " \
           f"{shlex.join(['unirl', args.command, args.recipe, *kept])}"


def interrupt_hint(args: argparse.Namespace) -> str:
    """What a Ctrl-C of ``unirl train`` leaves, and the exact command that continues it."""
    if args.command != "train":
        return "interrupted"
    import shlex

    from unirl.actor.checkpoint import checkpoint_steps
    from unirl.config import load_config

    try:
        config = load_config(args.recipe, args.overrides)
    except UniRLError:
        return "interrupted"
    kept = [o for o in args.overrides if not o.startswith("run.resume=")]
    command = shlex.join(["unirl", "train", args.recipe, *kept])
    steps = checkpoint_steps(config.run_dir / "checkpoints")
    if not steps:
        return (f"interrupted before the first checkpoint (trainer.save_every={config.trainer.save_every}), so "
                f"there is nothing to resume; start again with:\n  {command}")
    last = max(steps)
    return (f"interrupted; the last checkpoint is step {last} of {config.trainer.steps} ({steps[last]}). "
            f"Resume with:\n  {command} run.resume=true")


if __name__ == "__main__":
    sys.exit(main())
