"""The checkpoint fault drill, installed by the soak tests as the phase callback (never by a real run).

Why here and not in ``unirl.actor.checkpoint``: production code holds no test logic and reads no
``UNIRL_TEST_*`` variable. The variables are read here, in the process that installs the drill, so
a forked life or a Ray rank is steered by its environment like before:

* ``UNIRL_TEST_SAVE_SLEEP_S`` (seconds, float): sleep at every phase, which widens the save and prune
  windows;
* ``UNIRL_TEST_HOLD_AT`` (an ``fnmatch`` pattern over phase labels) with ``UNIRL_TEST_HOLD_FILE`` (a
  path): the first phase whose label matches writes ``<label> <pid>`` to the file (atomically) and then
  blocks until the test SIGKILLs the process, so the kill lands at exactly that point however loaded the
  machine is.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

from unirl.actor import checkpoint as ckpt

SAVE_SLEEP_ENV = "UNIRL_TEST_SAVE_SLEEP_S"
HOLD_AT_ENV = "UNIRL_TEST_HOLD_AT"
HOLD_FILE_ENV = "UNIRL_TEST_HOLD_FILE"


def env_drill(label: str) -> None:
    """The phase callback: sleep and/or hold at ``label`` as the environment asks (free when unset)."""
    delay = os.environ.get(SAVE_SLEEP_ENV)
    if delay:
        time.sleep(float(delay))
    pattern = os.environ.get(HOLD_AT_ENV)
    if pattern and fnmatch.fnmatchcase(label, pattern):
        out = Path(os.environ[HOLD_FILE_ENV])
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        tmp.write_text(f"{label} {os.getpid()}\n")
        os.replace(tmp, out)
        while True:  # held until the test kills this process
            time.sleep(60)


def install() -> None:
    """Make :func:`env_drill` this process's checkpoint phase callback."""
    ckpt.set_phase_callback(env_drill)
