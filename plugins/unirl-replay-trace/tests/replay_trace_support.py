"""Hand-built samples with exact request timing, for the contract tests.

Times are absolute wall-clock ms (as :func:`unirl.api.now_ms` gives them), far from zero, so a test
that confused absolute and barrier-relative times would see it.
"""

from __future__ import annotations

from unirl.api import RunConfig, Sample, load_kernel
from unirl.samples import RequestRecord

T0 = 1_796_000_000_000.0  # an absolute wall-clock ms


def turn(s: Sample, out: list[int], *, sub: float, first: float | None, fin: float, version: int = 1,
         reason: str = "stop", worker: str = "0") -> Sample:
    """Append one model turn to ``s`` with its RequestRecord, times in ms after :data:`T0`."""
    s.requests.append(RequestRecord(turn=s.turns, engine="torch", worker=worker, version=version,
                                    prompt_tokens=len(s.context_ids), submitted_ms=T0 + sub,
                                    first_token_ms=0.0 if first is None else T0 + first,
                                    finished_ms=0.0 if fin is None else T0 + fin))
    s.append_model_turn(out, [-0.5] * len(out), version, reason)
    s.requests[-1].new_tokens = len(out)
    s.requests[-1].finish_reason = reason
    return s


def obs(s: Sample, tokens: list[int]) -> Sample:
    s.append_observation(tokens)
    return s


def sample(sid: str, prompt: list[int] | None = None, text: str = "") -> Sample:
    return Sample(id=sid, prompt_ids=list(prompt or range(1, 21)), prompt_text=text)


def config(tmp_path, exporter: str = "dynamo-agentic", **options) -> RunConfig:
    return RunConfig.model_validate({"run": {"output_dir": str(tmp_path), "name": "r"},
                                     "trace": {"exporter": exporter, "options": options}})


def build_exporter(cfg: RunConfig):
    """``trace.exporter`` built as a run builds it: ``trace.options`` validated by the kernel."""
    return load_kernel().build("trace_exporters", cfg.trace.exporter, options=cfg.trace.options,
                               options_at="trace.options", config=cfg)


def agentic_group(gid: str = "p3@train-0", shift: float = 0.0) -> list[Sample]:
    """A group: sibling 0 runs two turns with a 250 ms tool wait, sibling 1 one turn, and a branch
    ``/0/1`` copied from sibling 0 after its first turn continues with its own turn (zero wait).

    ``shift`` moves every *service* time (first token, finish, and so the children's submits) by the
    same amount, leaving the workload (lengths, waits, order) unchanged."""
    a = turn(sample(f"{gid}/0"), [30, 31, 32], sub=0, first=5 + shift, fin=20 + shift)
    obs(a, [40, 41])
    branch = a.copy()
    branch.id = f"{gid}/0/1"
    turn(a, [33, 34], sub=270 + shift, first=275 + shift, fin=290 + shift)  # 250 ms tool wait
    turn(branch, [35], sub=20 + shift, first=24 + shift, fin=26 + shift)    # zero wait
    b = turn(sample(f"{gid}/1"), [36, 37], sub=0, first=5 + shift, fin=15 + shift)
    return [a, b, branch]
