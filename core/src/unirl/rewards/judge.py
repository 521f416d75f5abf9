"""Reward ``judge``: a generative judge served by any registered rollout engine (``reward.judge.*``).

Why an engine and not a bare ``model.generate``: the engines already batch, stop, time out (abort)
and serve vLLM or SGLang; a judge is one more model served next to the policy. The judge gets its own
run config (its ``model`` section, its engine and options, its sampling), built by
:func:`judge_run_config`, so any engine that serves a policy serves a judge unchanged.

One rollout batch is one engine call: every uncached (prompt, completion) of the batch goes to the
engine in a single ``submit``, deduplicated. Verdicts are parsed by the configured rule
(:mod:`unirl.rewards.verdict`, negative forms first) and cached (LRU) by a hash of the judge version
and the rendered judge prompt, which is a function of (prompt, completion, answer when the template
uses it). A judge that raises, times out (``timeout_s`` per batch; the rest is aborted), fails a
request, or writes no parsable verdict (``verdict.unparsed: fail``) makes *that* sample failed: NaN,
out of its group's statistics, never a 0 the policy would learn from. Failures are not cached.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from unirl.contracts import BatchReward, SamplingParams
from unirl.kernel.errors import Violation
from unirl.rewards.judging import judge_run_config, render
from unirl.rewards.verdict import VerdictRule

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import JudgeSection, RunConfig
    from unirl.kernel.manager import Kernel
    from unirl.samples import Sample

def model_files_stamp(path: str | None) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of a model directory's files: changes when its weights change, cheap."""
    if not path or not Path(path).is_dir():
        return []
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(path).iterdir()) if p.is_file()]


def judge_version(j: JudgeSection) -> str:
    """The cache's judge version: ``reward.judge.version``, else a hash of everything a verdict depends on."""
    if j.version is not None:
        return j.version
    blob = json.dumps({"model": j.model.model_dump(mode="json"), "files": model_files_stamp(j.model.path),
                       "template": j.template, "chat": j.chat_template, "sampling": j.sampling.model_dump(),
                       "verdict": j.verdict.model_dump(), "engine": j.engine, "options": j.options},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encode_judge_prompt(tokenizer: Any, text: str, *, chat_template: bool) -> list[int]:
    """The token ids a judge engine is served for a rendered prompt. One function, because the tiny
    judge's SFT (:mod:`unirl.rewards.tiny_judge`) must train on exactly these ids."""
    if chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True))
    return tokenizer.encode(text, add_special_tokens=False)


