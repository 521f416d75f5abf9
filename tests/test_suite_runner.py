"""``scripts/test_suite.sh`` (what ``make test`` runs): the tests marked ``background`` run in a second
pytest process beside the rest, and the suite fails when either process fails or collects nothing.
Each case runs the script on a throwaway project of two test files, with this interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test_suite.sh"
CONFIG = '[tool.pytest.ini_options]\nmarkers = ["background: beside the suite"]\naddopts = "-p no:cacheprovider"\n'
# the background test records the scheduling policy and the thread setting it ran under
BACKGROUND = '''import os, pytest

@pytest.mark.background
def test_in_the_background():
    with open("bg.txt", "w") as f:
        f.write(f"{os.sched_getscheduler(0)} {os.environ.get('OMP_NUM_THREADS')}")
    assert {ok}
'''


#: the script as ``make test`` runs it, with this interpreter
COMMAND = ["bash", str(SCRIPT), sys.executable]


def write_project(tmp_path: Path, foreground: str, background: str | None) -> None:
    """A throwaway project: the pytest config, a foreground test file and (unless None) a background one."""
    (tmp_path / "pyproject.toml").write_text(CONFIG)
    (tmp_path / "test_fg.py").write_text(foreground)
    if background is not None:
        (tmp_path / "test_bg.py").write_text(background)


def run(tmp_path: Path, *, foreground_ok: bool = True, background: str | None = "True") -> subprocess.CompletedProcess:
    write_project(tmp_path, f"def test_in_the_foreground():\n    assert {foreground_ok}\n",
                  None if background is None else BACKGROUND.replace("{ok}", background))
    return subprocess.run(COMMAND, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_both_pass_and_the_background_runs_idle_on_one_thread(tmp_path):
    out = run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout and "foreground pytest: exit 0; background pytest" in out.stdout
    policy, threads = (tmp_path / "bg.txt").read_text().split()
    assert int(policy) == os.SCHED_IDLE and threads == "1"
    # the foreground process did not run the background test: it never saw test_bg's test
    assert out.stdout.count("test_bg.py") == 1  # the background log, printed once


@pytest.mark.parametrize("case", ["background fails", "foreground fails", "no background test"])
def test_the_suite_fails_when_either_process_fails_or_collects_nothing(tmp_path, case):
    out = run(tmp_path, foreground_ok=case != "foreground fails",
              background={"background fails": "False", "no background test": None}.get(case, "True"))
    assert out.returncode != 0, out.stdout
    expected = {"background fails": "background pytest (the tests marked 'background'): exit 1",
                "foreground fails": "foreground pytest: exit 1",
                "no background test": "exit 5"}[case]
    assert expected in out.stdout, out.stdout


def start(tmp_path: Path, foreground: str, background: str, **popen) -> subprocess.Popen:
    """The script started (not awaited) on a project of the two test files given."""
    write_project(tmp_path, foreground, background)
    return subprocess.Popen(COMMAND, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def run_directory(stdout: str) -> Path:
    """The run's own directory, from the ``tail -f <log>`` line the script prints."""
    log = Path(stdout.split("tail -f ", 1)[1].split()[0])
    assert log.name == "pytest.log"
    return log.parent


def test_two_runs_at_once_keep_their_own_temp_directories(tmp_path):
    """Two `make test` in one checkout: pytest empties a given --basetemp when it starts, so with one shared
    directory the second run would delete the first's files while its test still used them."""
    first = start(tmp_path, "def test_in_the_foreground():\n    pass\n",
                  "import time, pytest\n\n@pytest.mark.background\ndef test_keeps_its_file(tmp_path):\n"
                  "    (tmp_path / 'mine').write_text('x')\n    time.sleep(4)\n"
                  "    assert (tmp_path / 'mine').exists()\n")
    time.sleep(2)  # the first run's test holds its file by now; the second pytest starts while it sleeps
    second = subprocess.run(COMMAND, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    assert second.returncode == 0, second.stdout + second.stderr
    for text in (out, second.stdout):  # each run removes its own directory when it ends
        assert not run_directory(text).exists()


def test_ctrl_c_stops_the_background_tests_and_leaves_no_directory(tmp_path):
    """Ctrl-C reaches the terminal's process group: the foreground pytest stops on it, but a background job
    of a script ignores SIGINT, so the script's trap must stop it, and remove the run's directory."""
    script = start(tmp_path, "import time\n\ndef test_long():\n    time.sleep(120)\n",
                   "import os, time, pytest\n\n@pytest.mark.background\ndef test_long():\n"
                   "    open('bg.pid', 'w').write(str(os.getpid()))\n    time.sleep(120)\n",
                   start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "bg.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # the foreground pytest is inside its test by now
    bg = int((tmp_path / "bg.pid").read_text())
    os.killpg(script.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, _ = script.communicate(timeout=60)
    assert script.returncode != 0, out
    for _ in range(50):  # the trap's kill reaches the background pytest
        try:
            os.kill(bg, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(bg, signal.SIGKILL)
        pytest.fail("the background pytest outlived Ctrl-C")
    assert not run_directory(out).exists()
