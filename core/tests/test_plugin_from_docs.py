"""A third-party plugin written only from ``docs/writing-plugins.md`` works.

Why: the plugin guide is the contract a third party codes against. This test takes the guide's
estimator, loss-modifier and controller blocks verbatim (each starts with ``# src/my_pkg/<name>.py``),
packages them with one entry point each, installs the package into a fresh virtual environment (its
own site-packages; core and torch come from the project's environment through a ``.pth`` line, so
nothing heavy is reinstalled) and trains the demo recipe there with all three selected. A guide edit
that breaks any block, or a core change that breaks what the guide teaches, goes red here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-plugins.md"
MODULES = ("adv", "mods", "controller")


def guide_files() -> dict[str, str]:
    """``{module name: code}`` of every python block in the guide that names a ``src/my_pkg`` file."""
    out = {}
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S):
        first = block.splitlines()[0]
        m = re.fullmatch(r"# src/my_pkg/(\w+)\.py", first.strip())
        if m:
            out[m.group(1)] = block
    return out


def test_the_guide_has_the_three_blocks():
    assert set(MODULES) <= set(guide_files()), sorted(guide_files())


def _package(tmp: Path) -> Path:
    pkg = tmp / "my-pkg"
    (pkg / "src" / "my_pkg").mkdir(parents=True)
    (pkg / "src" / "my_pkg" / "__init__.py").write_text("")
    for name, code in guide_files().items():
        (pkg / "src" / "my_pkg" / f"{name}.py").write_text(code)
    entry_points = "\n".join(f'my_{m} = "my_pkg.{m}"' for m in MODULES)
    # the guide's minimal pyproject, with this package's name and its three entry points
    (pkg / "pyproject.toml").write_text(f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "my-pkg"
version = "0.1.0"
dependencies = ["unirl-core"]

[project.entry-points."unirl.plugins"]
{entry_points}
""")
    return pkg


def _fresh_venv(tmp: Path) -> Path:
    """A new venv whose own site-packages is empty; the project's site-packages follows it on the path."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # addsitedir, not a bare path line: the project's own .pth files (editable installs) must run too
    Path(site, "project-env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return py


@pytest.mark.slow
def test_a_plugin_from_the_guide_installs_into_a_fresh_venv_and_trains(tmp_path):
    pkg = _package(tmp_path)
    py = _fresh_venv(tmp_path)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("UNIRL_PLUGINS", None)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(pkg)],
                   check=True, env=env, timeout=300)
    # installed into the fresh venv only: the project's own environment does not see it
    assert subprocess.run([sys.executable, "-c", "import my_pkg"], capture_output=True).returncode != 0

    listed = subprocess.run([str(py), "-m", "unirl.cli", "plugins", "--json"], check=True, env=env,
                            capture_output=True, text=True, timeout=300)
    rows = {r["entry_point"]: r for r in json.loads(listed.stdout) if r["distribution"] == "my-pkg"}
    assert {k: v["status"] for k, v in rows.items()} == {f"my_{m}": "loaded" for m in MODULES}
    assert rows["my_adv"]["registers"] == {"advantage_estimators": ["mean_baseline"]}
    assert rows["my_mods"]["registers"] == {"loss_modifiers": ["tis"]}
    assert rows["my_controller"]["registers"] == {"rollout_controllers": ["one_shot"]}

    out = tmp_path / "runs"
    run = subprocess.run(
        [str(py), "-m", "unirl.cli", "train", str(ROOT / "recipes" / "arith-tiny.yaml"), f"run.output_dir={out}",
         "run.name=from-docs", "algorithm.estimator=mean_baseline", "algorithm.modifiers=[tis]",
         "rollout.controller=one_shot", "trainer.steps=3", "sft.steps=0", "trainer.eval_every=0",
         "trainer.progress=false", "trainer.plot=false", "trainer.prompts_per_step=8"],
        env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "from-docs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "loss" in r]
    assert len(steps) == 3
    # the guide's controller made every batch (its metric), 8 prompts x rollout.n samples each
    assert all(r["one_shot_samples"] == 8 * 8 for r in steps), [r.get("one_shot_samples") for r in steps]
    saved = (out / "from-docs" / "config.yaml").read_text()
    assert "mean_baseline" in saved and "one_shot" in saved and "tis" in saved