class JudgeReward(BatchReward):
    """An LLM judge: one engine call per rollout batch, cached verdicts, NaN for every judge failure."""

    reads: ClassVar[tuple[str, ...]] = ("judge",)

    @classmethod
    def check(cls, config: RunConfig, kernel: Any) -> list[Violation]:
        from unirl.rewards.checks import judge_violations

        return judge_violations(config, kernel)

    def __init__(self, *, config: RunConfig, kernel: Kernel) -> None:
        from unirl.runtime import build_runtime

        j = self.section = config.reward.judge
        self.config = judge_run_config(config)
        adapter = kernel.build("model_adapters", j.model.adapter)
        self.tokenizer = adapter.build_tokenizer(self.config)
        runtime = build_runtime(self.config, kernel, adapter=adapter)
        self.engine = kernel.build("rollout_engines", j.engine, options=j.options, options_at="reward.judge.options",
                                   config=self.config, adapter=adapter, tokenizer=self.tokenizer, runtime=runtime)
        self.rule = VerdictRule.from_section(j.verdict)
        self.version = judge_version(j)
        ctx = getattr(adapter.hf_config(self.config), "max_position_embeddings", None)  # the ABC's signature
        self.max_prompt_tokens = j.max_prompt_tokens or (ctx - j.sampling.max_new_tokens if ctx else 1 << 30)
        self.sampling = self._sampling()
        self.cache: OrderedDict[str, float] = OrderedDict()
        #: engine calls made (one per rollout batch with anything uncached), and cache hits
        self.calls = self.hits = self.misses = 0
        self._closed = False

    def _sampling(self) -> SamplingParams:
        s, tok = self.section.sampling, self.tokenizer
        stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
        for text in s.stop:
            enc = tok.encode(text, add_special_tokens=False)
            if len(enc) == 1:
                stop_ids.append(enc[0])
        return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, stop_token_ids=tuple(stop_ids), stop=tuple(s.stop), logprobs=True)

    def _encode(self, text: str) -> list[int]:
        return encode_judge_prompt(self.tokenizer, text, chat_template=self.section.chat_template)

    def key(self, text: str) -> str:
        return hashlib.sha256(f"{self.version}\x1f{text}".encode()).hexdigest()

    def score_batch(self, completions: list[str], samples: list[Sample]) -> list[float]:
        out = [math.nan] * len(samples)
        pending: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # key -> (judge prompt, indices)
        for i, (completion, s) in enumerate(zip(completions, samples, strict=True)):
            text = render(self.section.template, completion, s)
            k = self.key(text)
            if k in self.cache:
                self.cache.move_to_end(k)
                out[i] = self.cache[k]
                self.hits += 1
            else:
                pending.setdefault(k, (text, []))[1].append(i)
        if not pending:
            return out
        self.misses += len(pending)
        results = self._ask([(k, text) for k, (text, _) in pending.items()])
        for k, (_, idx) in pending.items():
            value = results[k]
            if isinstance(value, str):
                for i in idx:
                    samples[i].meta["reward_error"] = value
                continue
            self._remember(k, value)
            for i in idx:
                out[i] = value
        return out

    def _remember(self, k: str, value: float) -> None:
        if self.section.cache_size <= 0:
            return
        self.cache[k] = value
        while len(self.cache) > self.section.cache_size:
            self.cache.popitem(last=False)

    def _ask(self, todo: list[tuple[str, str]]) -> dict[str, float | str]:
        """One engine call for ``todo`` (key, judge prompt): a verdict or the reason there is none, per key."""
        from unirl.samples import Sample

        j = self.section
        results: dict[str, float | str] = {}
        jobs: dict[str, str] = {}  # judge sample id -> key
        batch: list[Sample] = []
        for n, (k, text) in enumerate(todo):
            try:
                ids = self._encode(text)
            except Exception as exc:  # noqa: BLE001 - that sample fails, not the batch
                results[k] = f"judge tokenizer raised {type(exc).__name__}: {exc}"
                continue
            if len(ids) > self.max_prompt_tokens:
                results[k] = (f"judge prompt is {len(ids)} tokens, over reward.judge.max_prompt_tokens "
                              f"{self.max_prompt_tokens}")
                continue
            sid = f"j{self.calls}@judge/{n}"
            jobs[sid] = k
            batch.append(Sample(id=sid, prompt_ids=ids, prompt_text=text, seed=int(k[:15], 16)))
        if not batch:
            return results
        self.calls += 1
        handle = None
        try:
            handle = self.engine.submit(batch, self.sampling)
            waiting = set(handle.sample_ids)
            deadline = time.monotonic() + j.timeout_s
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for s in self.engine.poll(handle, timeout=min(left, 1.0)):
                    waiting.discard(s.id)
            if waiting:
                self.engine.abort(handle)
                for sid in waiting:
                    results[jobs[sid]] = f"judge timed out after reward.judge.timeout_s={j.timeout_s}s"
        except Exception as exc:  # noqa: BLE001 - the judge failed: its samples fail, the step goes on
            if handle is not None:
                try:
                    self.engine.abort(handle)
                except Exception:  # noqa: BLE001, S110 - already failing; the first error is the one reported
                    pass
            for k in jobs.values():
                results.setdefault(k, f"judge engine raised {type(exc).__name__}: {exc}")
            return results
        for s in batch:
            k = jobs[s.id]
            if k in results:
                continue
            if s.status == "failed":
                results[k] = f"judge request failed: {s.meta.get('error', s.finish_reason)}"
            elif s.finish_reason == "abort":
                results[k] = "judge request was aborted"
            else:
                verdict = self.rule.parse(s.response_text)
                if verdict is None and j.verdict.unparsed == "fail":
                    results[k] = f"judge verdict not parsable: {s.response_text[:80]!r}"
                else:
                    results[k] = 0.0 if verdict is None else verdict
        return results

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.close()
