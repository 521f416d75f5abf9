"""Selected-token log-probs without the whole ``[tokens, vocab]`` logits: the actor's packed forward.

Why: the direct path takes the output projection of every target token, ``[N, V]`` in fp32, then a
``log_softmax`` of the same size that the backward keeps. At Qwen3's 151,936-token vocabulary and 8 k
tokens per micro-batch that is ~5 GB each, more than the model. Here the output projection runs one
chunk of tokens at a time (:func:`chunk_bounds`, about :data:`CHUNK_BYTES` of fp32 logits a chunk), and
each chunk's projection, log-softmax and gather are wrapped in a non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, so the backward recomputes one chunk at a time too: at most one
chunk of ``[tokens, vocab]`` (with its few temporaries) exists at once, forward and backward.

The same bits as the direct path, per token. Each token's reduction over the vocabulary is the same
row-wise kernel on the same row (log-softmax, top-k / top-p, entropy), and its logits come from the same
module on the same hidden state. What changes is how many rows one output-projection GEMM sees. Under
parity that changes nothing: the parity plugin's linear is row-invariant by construction. Plain GEMMs
are not row-invariant everywhere. On the AVX-512 + AMX Xeon measured (torch 2.13), fp32 rows matched
the whole GEMM for every row count >= 3 (1 and 2 differ), so chunks are multiples of :data:`ROW_ALIGN`
rows and a short tail joins the chunk before it. Under bf16 autocast an odd total count differed in one row
either way. The weight gradient of the output projection is a sum over tokens, so chunking
re-associates it (last-bit differences in that one gradient; every other gradient is computed row by
row and keeps its bits).

How the projection is reached, under FSDP2 as well: a forward pre-hook on the output embedding captures
its input (the final hidden states at the target positions) and hands the module zero rows, and a
forward hook replaces its (empty) output with the log-probs, shaped ``[1, N, 1]``. The chunks so run
inside the model's own forward: FSDP's root unit has its parameters gathered there, and its
pre-backward hook (registered on the model's output) gathers them again before the backward recomputes a
chunk. The MoE router's ``aux_loss``, peft adapters, activation checkpointing and the value head's
capture are untouched. A model that post-processes its logits after the head (a softcap) keeps the
direct path.

A micro-batch whose logits fit one chunk (the demo's 259-token vocabulary always does) takes the direct
path unchanged: no hooks, no checkpoint, no cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from unirl.actor.vision_inputs import vision_inputs
from unirl.logprobs import LogprobProcessing, logprobs_of

if TYPE_CHECKING:  # pragma: no cover
    from unirl.packing import PackedBatch

#: fp32 logits per chunk: 256 MiB, ~440 tokens at a 151,936-token vocabulary
CHUNK_BYTES = 256 * 2**20
#: chunk lengths are multiples of this many tokens (a plain GEMM's rows are not invariant below 3)
ROW_ALIGN = 64
#: logit transforms an HF config may apply after the output projection: such models keep the direct path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def chunk_bounds(num_tokens: int, vocab: int, budget: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``num_tokens`` target rows, about ``budget`` bytes
    (:data:`CHUNK_BYTES`) of fp32 logits each: one chunk when the whole fits (the direct path), else
    chunks of a multiple of :data:`ROW_ALIGN` rows (at least one multiple); a tail shorter than that takes
    :data:`ROW_ALIGN` rows from the chunk before (or joins it, when that is all it has)."""
    budget = CHUNK_BYTES if budget is None else budget
    if num_tokens * vocab * 4 <= budget:
        return [(0, num_tokens)]
    rows = max(ROW_ALIGN, budget // (vocab * 4) // ROW_ALIGN * ROW_ALIGN)
    starts = list(range(0, num_tokens, rows))
    if len(starts) > 1 and num_tokens - starts[-1] < ROW_ALIGN:  # a short tail: ROW_ALIGN rows from the
        starts[-1] -= ROW_ALIGN                                    # chunk before, or all of it
        if starts[-1] == starts[-2]:
            starts.pop()
    ends = starts[1:] + [num_tokens]
    return list(zip(starts, ends, strict=True))


def selected_and_entropy(logits: Tensor, targets: Tensor, processing: LogprobProcessing | None,
                         with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``(logp [n], entropy [n] | None)`` of ``logits [n, V]``: the one formula both paths use.

    The entropy is a detached metric taken from the log-probs already computed (three passes over
    ``[n, V]``, not seven)."""
    logp_all = logprobs_of(logits.float(), processing, sampled=targets)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.special.entr(logp_all.detach().exp()).sum(-1)
    return logp, entropy


def _direct_path(model: torch.nn.Module, packed: PackedBatch) -> bool:
    """One chunk holds every target's logits, or the model transforms its logits after the head."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(chunk_bounds(packed.num_tokens, vocab)) == 1:
        return True
    config = getattr(model, "config", None)
    return any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS)


def _chunked(head: torch.nn.Module, hidden: Tensor, targets: Tensor, processing: LogprobProcessing | None,
             with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``selected_and_entropy`` of ``head(hidden)``, one chunk of rows at a time, as ``(logp [1, N, 1],
    entropy [N] | None)``; with gradients, each chunk is checkpointed (its logits are recomputed in the
    backward, not kept)."""
    bounds = chunk_bounds(hidden.shape[0], head.weight.shape[0])
    sizes = [b - a for a, b in bounds]
    entropies: list[Tensor] = []
    forward_done = [False]  # the backward's recompute skips the (detached) entropy

    def chunk(h: Tensor, t: Tensor) -> Tensor:
        # ``head.forward``, not ``head(...)``: the hooks that route here are still installed
        logp, ent = selected_and_entropy(head.forward(h), t, processing, with_entropy and not forward_done[0])
        if ent is not None:
            entropies.append(ent)
        return logp

    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    outs = []
    for h, t in zip(hidden.split(sizes), targets.split(sizes), strict=True):
        if grad:
            outs.append(checkpoint(chunk, h, t, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(chunk(h, t))
    forward_done[0] = True
    # ``[1, N, 1]``, a new tensor: a view returned from an FSDP2 root is warned about (in-place ops on it
    # would drop the pre-backward hook)
    return torch.cat([o.view(1, -1, 1) for o in outs], dim=1), (torch.cat(entropies) if with_entropy else None)


def forward_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
    router_aux: dict[str, Tensor] | None = None,
    processing: LogprobProcessing | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One packed forward. Returns ``(logp [N], entropy [N] | None, values [N] | None)`` in fp32.

    ``router_aux``: when given (MoE models, ``algorithm.router_aux_loss_coef > 0``), the forward asks
    for router logits (``output_router_logits=True``) and ``router_aux["aux_loss"]`` receives the
    documented ``aux_loss`` field of transformers' MoE output (Switch-Transformer load balancing over
    every token of the packed row), or None when the model has no router.

    ``logp`` is the log-prob of each response token under the raw model distribution
    (``log_softmax(logits)``, ``processing`` None) or under ``processing`` (temperature, top-k, top-p in
    vLLM's order: :mod:`unirl.logprobs`, ``rollout.logprobs: processed``; :meth:`LogprobProcessing.of_run`),
    differentiable when grad is enabled. Only the ``N`` target positions' logits are computed
    (``logits_to_keep=target_index``), one chunk of tokens at a time when they exceed
    :data:`CHUNK_BYTES` (module doc). ``entropy`` is a detached metric. ``values`` come from
    ``value_head`` applied to the final (normed) hidden state at the same positions, i.e. the input of the
    output embedding, captured with a forward pre-hook (works with any HF causal LM and under FSDP).
    """
    if packed.num_tokens == 0:
        empty = torch.zeros(0, device=packed.input_ids.device)
        return empty, (empty if with_entropy else None), (empty if value_head is not None else None)
    direct = _direct_path(model, packed)
    captured: dict[str, Tensor] = {}
    extra: dict[str, Tensor | None] = {}
    head = model.get_output_embeddings()
    handles = []
    if value_head is not None or not direct:
        handles.append(head.register_forward_pre_hook(_pre_hook(captured, empty_rows=not direct)))
    if not direct:
        handles.append(head.register_forward_hook(_post_hook(captured, extra, packed.target_ids, processing,
                                                             with_entropy)))
    # a vision-language batch: the images' pixels and 3-D positions (a text batch: the packed positions)
    inputs = vision_inputs(model, packed) if packed.images is not None else {"position_ids": packed.position_ids}
    try:
        out = model(
            input_ids=packed.input_ids,
            use_cache=False,
            logits_to_keep=packed.target_index,
            **inputs,
            **({"output_router_logits": True} if router_aux is not None else {}),
        )
        if router_aux is not None:
            router_aux["aux_loss"] = out.get("aux_loss")
    finally:
        for handle in handles:
            handle.remove()
    if direct:
        logp, entropy = selected_and_entropy(out.logits[0], packed.target_ids, processing, with_entropy)
    else:
        logp, entropy = out.logits[0, :, 0], extra["entropy"]
    values = None
    if value_head is not None:
        hidden = captured["h"][0]  # [N, H]
        values = value_head(hidden.float()).squeeze(-1).float()
    return logp, entropy, values


def _pre_hook(captured: dict[str, Tensor], *, empty_rows: bool) -> Callable:
    """Capture the head's input ``[1, N, H]``; on the chunked path hand the head zero rows instead."""
    def hook(_module: torch.nn.Module, args: tuple) -> tuple | None:
        captured["h"] = args[0]
        return (args[0][:, :0],) + tuple(args[1:]) if empty_rows else None
    return hook


def _post_hook(captured: dict[str, Tensor], extra: dict[str, Tensor | None], targets: Tensor,
               processing: LogprobProcessing | None, with_entropy: bool) -> Callable:
    """Replace the head's empty output with the chunked log-probs ``[1, N, 1]`` (entropy into ``extra``)."""
    def hook(module: torch.nn.Module, _args: tuple, _output: Tensor) -> Tensor:
        logp, extra["entropy"] = _chunked(module, captured["h"][0], targets, processing, with_entropy)
        return logp
    return hook
