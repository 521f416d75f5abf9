"""The embedded rollout engine: batched sampling with a KV cache on a private copy of the weights.

It is a :class:`~unirl.engine.queued.QueuedEngine`: the base owns submit / poll / abort / pause /
resume and the sync guard; this module owns :meth:`TorchEngine._run` (one model turn for a list of
samples) and weight loading.

One sampling loop runs over a :class:`~unirl.engine.decoder.Decoder`, chosen once when the engine
is built: the **fast** decoder (:mod:`unirl.engine.fast_decoder`: static KV cache, fused projections;
the default for Qwen3 / Qwen2 / Llama-shaped decoders) or the **hf** decoder (the model's own forward,
for any other architecture or with ``rollout.options.fast_path: false``). Rows of a group, or the
branches of one fork (:meth:`Sample.fork`), prefill their shared context once where the decoder allows
it (:func:`unirl.engine.rows.shared_prefill`); each row's ``RequestRecord.cached_tokens`` says how many of its
context tokens it got from another row's prefill.

**Continuation.** A turn conditions on ``sample.context_ids`` (prompt + every earlier turn and
observation) and generates at most ``sampling.new_token_limit(sample)`` tokens (0: an empty turn,
finish "length").

**Seeds.** Every row carries a 63-bit seed (``sample.turn_seed()``, keyed on the request and its
depth, or one drawn from the engine's own generator for an unseeded sample); :mod:`unirl.engine.sampler`
draws from it with a counter-based hash, so a seeded request draws the same tokens alone, in any
batch, at any step.

**Stopping.** A row ends at a stop token id (the tokenizer's / model's eos plus
``sampling.stop_token_ids``) or when its decoded turn text contains a ``sampling.stop`` string.
``sampling.ignore_eos`` takes the eos ids out of that set; ``sampling.min_new_tokens`` sets the
logits of eos and the stop ids to -inf before the draw for the turn's first tokens (the log-prob is
still that of the raw logits, like vLLM's ``min_tokens``).
Nothing is trimmed from the tokens: the stop token, or the token that completed a stop string, is kept
(it is what the policy chose and is learnt), with its log-prob. The turn's text is the decode of its
tokens (``skip_special_tokens``) without a stop *token*'s text, and *with* a stop *string* (what vLLM
gives with ``include_stop_str_in_output``), so an environment that parses e.g. ``</tool>`` sees it.
Stop strings are matched cheaply (:mod:`unirl.engine.stop_strings`).

**Abort.** ``should_stop()`` is read every decode step; when set, unfinished rows end with what they
have and ``finish_reason="abort"``.

**Parity.** When the runtime has an enabled parity provider, every generation runs inside
``runtime.exact("rollout")``, where the provider has installed its reference ops into the
transformers modules. The fast decoder then calls each layer's attention module
(``module_attention``, over a cache in whole blocks of the provider's ``key_block``), so the
provider's attention runs instead of its private kernels. The **hf** decoder under parity is what the
fast one is checked against (bit for bit, in the parity plugin's tests).

Log-probs are those of the sampled token under ``rollout.logprobs`` (:mod:`unirl.logprobs`):
``log_softmax`` of the *raw* fp32 logits (``raw``), or of the logits after temperature, top-k and top-p
(``processed``, vLLM's order; the draw always samples from those processed logits). The actor's
teacher-forced replay computes the same.

**Weights.** :meth:`TorchEngine.stage` hands out a :class:`~unirl.weights.Staged` checked against the
spec of the engine's own model (:meth:`WeightSpec.from_model`); :meth:`TorchEngine.load_weights`
loads a finished one in place (tied ``lm_head`` keeps sharing the embedding) under
``quiesced(version)``, so it is refused while anything is in flight and a bad payload is rejected
before any tensor is touched.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from unirl.config_bounds import SEED_MAX
from unirl.contracts import EngineCapabilities, ModelAdapter, Receipt, SamplingParams, fingerprint
from unirl.engine import fast_decoder, merged, rows
from unirl.engine.decoder import Decoder, HFDecoder
from unirl.engine.fast_decoder import FastDecoder
from unirl.engine.memory_layout import torch_engine_layout
from unirl.engine.queued import JobFeed, JobLane, QueuedEngine
from unirl.engine.sampler import draw, sampling_logits
from unirl.engine.stop_strings import StopStrings
from unirl.engine.vl_decoder import VLDecoder
from unirl.kernel.errors import DataError
from unirl.multimodal import images_of
from unirl.routing import attach_routes, recorder_for
from unirl.samples import Sample, now_ms
from unirl.weights import Staged, WeightSpec, stage_all

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig
    from unirl.runtime import Runtime

class TorchEngineConfig(BaseModel):
    """``rollout.options`` of the ``torch`` engine."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(64, ge=1, description="most sequences per forward; larger requests are chunked")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="engine weight dtype; None follows model.dtype"
    )
    fast_path: bool = Field(True, description="use the built-in incremental decoder for known architectures")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="seeds the draws for samples without a seed; None uses run.seed")


