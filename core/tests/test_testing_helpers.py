"""``unirl.testing.run_watched``: the orphan check the fault tests rely on must catch an orphan."""

from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("CI") != "true":  # in CI a missing dependency is a failure, not a skip
    pytest.importorskip("psutil")

from unirl.testing import run_watched  # noqa: E402

CHILD = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({})']); time.sleep(1.5)"


def test_a_clean_run_passes_and_returns_its_exit_code(tmp_path):
    rc, text, pid = run_watched([sys.executable, "-c", CHILD.format(0.5) + "; print('done'); sys.exit(3)"],
                                dict(os.environ), tmp_path, tmp_path / "log", grace_s=5)
    assert rc == 3 and "done" in text and pid > 0


def test_a_process_that_outlives_its_driver_fails_the_check(tmp_path):
    with pytest.raises(AssertionError, match="outlived their driver"):
        run_watched([sys.executable, "-c", CHILD.format(30)], dict(os.environ), tmp_path, tmp_path / "log", grace_s=1)
