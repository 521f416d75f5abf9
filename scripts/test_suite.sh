#!/usr/bin/env bash
# The whole test suite, as `make test` runs it: two pytest processes at once.
#
# Why: through most of the suite about half of a 2-core machine sits idle (tests waiting on the vLLM,
# Ray and FSDP processes they start, single-threaded imports), while a few tests are long and pure
# compute. So the tests marked `background` (long, compute-only, embedded engine and actor, no Ray, no
# ports; `pytest -m background --collect-only` lists them) run in a second pytest process under
# SCHED_IDLE, on one thread, and get only the CPU the rest of the suite leaves idle. Everything else
# runs in the foreground as before.
#   - SCHED_IDLE (`chrt --idle 0`), not `nice`: Ray starts its workers at niceness 15, and beside a
#     busy process of ordinary priority the FSDP ranks starved (README, "How long `make test` takes").
#     An idle-class task yields a core to any other task at once.
#   - One thread: an idle-class process's second OpenMP thread would wait at every barrier for a core
#     that the foreground holds.
#
# Either process failing fails the suite, and each must collect tests (pytest exits 5 when none does).
# `python -m pytest` alone still runs everything in one process.
set -uo pipefail
py=${1:-.venv/bin/python}
# A directory of this run's own: two `make test` at once in one checkout must not wipe each other's
# pytest basetemp (pytest empties a given --basetemp when it starts).
run=$(mktemp -d "${TMPDIR:-/tmp}/unirl-background.XXXXXX")
log=$run/pytest.log
idle=(chrt --idle 0)
command -v chrt >/dev/null 2>&1 || idle=(nice -n 19)  # no util-linux: the lowest ordinary priority
OMP_NUM_THREADS=1 "${idle[@]}" "$py" -m pytest -m background --basetemp="$run/tmp" >"$log" 2>&1 &
bg=$!
# a background job ignores Ctrl-C in a script: stop it with us (and leave nothing in $TMPDIR)
trap 'kill "$bg" 2>/dev/null; rm -rf "$run"' EXIT
trap 'exit 130' INT TERM
echo "== the tests marked 'background' run beside this suite (${idle[*]}, 1 thread); follow them with: tail -f $log"
"$py" -m pytest -m "not background"
fg=$?
echo "== waiting for the background tests ($log)"
wait "$bg"
bgs=$?
trap 'rm -rf "$run"' EXIT  # the background process is gone: nothing left to kill
cat "$log"
echo "== foreground pytest: exit $fg; background pytest (the tests marked 'background'): exit $bgs"
[ "$fg" -eq 0 ] && [ "$bgs" -eq 0 ]
