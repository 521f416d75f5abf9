"""The ``sglang`` engine and sync against stand-in SGLang servers (real torch-engine computations behind
SGLang's HTTP API): log-probs against a transformers replay, n > 1, weight updates, failed updates,
a server restart mid-rollout, the concurrency bound and abort."""

from __future__ import annotations

import time

import pytest
from sglang_testing import actor_replay, make_engine, replay

from unirl.api import Sample, SamplingParams, VersionLedger, WeightSyncError


def _samples(tag: str, k: int = 6, seeded: bool = True) -> list[Sample]:
    return [Sample(id=f"{tag}{i}", prompt_ids=[3 + i, 7, 11 + 2 * i, 5], seed=(1000 + i) if seeded else None)
            for i in range(k)]


def _generates(server) -> list[dict]:
    return [b for p, b in server.log if p == "/generate"]


@pytest.fixture(scope="module")
def engine(standin, tiny_model_dir, tmp_path_factory):
    eng = make_engine(tiny_model_dir, tmp_path_factory.mktemp("run"), [standin.url])
    yield eng
    eng.close()


def _perturbed(model_dir, scale: float = 0.05):
    """The checkpoint's tensors plus seeded noise: a different policy (and its transformers model)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    named = [(n, t.detach().clone()) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    return model, named


def test_generation_logprobs_equal_replay(engine, standin, tiny_model_dir, tmp_path):
    samples = engine.generate(_samples("a"), SamplingParams(max_new_tokens=8, temperature=1.0))
    worst = 0.0
    for s, ref in zip(samples, actor_replay(tiny_model_dir, tmp_path, samples), strict=True):
        assert s.response_ids and len(s.rollout_logprobs) == len(s.response_ids)
        assert s.versions == [0] * len(s.response_ids) and s.meta["engine"] == "sglang"
        worst = max(worst, max(abs(a - b) for a, b in zip(s.rollout_logprobs, ref, strict=True)))
        assert s.requests[-1].engine == "sglang" and s.requests[-1].new_tokens == len(s.response_ids)
    print(f"sglang (stand-in) vs actor replay: max |diff| {worst:.2e} over {sum(map(len, [s.response_ids for s in samples]))} tokens")
    assert worst < 1e-5, worst
    sent = [sp for b in _generates(standin)[-len(samples):] for sp in b["sampling_params"]]
    assert all(b["return_logprob"] is True for b in _generates(standin)[-len(samples):])
    assert sorted(sp["sampling_seed"] for sp in sent) == [s.seed for s in samples]
    assert all(sp["top_k"] == -1 for sp in sent)  # UniRL's 0 (off) is SGLang's -1
    # request-keyed seeds: the same samples again give the same tokens (what makes retries idempotent)
    again = engine.generate(_samples("a"), SamplingParams(max_new_tokens=8, temperature=1.0))
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]


def test_n_greater_than_one(engine, standin, tiny_model_dir):
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    # unseeded siblings of one prompt: one request with sampling_params.n = 4, outputs in order
    siblings = [Sample(id=f"g/{i}", prompt_ids=[4, 9, 2]) for i in range(4)]
    before = len(_generates(standin))
    engine.generate(siblings, sampling)
    sent = _generates(standin)[before:]
    assert len(sent) == 1 and sent[0]["sampling_params"]["n"] == 4
    assert "sampling_seed" not in sent[0]["sampling_params"]
    for s in siblings:
        ref = replay(tiny_model_dir, s)
        assert s.response_ids and max(abs(a - b) for a, b in zip(s.rollout_logprobs, ref, strict=True)) < 1e-5
    # seeded siblings are separate requests (n copies would share one sampling_seed and be identical)
    seeded = [Sample(id=f"h/{i}", prompt_ids=[4, 9, 2], seed=50 + i) for i in range(4)]
    before = len(_generates(standin))
    engine.generate(seeded, sampling)
    sent = _generates(standin)[before:]
    assert len(sent) == 4 and sorted(sp["sampling_seed"] for b in sent for sp in b["sampling_params"]) == [50, 51, 52, 53]
    assert len({tuple(s.response_ids) for s in seeded}) > 1


def test_concurrency_bound(standin, tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path, [standin.url], max_concurrency=3, max_batch=2)
    try:
        standin.max_active = 0
        standin.paused = True  # requests pile up in the server: exactly the bound reaches it
        handle = eng.submit(_samples("c", k=24), SamplingParams(max_new_tokens=8, temperature=1.0))
        deadline = time.monotonic() + 10
        while standin.active < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # time for a fourth request to arrive, were the bound not held
        assert standin.active == 3
        standin.pause(False)
        done = []
        while len(done) < 24:
            done += eng.poll(handle, timeout=5)
        assert standin.max_active == 3  # 12 requests of 2 samples, never more than 3 at once
        assert all(s.response_ids for s in done)
    finally:
        standin.pause(False)
        eng.close()


def test_weight_update_from_disk_changes_outputs(engine, standin, tiny_model_dir):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    old = engine.generate(_samples("w"), greedy)
    model, named = _perturbed(tiny_model_dir)
    ledger = VersionLedger()
    standin.log.clear()
    staged = engine.stage()
    from unirl.api import fingerprint

    staged.fingerprint = fingerprint(staged.tap(iter(named)))
    receipts = engine.load_weights(staged, 1)
    ledger.commit(1, receipts, staged.fingerprint)
    assert ledger.version == engine.weight_version == 1 and len(receipts) == 1
    calls = [p for p, _ in standin.log if p != "/get_model_info"]
    assert calls == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
    update = next(b for p, b in standin.log if p == "/update_weights_from_disk")
    assert update["weight_version"] == "1" and update["model_path"].endswith("v000001")
    assert standin.model_info()["weight_version"] == "1"
    with pytest.raises(WeightSyncError, match="being served"):  # a served directory is never rewritten
        engine.load_weights(named, 1)
    new = engine.generate(_samples("w"), greedy)
    assert [s.response_ids for s in new] != [s.response_ids for s in old] or any(
        abs(a - b) > 1e-3 for o, n in zip(old, new, strict=True)
        for a, b in zip(o.rollout_logprobs, n.rollout_logprobs, strict=False))
    for s in new:  # the new tokens are the perturbed model's, stamped with the new version
        assert s.versions == [1] * len(s.response_ids)
        assert max(abs(a - b) for a, b in zip(s.rollout_logprobs, replay(model, s), strict=True)) < 1e-5


def test_failed_update_keeps_old_version(engine, standin, tiny_model_dir, monkeypatch):
    from unirl_sglang import export

    if engine.weight_version == 0:  # run alone: commit a version first
        _, named = _perturbed(tiny_model_dir)
        engine.load_weights(named, 1)
    committed = engine.weight_version
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = [s.response_ids for s in engine.generate(_samples("f"), greedy)]
    _, named = _perturbed(tiny_model_dir)
    # 1. the server refuses the directory (HTTP 400, as SGLang answers a load it cannot do): the sync
    #    fails and the engine keeps serving the old weights
    standin.fail_next_update = "No such file or directory (injected)"
    with pytest.raises(WeightSyncError, match="Failed to update weights"):
        engine.load_weights(named, committed + 1)
    assert engine.weight_version == committed and standin.model_info()["weight_version"] == str(committed)
    # 2. the written file is corrupted on disk (half of it lost): the plugin's own read-back refuses
    #    before any server is touched
    write = export.write_version

    def torn_write(*args, **kwargs):
        path = write(*args, **kwargs)
        weights = path / export.WEIGHTS_FILE
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return path

    monkeypatch.setattr(export, "write_version", torn_write)
    n_updates = sum(p == "/update_weights_from_disk" for p, _ in standin.log)
    with pytest.raises(WeightSyncError, match="unreadable"):
        engine.load_weights(named, committed + 1)
    assert sum(p == "/update_weights_from_disk" for p, _ in standin.log) == n_updates
    monkeypatch.undo()
    # 3. a NaN in the payload is refused while staging, before anything is written
    named[0][1][0, 0] = float("nan")
    with pytest.raises(WeightSyncError, match="NaN"):
        engine.load_weights(named, committed + 1)
    assert engine.weight_version == committed
    assert standin.model_info()["weight_version"] == str(committed)
    assert [s.response_ids for s in engine.generate(_samples("f"), greedy)] == before


def test_partial_failure_rolls_back_every_server(tiny_model_dir, tmp_path):
    from sglang_standin import StandIn

    standin, other = StandIn(tiny_model_dir), StandIn(tiny_model_dir)
    eng = make_engine(tiny_model_dir, tmp_path, [standin.url, other.url])
    try:
        start = {standin.model_info()["model_path"], other.model_info()["model_path"]}
        assert len(start) == 1
        other.fail_next_update = "CUDA out of memory (injected)"
        _, named = _perturbed(tiny_model_dir, scale=0.02)
        ledger = VersionLedger(version=eng.weight_version)
        with pytest.raises(WeightSyncError, match="injected"):
            ledger.commit(1, eng.load_weights(named, 1), "x")
        assert ledger.version == eng.weight_version == 0
        # the server that did load version 1 was put back on the committed directory and version
        for srv in (standin, other):
            info = srv.model_info()
            assert info["model_path"] in start and info["weight_version"] == "default", info
        # the next sync goes through on both
        receipts = eng.load_weights(named, 1)
        assert [r.worker for r in receipts] == [0, 1] and len({r.fingerprint for r in receipts}) == 1
        assert {r.transport for r in receipts} == {"disk"} and len({r.node for r in receipts}) == 2  # per server
        assert eng.weight_version == 1
    finally:
        eng.close()
        other.close()
        standin.close()


def test_server_restart_mid_rollout_retries_then_clear_error(tiny_model_dir, tmp_path):
    from sglang_standin import StandIn
    from unirl_sglang.client import SGLangUnavailableError

    server = StandIn(tiny_model_dir)
    eng = make_engine(tiny_model_dir, tmp_path, [server.url], retries=30, backoff_s=0.05, backoff_max_s=0.1)
    try:
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
        reference = [s.response_ids for s in eng.generate(_samples("r"), sampling)]
        server.paused = True  # hold the requests in the server, then kill it under them
        handle = eng.submit(_samples("r"), sampling)
        deadline = time.monotonic() + 10
        while server.active < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.active == 6
        server.crash()
        time.sleep(0.3)  # down: the retries hit a closed port
        server.restart()
        done = []
        while len(done) < 6:
            done += eng.poll(handle, timeout=5)
        by_id = {s.id: s for s in done}
        # the retried requests sampled exactly what an undisturbed run did (sampling_seed)
        assert [by_id[f"r{i}"].response_ids for i in range(6)] == reference
        # down for good: a bounded number of retries, then an error naming the server
        eng2 = make_engine(tiny_model_dir, tmp_path / "b", [server.url], retries=2, backoff_s=0.05)
        server.crash()
        handle = eng2.submit(_samples("z", k=2), sampling)
        with pytest.raises(SGLangUnavailableError, match=rf"{server.url}: POST /generate failed 3 time"):
            while True:
                eng2.poll(handle, timeout=5)
        eng2.close()
    finally:
        eng.close()
        server.close()


def test_abort_sends_abort_request(engine, standin):
    import threading

    def aborts() -> int:
        return sum(p == "/abort_request" for p, _ in list(standin.log))

    standin.paused = True
    try:
        handle = engine.submit(_samples("x", k=3), SamplingParams(max_new_tokens=8))
        deadline = time.monotonic() + 10
        while standin.active < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        n_aborts = aborts()

        def release() -> None:  # let the held requests run once all three aborts arrived
            end = time.monotonic() + 10
            while aborts() < n_aborts + 3 and time.monotonic() < end:
                time.sleep(0.01)
            standin.pause(False)

        threading.Thread(target=release, daemon=True).start()
        out = engine.abort(handle)
    finally:
        standin.pause(False)
    assert len(out) == 3 and all(s.finish_reason == "abort" for s in out)
    assert aborts() - n_aborts == 3
    assert engine.in_flight == 0


def test_per_request_times_come_from_meta_info(tiny_model_dir, tmp_path):
    """Issue 37: one batched /generate answers every item at once, so the reply's arrival is the batch's
    end; each item's finish comes from its own ``meta_info.e2e_latency`` and, on a server run with
    ``--enable-metrics``, its first token from ``prefill_finished_ts - request_received_ts``. Skewed
    response budgets (observations already fill part of each sample's budget) finish in token order."""
    from sglang_standin import StandIn

    from unirl.api import now_ms

    server = StandIn(tiny_model_dir, enable_metrics=True)
    # one request slot: the three samples go as one batched /generate (one reply for all of them)
    eng = make_engine(tiny_model_dir, tmp_path, [server.url], max_concurrency=1)
    try:
        used, budget = (28, 20, 4), 32
        samples = _samples("skew", k=len(used))
        for s, u in zip(samples, used, strict=True):
            s.append_observation([9] * u)
        eng.generate(samples, SamplingParams(max_new_tokens=budget, max_response_tokens=budget, temperature=1.0,
                                             stop_token_ids=()))
        reply = now_ms()
        recs = [s.requests[-1] for s in samples]
        assert all(r.submitted_ms < r.first_token_ms <= r.finished_ms <= reply for r in recs), recs
        ends = [r.finished_ms for r in recs]
        assert len(set(ends)) == len(ends), ends
        tokens = [r.new_tokens for r in recs]
        assert [ends[i] for i in sorted(range(len(recs)), key=lambda i: tokens[i])] == sorted(ends), (tokens, ends)
        assert all(r.cached_tokens == 0 for r in recs)  # meta_info.cached_tokens reached the record
    finally:
        eng.close()
        server.close()


def test_request_times_without_metrics_fall_back_honestly():
    """Without ``--enable-metrics`` the first token is unknown (0.0, never guessed); a server clock that
    runs ahead or behind is harmless (only differences are used) and both times stay in [sent, reply]."""
    from unirl_sglang.engine import request_times

    assert request_times({"e2e_latency": 0.25}, 1000.0, 2000.0) == (0.0, 1250.0)
    assert request_times({}, 1000.0, 2000.0) == (0.0, 2000.0)
    skewed = {"e2e_latency": 0.5, "request_received_ts": 9e9, "prefill_finished_ts": 9e9 + 0.125}
    assert request_times(skewed, 1000.0, 2000.0) == (1125.0, 1500.0)
    assert request_times({"e2e_latency": 5.0}, 1000.0, 2000.0) == (0.0, 2000.0)