# ------------------------------------------------------------------------------------ the engine

class TorchEngine(QueuedEngine):
    """Embedded engine: one process, one private copy of the model, eval mode, no autograd."""

    name = "torch"
    Config = TorchEngineConfig
    memory_layout = classmethod(torch_engine_layout)  # the memory plan's declaration (unirl.engine.memory_layout)
    merges_jobs = True  # continuous batching (unirl.engine.merged); each engine narrows it to what its decoder can

    @classmethod
    def capabilities(cls, config: RunConfig, options: TorchEngineConfig | None) -> EngineCapabilities:
        # one worker in this process; it serves options.dtype when set (None: model.dtype).
        # batching stays undeclared although queued jobs merge (merges_jobs): a job joins only when all its
        # rows fit, and a job larger than batch_size (a sync step's whole batch) runs alone in static
        # chunks, while Dynamo's mocker admits each request as a slot frees. Measured on a merged stream
        # capture (docs/replay-trace.md): per-request e2e 68 % off, 39.7 % at the best single speed.
        return EngineCapabilities(weight_syncs=("inprocess",), logprobs=config.rollout.logprobs, continuation=True,
                                  async_submit=True, requests_across_sync="queued", routing_record=True,
                                  serve_dtype=options.dtype if options is not None else None,
                                  fields=(("serve_dtype", "rollout.options.dtype"), ("logprobs_mode", "rollout.logprobs")))

    def __init__(self, *, config: RunConfig, adapter: ModelAdapter, runtime: Runtime, tokenizer: Any = None,
                 model: Any = None, options: TorchEngineConfig | None = None):
        """``options``: ``rollout.options`` as the kernel validated it (None: the defaults)."""
        import torch

        super().__init__()
        self.options = options if options is not None else TorchEngineConfig()
        self.config = config
        self.adapter = adapter
        self.runtime = runtime
        self.tokenizer = tokenizer if tokenizer is not None else adapter.build_tokenizer(config)
        runtime.install_engine(self.name)  # parity: engine-side reference ops before the model exists
        if model is None:
            model = adapter.build_model(config, self.tokenizer)
        else:
            from unirl.packing import disable_packed_attention

            model = copy.deepcopy(model)  # the engine never aliases the caller's (the actor's) tensors
            disable_packed_attention(model)  # an actor's model attends per packed sequence; generate uses sdpa
        dtype = getattr(torch, self.options.dtype or config.model.dtype)
        self.model = model.to(dtype).eval().requires_grad_(False)
        self.dtype = dtype
        self.device = next(self.model.parameters()).device
        seed = self.options.seed if self.options.seed is not None else config.run.seed
        self._generator = torch.Generator().manual_seed(seed)
        # parity: the provider's ops live in the modules, so the fast decoder calls the attention module
        self.module_attention = runtime.parity is not None
        #: the parity provider's key chunk (its attention reads the static cache in place in whole blocks)
        self.key_block = runtime.parity.key_block if self.module_attention else 1
        #: the adapter's trait: prompts may carry images (unirl.multimodal), fed at prefill by the VL decoder
        self.vision = adapter.vision
        self.fast = self.options.fast_path and not self.vision and fast_decoder.supports(self.model)
        #: the forward of every batch, chosen once (fusing the fast decoder's projections happens here)
        self.decoder: Decoder = (FastDecoder(self.model, dtype, module_attention=self.module_attention,
                                             key_block=self.key_block) if self.fast
                                 else VLDecoder(self.model, adapter, adapter.image_processor(config)) if self.vision
                                 else HFDecoder(self.model))
        #: token ids never drawn (a VL model's image / video placeholders: fed only by the processor, a drawn one
        #: would become a placeholder without pixels in the actor's replay); their raw log-prob mass stays
        self.never = (torch.tensor(self.decoder.placeholder_ids, dtype=torch.long, device=self.device)
                      if self.vision else None)
        self.eos_ids = self._eos_ids()
        self.pad_id = self._pad_id()
        self.spec = WeightSpec.from_model(self.model)
        self._stop_strings = StopStrings(self.tokenizer, self.model.config, self.device)
        #: R3 (``algorithm.routing_replay``): each fed token's expert ids, onto its sample (unirl.routing)
        self.routes = recorder_for(config, adapter, self.model)
        #: continuous batching (unirl.engine.merged): queued jobs join the running batch between decode steps,
        #: where the decoder can join two batches' caches and no per-row record needs the batch's layout
        self.merges_jobs = type(self).merges_jobs and self.decoder.merges_rows and self.routes is None and not self.vision

    def cache_tokens(self) -> int:
        """0: nothing is cached across jobs (a job's KV cache, and a group's shared prefill, live and die
        with that job), so every batch starts on an empty cache."""
        return 0

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer, getattr(self.model, "generation_config", None), self.model.config):
            v = getattr(source, "eos_token_id", None)
            if v is None:
                continue
            ids.update([v] if isinstance(v, int) else list(v))
        return ids

    def _pad_id(self) -> int:
        for v in (getattr(self.tokenizer, "pad_token_id", None), getattr(self.model.config, "pad_token_id", None)):
            if isinstance(v, int):
                return v
        return min(self.eos_ids) if self.eos_ids else 0

    # ------------------------------------------------------------------ generation
    def _can_merge(self, samples: list[Sample], sampling: SamplingParams) -> bool:
        """A job joins a merged batch unless it needs what only a job alone has: stop strings (matched
        over the batch's token columns), images, or more rows than one forward takes."""
        return (not any(sampling.stop) and len(samples) <= self.options.batch_size
                and all(images_of(s) is None for s in samples))

    def _run_merged(self, first: JobLane, feed: JobFeed) -> None:
        merged.run_merged(self, first, feed)

    def _run(self, samples: list[Sample], sampling: SamplingParams, should_stop: Callable[[], bool],
             version: int) -> None:
        import torch

        if not samples:
            return
        # one draw per sample in order, so unseeded runs are reproducible for a given engine seed
        drawn = torch.randint(0, 1 << 62, (len(samples),), generator=self._generator).tolist()
        seeds = []
        for s, d in zip(samples, drawn, strict=True):
            ts = s.turn_seed()
            seeds.append(ts if ts is not None else d)
        limits = [sampling.new_token_limit(s) for s in samples]
        stop_ids = self.eos_ids | set(sampling.stop_token_ids)
        if sampling.ignore_eos:  # eos never ends a turn, even when the trainer listed it as a stop id
            stop_ids -= self.eos_ids
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
        stops = tuple(x for x in sampling.stop if x)
        # chunk by context length so rows of a forward have similar padding; results go back in order
        live = [i for i in range(len(samples)) if limits[i] > 0]
        for i in range(len(samples)):
            if limits[i] <= 0:  # the response budget is spent: an empty turn
                samples[i].append_model_turn([], [], version, "length")
        contexts = {i: samples[i].context_ids for i in live}
        # equal contexts (a group's slots, the branches of one fork) next to each other, so one chunk holds
        # them and they prefill once (:func:`rows.shared_prefill`)
        first_seen: dict[tuple[int, ...], int] = {}
        for i in live:
            first_seen.setdefault(tuple(contexts[i]), i)
        order = sorted(live, key=lambda i: (len(contexts[i]), first_seen[tuple(contexts[i])], i))
        size = self.options.batch_size
        exact = self.runtime.exact("rollout")
        with torch.inference_mode(), exact:
            for c in range(0, len(order), size):
                idx = order[c : c + size]
                if should_stop():
                    for i in idx:
                        samples[i].append_model_turn([], [], version, "abort")
                    continue
                chunk = [samples[i] for i in idx]

                def first_token(chunk=chunk) -> None:
                    t = now_ms()
                    for s in chunk:
                        s.requests[-1].first_token_ms = t

                ctxs = [contexts[i] for i in idx]
                toks, lps, reasons, ends = self._generate_batch(
                    ctxs, [seeds[i] for i in idx], [limits[i] for i in idx],
                    sampling, stop, stops, should_stop, first_token, self._images(chunk),
                )
                for s, served in zip(chunk, rows.prefix_served(ctxs, self._share(ctxs)), strict=True):
                    s.requests[-1].cached_tokens = served
                for row, (s, t, lp, r, end) in enumerate(zip(chunk, toks, lps, reasons, ends, strict=True)):
                    reason = rows.REASONS[r]
                    text_ids = t[:-1] if reason == "stop" and t and t[-1] in stop_ids else t
                    s.append_model_turn(t, lp, version, reason,
                                        text=self.tokenizer.decode(text_ids, skip_special_tokens=True))
                    if self.routes is not None:
                        attach_routes(s, self.routes.row(row, len(t)))
                    s.requests[-1].finished_ms = end  # this row's own end, not the job's (see _generate_batch)

    def _generate_batch(self, contexts: list[list[int]], seeds: list[int], limits: list[int],
                        sampling: SamplingParams, stop: torch.Tensor, stops: tuple[str, ...],
                        should_stop: Callable[[], bool], first_token: Callable[[], None],
                        images: list[Any] | None = None,
                        ) -> tuple[list[list[int]], list[list[float]], list[int], list[float]]:
        """Tokens, log-probs, finish reasons and each row's finish time (:func:`now_ms`; see
        :class:`rows.RowOutputs`) of one batch: the sampling loop over :attr:`decoder`."""
        import torch

        B, N = len(contexts), max(limits)
        dev = self.device
        ids, pos, valid, plen = rows.left_pad(contexts, N, self.pad_id, dev)
        P = ids.shape[1]
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        lim = torch.tensor(limits, dtype=torch.long, device=dev)
        uniform = min(limits) == N  # the common case: no per-row budget to check each step
        stop = stop.to(dev)
        cand = self._stop_strings.candidates(stops) if stops else None
        out = rows.RowOutputs(B, N, self.pad_id, dev)
        live_rows = torch.arange(B, device=dev)  # original row of each live row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        state = (self.decoder.prefill(ids, pos, valid, N, images=images) if images is not None
                 else self._prefill(contexts, ids, pos, valid, N))
        logits = state.pop("logits")
        if self.routes is not None:
            self.routes.begin(B, N, dev)
        processed = self.config.rollout.logprobs == "processed"  # else raw (unirl.logprobs)
        banned = None  # min_new_tokens: eos and the stop ids cannot be drawn before then
        if sampling.min_new_tokens > 0:
            banned = torch.tensor(sorted(self.eos_ids | set(stop.tolist())), dtype=torch.long, device=dev)
        for t in range(N):
            raw = logits.float()
            pick = raw.index_fill(-1, banned, -math.inf) if banned is not None and t < sampling.min_new_tokens else raw
            if self.never is not None:
                pick = pick.index_fill(-1, self.never, -math.inf)
            x = sampling_logits(pick, sampling)
            tok = draw(x, sampling, seed_t, t)
            out.lp[live_rows, t] = torch.log_softmax(x if processed else raw, dim=-1).gather(-1, tok[:, None])[:, 0]
            out.tok[live_rows, t] = tok
            if t == 0:
                first_token()
            stopped = torch.isin(tok, stop) & ~done
            if cand is not None:
                self._stop_strings.match(stops, cand, tok, stopped, done, live_rows, out.tok, t)
            if t + 1 == N:  # every row still going ends here: "length" (or "stop" if it just stopped)
                out.reason[live_rows[stopped]] = rows.STOP
                break
            ended = stopped if uniform else stopped | ((lim <= t + 1) & ~done)
            any_ended = bool(ended.any())  # one device sync per step, as before
            out.step_ms.append(now_ms())  # token t of every live row exists now (see rows.RowOutputs)
            if any_ended:
                out.lengths[live_rows[ended]] = t + 1
                out.reason[live_rows[stopped]] = rows.STOP
                done = done | ended
                live = ~done
                n_live = int(live.sum())
                if n_live == 0:
                    break
                if n_live <= 0.75 * live.numel():  # drop finished rows from the batch
                    keep = live.nonzero()[:, 0]
                    live_rows, seed_t, plen, lim, done, tok = (live_rows[keep], seed_t[keep], plen[keep],
                                                               lim[keep], done[keep], tok[keep])
                    state = self.decoder.select(state, keep)
            if should_stop():  # aborted: unfinished rows keep what they have
                out.lengths[live_rows[~done]] = t + 1
                out.reason[live_rows[~done]] = rows.ABORT
                break
            with self.routes.step(live_rows, t) if self.routes is not None else contextlib.nullcontext():
                logits = self.decoder.step(state, tok[:, None], (plen + t)[:, None], P + t)
        return out.host()

    def _images(self, chunk: list[Sample]) -> list[Any] | None:
        """Each row's prompt images (None: a text-only batch); images on a text-only model are refused."""
        images = [images_of(s) for s in chunk]
        if all(im is None for im in images):
            return None
        if not self.vision:
            raise DataError(f"sample {chunk[0].id}: a prompt carries images but model.adapter "
                            f"{self.adapter.name!r} takes text only; fix: use a vision-language adapter")
        return images

    def _prefill(self, contexts: list[list[int]], ids, pos, valid, max_new: int) -> dict[str, Any]:
        """The decoder's prefill. Where it allows (:attr:`Decoder.shares_prefill`), rows with equal
        contexts (a GRPO group) prefill once and fan out (see :func:`rows.shared_prefill`)."""
        share = self._share(contexts)
        if share is None:
            return self.decoder.prefill(ids, pos, valid, max_new)
        first, fan = (t.to(self.device) for t in share)
        state = self.decoder.select(self.decoder.prefill(ids[first], pos[first], valid[first], max_new), fan)
        state["logits"] = state["logits"][fan]
        return state

    def _share(self, contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which rows prefill for which (:func:`rows.shared_prefill`), where the decoder can share."""
        return rows.shared_prefill(contexts) if self.decoder.shares_prefill else None

    # ------------------------------------------------------------------ weights
    def stage(self) -> Staged:
        return Staged(spec=self.spec)

    def load_weights(self, staged: Staged | Iterable[tuple[str, torch.Tensor]], version: int) -> list[Receipt]:
        """Load a staged set as ``version`` (see :class:`~unirl.contracts.RolloutEngine`).

        For convenience (tests, notebooks) a plain iterable of ``(name, tensor)`` is accepted too: it is
        staged here with :func:`unirl.weights.stage_all` against this engine's spec, so it must be the
        complete model in the serving dtype, exactly like a sync."""
        import torch

        with self.quiesced(version):
            t0 = time.perf_counter()
            if not isinstance(staged, Staged):
                staged = stage_all(self.spec, staged)
            staged.finish()  # completeness, tied head: raises before any tensor is touched
            state = self.model.state_dict()
            with torch.no_grad():
                for name, src in staged.tensors:
                    state[name].copy_(src.to(device=state[name].device))  # a tied head shares the storage
            staged.closed = True
            self._set_version(version)
            # the receipt fingerprints what the engine now holds, not what it was handed
            loaded = [(name, state[name]) for name, _ in staged.tensors]
            return [Receipt(worker=0, version=version, fingerprint=fingerprint(loaded),
                            num_tensors=len(loaded), seconds=time.perf_counter() - t0)]
