"""Bad input through the real CLI entry (``unirl.cli.main``, what the ``unirl`` script runs): every case
exits 2 with one message that names the field or file, and no traceback.

Why in-process: a fresh ``unirl`` process costs seconds of imports (torch, transformers) per case; the
cases share one process, and one case runs the installed console script as a subprocess to prove
the script is this ``main``. For the cases preflight (or the run-directory check) can see, building
a model is an assertion failure: they must fail before anything expensive.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from unirl import cli

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "arith-tiny.yaml")
UNIRL = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "unirl"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Bad (and one good) dataset files, model directories and recipes, written once."""
    d = tmp_path_factory.mktemp("bad")
    rows = [{"prompt": f"Q: {i}+1=? A:", "answer": str(i + 1)} for i in range(40)]
    good = "".join(json.dumps(r) + "\n" for r in rows)
    out: dict[str, str] = {}

    def write(name: str, text: str | bytes) -> str:
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
        out[name] = str(p)
        return str(p)

    write("good.jsonl", good)
    write("malformed.jsonl", good + '{"prompt": "Q: 1+1=? A:", "answer": \n')
    write("empty.jsonl", "")
    write("latin1.jsonl", good.encode() + '{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    write("noanswer.jsonl", good + json.dumps({"prompt": "Q: 2+2=? A:"}) + "\n")
    write("few.jsonl", "".join(json.dumps(r) + "\n" for r in rows[:3]))
    write("list.jsonl", good + "[1, 2]\n")
    write("nomodel/weights.bin", "")
    write("badjson/config.json", "{not json")
    write("notype/config.json", json.dumps({"hidden_size": 8}))
    write("list.yaml", "- a\n- b\n")
    write("broken.yaml", "run: [unclosed\n")
    write("child.yaml", "extends: missing-base.yaml\nrollout:\n  n: 4\n")
    write("loop.yaml", "extends: loop.yaml\n")
    write("typo.yaml", f"extends: {RECIPE}\nrolout:\n  n: 4\n")
    write("noweights/config.json", json.dumps({"model_type": "qwen3"}))
    write("gpt2/config.json", json.dumps({"model_type": "gpt2"}))
    write("gpt2/model.safetensors", "")
    write("notrun/readme.txt", "not a run")
    # issue 66: recipes PyYAML reads without complaint (or with a traceback), and an empty Parquet file
    write("latin1.yaml", "run:\n  name: caf\u00e9\n".encode("latin-1"))
    write("dup.yaml", f"extends: {RECIPE}\nrollout:\n  n: 4\ntrainer:\n  steps: 2\nrollout:\n  n: 8\n")
    write("dup-nested.yaml", f"extends: {RECIPE}\nrollout:\n  n: 4\n  n: 8\n")
    write("empty.yaml", "")
    write("comments.yaml", "# a recipe with nothing in it\n\n# still nothing\n")
    write("recipedir/a.yaml", "run:\n  name: a\n")
    write("extends-dir.yaml", "extends: recipedir\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   d / "empty.parquet")
    out["empty.parquet"] = str(d / "empty.parquet")
    out["{d}"] = str(d)  # the directory itself, for model and run directories
    return out




# (id, argv after the command's recipe, words the message must hold). "{f:name}" is a file above;
# "{tmp}" a fresh output directory. Argv lists starting with "!" replace the whole command line.
CASES: list[tuple[str, list[str], list[str]]] = [
    # --- config keys and values
    ("unknown-section", ["foo.bar=1"], ["foo", "unknown key"]),
    ("typo-key", ["rollout.nn=4"], ["rollout.nn", "Did you mean 'n'"]),
    ("bad-type", ["rollout.n=abc"], ["rollout.n"]),
    ("zero-n", ["rollout.n=0"], ["rollout.n"]),
    ("clip-low-above-1", ["algorithm.clip_low=2"], ["algorithm.clip_low"]),
    ("clip-high-below-low", ["algorithm.clip_high=0.1"], ["algorithm.clip_high", "clip_low"]),
    ("negative-temperature", ["rollout.temperature=-1"], ["rollout.temperature"]),
    ("zero-top-p", ["rollout.top_p=0"], ["rollout.top_p"]),
    ("zero-lr", ["actor.lr=0"], ["actor.lr"]),
    ("bad-literal", ["data.overlong=cut"], ["data.overlong"]),
    ("bad-resume", ["run.resume=maybe"], ["run.resume", "'auto'"]),
    ("failed-frac-above-1", ["trainer.max_failed_frac=2"], ["trainer.max_failed_frac"]),
    ("min-above-max-tokens", ["rollout.min_new_tokens=20"], ["min_new_tokens", "max_new_tokens"]),
    ("override-without-equals", ["rollout.n"], ["rollout.n", "key.sub=value"]),
    ("override-bad-yaml", ["rollout.stop=[unclosed"], ["rollout.stop", "YAML"]),
    ("override-into-value", ["rollout.n.x=1"], ["rollout.n.x", "'n' is a value"]),
    # --- component names and options (preflight)
    ("unknown-engine", ["rollout.engine=nosuch"], ["rollout.engine", "nosuch", "pick one of"]),
    ("unknown-actor", ["actor.name=nosuch"], ["actor.name", "nosuch"]),
    ("unknown-reward", ["reward.name=nosuch"], ["reward.name", "nosuch"]),
    ("unknown-estimator", ["algorithm.estimator=nosuch"], ["algorithm.estimator", "nosuch"]),
    ("unknown-loss", ["algorithm.loss=nosuch"], ["algorithm.loss", "nosuch"]),
    ("unknown-adapter", ["model.adapter=nosuch"], ["model.adapter", "nosuch"]),
    ("unknown-weight-sync", ["weight_sync.name=nosuch"], ["weight_sync.name", "nosuch"]),
    ("bad-estimator-option", ["algorithm.estimator_options={bogus: 1}"], ["algorithm.estimator_options"]),
    ("unknown-modifier", ["algorithm.modifiers=[nosuch]"], ["algorithm.modifiers[0]"]),
    ("unknown-tool", ["rollout.tools=[nosuch]"], ["rollout.tools[0]"]),
    ("trace-options-without-exporter", ["trace.options={a: 1}"], ["trace.options", "trace.exporter"]),
    ("async-key-in-sync", ["rollout.max_staleness=2"], ["rollout.max_staleness", "rollout.mode: async"]),
    ("kl-reward-without-coef", ["algorithm.kl_form=reward"], ["algorithm.kl_form", "kl_coef"]),
    ("gae-without-value-head", ["algorithm.estimator=gae"], ["actor.value_head"]),
    ("grpo-n-1", ["rollout.n=1"], ["rollout.n", "at least"]),
    ("vllm-max-model-len", ["rollout.engine=vllm", "rollout.options={max_model_len: 4}"], ["max_model_len"]),
    # --- dataset files (preflight reads them)
    ("data-missing-file", ["data.source=/nonexistent/x.jsonl", "data.eval_source={f:good.jsonl}"],
     ["data.source", "/nonexistent/x.jsonl"]),
    ("data-malformed", ["data.source={f:malformed.jsonl}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "malformed.jsonl", "line 41"]),
    ("data-empty", ["data.source={f:empty.jsonl}", "data.eval_source={f:good.jsonl}"], ["data.source", "empty.jsonl"]),
    ("data-not-utf8", ["data.source={f:latin1.jsonl}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "latin1.jsonl", "line 41"]),
    ("data-missing-field", ["data.source={f:noanswer.jsonl}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "noanswer.jsonl", "answer"]),
    ("data-row-not-object", ["data.source={f:list.jsonl}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "list.jsonl", "line 41"]),
    ("data-fewer-than-a-batch", ["data.source={f:few.jsonl}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "trainer.prompts_per_step"]),
    ("data-no-eval-source", ["data.source={f:good.jsonl}"], ["data.eval_source"]),
    ("data-bad-eval-file", ["data.source={f:good.jsonl}", "data.eval_source={f:empty.jsonl}"], ["data.eval_source"]),
    # --- model directories
    ("model-path-missing", ["model.path=/nonexistent/model"], ["model.path", "/nonexistent/model"]),
    ("model-path-no-config", ["model.path={d}/nomodel"], ["model.path", "has no config.json"]),
    ("model-config-not-json", ["model.path={d}/badjson"], ["model.path", "not readable JSON"]),
    ("model-config-no-type", ["model.path={d}/notype"], ["model.path", "names no model_type"]),
    ("model-dir-no-weights", ["model.path={d}/noweights"], ["model.path", "no weights"]),
    ("model-type-not-the-adapters", ["model.path={d}/gpt2"], ["model.adapter", "'gpt2'", "qwen3"]),
    # --- recipes
    ("recipe-missing", ["!", "train", "/nonexistent/recipe.yaml"], ["/nonexistent/recipe.yaml", "does not exist"]),
    ("recipe-not-mapping", ["!", "train", "{f:list.yaml}"], ["list.yaml", "mapping"]),
    ("recipe-bad-yaml", ["!", "train", "{f:broken.yaml}"], ["broken.yaml", "YAML"]),
    ("recipe-extends-missing", ["!", "train", "{f:child.yaml}"], ["child.yaml", "missing-base.yaml"]),
    ("recipe-extends-loop", ["!", "train", "{f:loop.yaml}"], ["loop.yaml", "loops"]),
    ("recipe-typo-section", ["!", "train", "{f:typo.yaml}"], ["rolout", "Did you mean 'rollout'"]),
    # --- resume and run directories
    ("resume-nothing", ["run.resume=true"], ["run.resume=true", "nothing to resume", "{tmp}", "run.resume=auto"]),
    # --- other commands and CLI arguments
    ("train-no-recipe", ["!", "train"], ["recipe"]),
    ("unknown-option", ["--bogus"], ["--bogus"]),
    ("unknown-command", ["!", "trian", RECIPE], ["trian"]),
    ("export-not-a-run", ["!", "export", "{d}/notrun"], ["not a run directory", "config.yaml"]),
    ("export-missing-run", ["!", "export", "/nonexistent/run"], ["/nonexistent/run"]),
    ("eval-bad-split", ["!", "eval", RECIPE, "--split", "test"], ["--split", "test"]),
    ("eval-bad-k", ["!", "eval", RECIPE, "--k", "many"], ["--k", "many"]),
    # --- issue 66, class 1: tracebacks from the consumer (AdamW, torch.manual_seed, the cursor) before
    ("recipe-not-utf8", ["!", "train", "{f:latin1.yaml}"], ["latin1.yaml", "not UTF-8", "line 2", "fix: save"]),
    ("seed-beyond-64-bits", ["run.seed=18446744073709551616"], ["run.seed", "less than or equal"]),
    ("negative-seed", ["run.seed=-1"], ["run.seed"]),
    ("negative-weight-decay", ["actor.weight_decay=-1"], ["actor.weight_decay", "greater than or equal to 0"]),
    ("beta-of-1", ["actor.betas=[0.9, 1.0]"], ["actor.betas.1", "less than 1"]),
    ("negative-beta", ["actor.betas=[-0.5, 0.99]"], ["actor.betas.0"]),
    ("negative-sft-lr", ["sft.lr=-1"], ["sft.lr", "greater than 0"]),
    ("zero-sft-batch", ["sft.batch_size=0"], ["sft.batch_size"]),
    ("router-loss-without-experts", ["algorithm.router_aux_loss_coef=0.01"],
     ["algorithm.router_aux_loss_coef", "no experts", "Mixture-of-Experts"]),
    ("branching-stateful-tool", ["!", "train", str(ROOT / "recipes" / "agentic-calc-branching-tiny.yaml"),
                                 "run.output_dir={tmp}", "run.name=r", "rollout.tools=[calculator, python_sandbox]"],
     ["rollout.branching", "tool 'python_sandbox' is stateful", "remove rollout.branching"]),
    # --- class 3: settings with no effect
    ("plugins-section-typo", ["plugins.agentc={max_turns: 3}"], ["plugins.agentc", "did you mean plugins.agentic"]),
    ("plugins-section-nobody-reads", ["plugins.nosuch={a: 1}"], ["plugins.nosuch", "would be ignored"]),
    ("recipe-duplicate-key", ["!", "train", "{f:dup.yaml}"], ["dup.yaml", "duplicate key 'rollout'", "line 6",
                                                            "first given at line 2"]),
    ("recipe-duplicate-nested-key", ["!", "train", "{f:dup-nested.yaml}"], ["duplicate key 'n'", "line 4"]),
    ("override-duplicate-key", ["rollout.options={a: 1, a: 2}"], ["rollout.options", "duplicate key 'a'"]),
    ("recipe-empty", ["!", "train", "{f:empty.yaml}"], ["empty.yaml", "is empty"]),
    ("recipe-only-comments", ["!", "train", "{f:comments.yaml}"], ["comments.yaml", "is empty", "comments"]),
    ("agentic-settings-without-controller", ["plugins.agentic={max_turns: 3}"],
     ["plugins.agentic", "rollout.controller is 'batch'", "rollout.controller: agentic"]),
    ("fork-without-branching", ["algorithm.group_layer=fork"], ["algorithm.group_layer", "rollout.branching is not set"]),
    ("split-on-a-file-source", ["data.source={f:good.jsonl}", "data.eval_source={f:good.jsonl}",
                                "data.train_split=validation"], ["data.train_split", "no splits"]),
    ("subset-on-a-file-source", ["data.source={f:good.jsonl}", "data.eval_source={f:good.jsonl}", "data.subset=main"],
     ["data.subset", "cached HF dataset"]),
    ("sft-with-zero-steps", ["!", "sft", RECIPE, "run.output_dir={tmp}", "run.name=r", "sft.steps=0"],
     ["sft.steps", "untrained model", "set sft.steps > 0"]),
    # --- class 4: non-finite and unbounded numbers
    ("nan-lr", ["actor.lr=.nan"], ["actor.lr", "NaN and infinity", "finite number"]),
    ("inf-lr", ["actor.lr=.inf"], ["actor.lr", "finite"]),
    ("inf-kl-coef", ["algorithm.kl_coef=.inf"], ["algorithm.kl_coef", "finite"]),
    ("inf-lora-alpha", ["actor.lora={alpha: .inf}"], ["actor.lora.alpha", "finite"]),
    ("nan-temperature", ["rollout.temperature=.nan"], ["rollout.temperature", "finite"]),
    ("negative-inf-eval-temperature", ["trainer.eval_temperature=-.inf"], ["trainer.eval_temperature"]),
    ("negative-eval-temperature", ["trainer.eval_temperature=-1"], ["trainer.eval_temperature"]),
    ("nan-engine-option", ["rollout.options={seed: .nan}"], ["rollout.options", "seed is nan", "finite number"]),
    ("nan-in-model-build", ["model.build.rope_theta=.nan"], ["model.build", "rope_theta is nan", "finite number"]),
    ("inf-in-a-plugin-section", ["rollout.controller=agentic", "rollout.environment=tool_env",
                                 "rollout.tools=[calculator]", "plugins.agentic={over_generate: .inf}"],
     ["plugins.agentic.over_generate", "finite number"]),
    ("tis-cap-below-1-alias", ["algorithm.rollout_is_threshold=0.5"], ["algorithm.rollout_is_threshold"]),
    ("tis-cap-below-1", ["algorithm.modifiers=[rollout_correction]",
                         "plugins.rollout_correction={mode: token_tis, threshold: 0.5}"],
     ["plugins.rollout_correction.threshold", "below 1", "set the cap >= 1"]),
    # --- class 5: messages that say what is there
    ("recipe-is-a-directory", ["!", "train", "{d}/recipedir"], ["recipedir", "is a directory", "a.yaml"]),
    ("recipe-extends-a-directory", ["!", "train", "{f:extends-dir.yaml}"], ["extends: recipedir", "is a directory"]),
    ("data-empty-parquet", ["data.source={f:empty.parquet}", "data.eval_source={f:good.jsonl}"],
     ["data.source", "empty.parquet", "is empty", "no rows"]),
    # --- class 6: trackers checked in preflight
    ("mlflow-unreachable", ["logging.trackers=[mlflow]", "logging.options.mlflow.tracking_uri=http://127.0.0.1:9"],
     ["logging.options.mlflow.tracking_uri", "cannot reach the MLflow server", "Connection refused"]),
]


def _argv(case: list[str], files: dict[str, str], tmp: Path) -> list[str]:
    def fill(a: str) -> str:
        for name, path in files.items():
            a = a.replace(f"{{f:{name}}}", path).replace(name, path) if name == "{d}" else a.replace(f"{{f:{name}}}", path)
        return a.replace("{tmp}", str(tmp))

    if case and case[0] == "!":
        return [fill(a) for a in case[1:]]
    return ["train", RECIPE, f"run.output_dir={tmp}", "run.name=r", "trainer.progress=false",
            *[fill(a) for a in case]]


@pytest.mark.parametrize(("argv", "words"), [pytest.param(a, w, id=i) for i, a, w in CASES])
def test_bad_input_exits_2_naming_the_field(argv, words, files, tmp_path, no_model, capsys):
    try:
        code = cli.main(_argv(argv, files, tmp_path))
    except SystemExit as exc:  # argparse's usage errors exit 2 themselves, as the script does
        code = exc.code
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2, text
    assert "Traceback" not in text
    missing = [w for w in (w.replace("{tmp}", str(tmp_path)) for w in words) if w not in text]
    assert not missing, f"the message lacks {missing}:\n{text}"
    assert not (tmp_path / "r").exists(), "a rejected run must leave no run directory"
    lines = text.strip().splitlines()
    # one problem, one line; argparse prints its usage first, and a data file's bad rows are listed below it
    if not lines[0].startswith("usage:") and "problem(s)" not in lines[0] and "bad row(s)" not in lines[0]:
        assert len(lines) == 1 and lines[0].startswith("error: "), f"one problem, one line:\n{text}"


def test_matrix_is_at_least_40_cases():
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)


def test_the_console_script_is_this_main(tmp_path):
    """One case through the installed ``unirl`` script, in its own process: same exit code, same message.
    (``unirl config`` imports neither torch nor a plugin, so the process is cheap.)"""
    out = subprocess.run([str(UNIRL), "config", RECIPE, "algorithm.clip_low=2"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "algorithm.clip_low" in out.stderr and "Traceback" not in out.stderr + out.stdout
