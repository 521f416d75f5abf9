"""The bytes an actor holds per rank: the training-state and activation arithmetic both actors declare.

Why shared: the embedded actor is one rank of the same arithmetic (``ranks=1``, nothing gathered); the
FSDP actor shards the persistent state over its ranks and gathers one block at a time. Each actor's
``memory_layout`` calls :func:`actor_items` with what it really does.

What is counted (bytes, at the peak of a steady-state train step, all coexisting):
  * parameters in fp32 (both actors keep fp32 master weights; bf16 compute casts on the fly);
  * gradients, fp32, of what trains (the LoRA adapter alone under ``actor.lora``);
  * AdamW's two fp32 moments of what trains;
  * the KL reference (``algorithm.kl_coef > 0``): a frozen fp32 copy, sharded like the parameters;
  * the LoRA adapter's own parameters; the value head (``actor.value_head``);
  * activations of one micro-batch (``micro_batch_size`` x (``data.max_prompt_tokens`` +
    ``rollout.max_new_tokens``) tokens, capped by ``micro_batch_tokens``), per decoder layer, with and
    without ``activation_checkpointing``;
  * the logits of one micro-batch: fp32 ``[tokens, vocab]``, logits + log-softmax + their gradient, each
    bounded by one chunk of :mod:`unirl.actor.chunked_logprobs`;
  * what a sharded actor gathers at once (``gathered_blocks`` decoder layers in the compute dtype, the
    embedding and head while the root unit runs, and one block's gradient being reduce-scattered).
  * on a CPU rank, the backward blocks glibc's heap keeps until the step ends (:func:`heap_backward_bytes`).
What is left out: the process itself (Python, torch, Ray, NCCL/gloo: the baseline the measurement
subtracts), allocator fragmentation, the autocast weight cache, the tokenizer and the data.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl.config import RunConfig
from unirl.memory_plan.layout import DTYPE_BYTES, MemoryItem, ModelFacts

#: fp32 logits per chunk of the actor's packed forward (unirl.actor.chunked_logprobs.CHUNK_BYTES; a test
#: holds the two equal, so this module needs no torch)
CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class RankShape:
    """How one actor rank holds the model: over how many ranks the persistent state is sharded, in which
    dtype it computes, and how many decoder layers it holds unsharded at once (0: none, it is whole)."""

    ranks: int = 1
    compute_dtype: str = "float32"
    gathered_blocks: int = 0
    gathers_root: bool = False
    #: the rank's gradients go through FSDP's reduce-scatter on the host, under glibc's heap (a CPU rank):
    #: see :func:`heap_backward_bytes`
    heap_backward: bool = False


def micro_batch_tokens(config: RunConfig) -> int:
    """Tokens of one micro-batch at most: prompt + response of ``micro_batch_size`` sequences."""
    seq = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    tokens = config.actor.micro_batch_size * seq
    cap = config.actor.micro_batch_tokens
    return min(tokens, max(cap, seq)) if cap else tokens


def lora_params(config: RunConfig, facts: ModelFacts) -> int:
    """The adapter's parameters: r x (in + out) per adapted linear, every layer."""
    lora = config.actor.lora
    if lora is None:
        return 0
    linears = facts.linears()
    names = linears if lora.target_modules == "all-linear" else [n for n in lora.target_modules if n in linears]
    return facts.layers * sum(lora.r * sum(linears[n]) for n in names)


def activation_bytes(config: RunConfig, facts: ModelFacts, compute_dtype: str) -> int:
    """Saved activations of one micro-batch through every decoder layer (forward kept for backward).

    Per token and layer: the norms' inputs and outputs in fp32 (3 x hidden), the matmul outputs in the
    compute dtype (q, k, v and their normed / rotated copies, attention output, o_proj, gate, up, the
    activation and the product: 3 x hidden + 4 x (q + kv) + 4 x intermediate). Full checkpointing keeps
    each layer's input and recomputes one layer at a time; selective keeps the matmul outputs."""
    tokens = micro_batch_tokens(config)
    cb = DTYPE_BYTES[compute_dtype]
    q, kv = facts.heads * facts.head_dim, facts.kv_heads * facts.head_dim
    inter = facts.moe_intermediate * 8 if facts.experts else facts.intermediate  # ~8 active experts a token
    norms = 3 * facts.hidden * 4
    matmuls = (3 * facts.hidden + 4 * (q + kv) + 4 * inter) * cb
    per_layer = tokens * (norms + matmuls)
    mode = config.actor.activation_checkpointing
    if mode is True:
        return facts.layers * tokens * facts.hidden * 4 + per_layer
    if mode == "selective":
        return facts.layers * tokens * matmuls + per_layer
    return facts.layers * per_layer


def logits_bytes(config: RunConfig, facts: ModelFacts) -> int:
    """fp32 logits, their log-softmax and its gradient: each one chunk of the packed forward at most."""
    return 3 * min(micro_batch_tokens(config) * facts.vocab * 4, CHUNK_BYTES)


#: glibc's largest dynamic mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x sizeof(long)): a
#: block at least this large is always mmapped and unmapped when freed, so it never strands on the heap
MMAP_THRESHOLD_MAX = 32 * 2**20


def layer_tensors(config: RunConfig, facts: ModelFacts) -> list[int]:
    """Parameter counts of one decoder layer's trained tensors, which sum to what the layer trains: each
    linear and the rest (norms; MoE: the experts) as one; under ``actor.lora`` each adapted linear's A and B."""
    lin = facts.linears()
    lora = config.actor.lora
    if lora is not None:
        names = lin if lora.target_modules == "all-linear" else [n for n in lora.target_modules if n in lin]
        return [lora.r * d for n in names for d in lin[n]]
    sizes = [a * b for a, b in lin.values()]
    return [*sizes, facts.block_params - sum(sizes)]


def heap_backward_bytes(config: RunConfig, facts: ModelFacts, shape: RankShape) -> int:
    """What a CPU rank's heap holds at the end of backward beyond the live tensors, per decoder layer, while
    the layer's flat fp32 reduce-scatter input (4 B a trained parameter) is below ``MMAP_THRESHOLD_MAX``:
    with more than one rank, that input and, in fp32 compute, the unsharded gradients too (4 B); in bf16
    the gradients add nothing; at one rank, the compute-dtype gradients. When the input is larger, nothing,
    except the bf16 gradients at several ranks.

    Derivation (FSDP2's ``foreach_reduce``, per layer): backward makes each parameter's unsharded gradient
    in the compute dtype (one block a tensor), copies them into one flat fp32 reduce-scatter input and
    allocates the new 1/N fp32 gradient shard; then both are freed. glibc's dynamic mmap threshold (it
    rises to the largest freed block, at most ``MMAP_THRESHOLD_MAX``) puts blocks below it on the heap,
    and each layer's small shard lands inside the freed holes, so the next layer's blocks no longer fit
    there: the heap grows by about a layer's worth of each stranded block a layer until the step ends
    (``trim_after_transient`` hands it back then, not before the peak). What strands is the flat input and
    the blocks as large as it: the fp32 gradients (4 B, the input's size); the bf16 gradients (2 B, half of
    it) are served from its holes. When the flat input is 32 MiB or more it is mmapped and handed back at
    once, and the layers' gradients, the same shapes every layer, reuse each other's holes: nothing strands.
    Measured (a run's peak RSS, ``memory.json``, minus the plan's live items; the term was isolated with a
    /proc VmHWM probe, phase by phase, of a 2-rank 25 M step), Qwen3, a parameter: fp32 at 2 and 4 ranks
    5-9 B at 25 M and 100 M (8 here); bf16 at 2 ranks 3.8-4.1 B (4 here), at 4 ranks 2.1-6 B (4 here: the
    cell that kept 2.1-2.7 B, 100 M x4, is predicted +12 to +19 %; with fp32's rule it was +32 to +39 %); at
    250 M (a 12.6 M-parameter layer, its 50 MB input mmapped) 0.03 B in fp32 at 2 ranks (0 here: -1 %;
    counted as at 100 M, +33 %), but 1.1 B (x2) and 1.7 B (x4) in bf16: there the bf16 gradients (2 B) are
    counted whole, so the plan errs high (+8 % / +3 %; without them -10 % / -22 %). That bf16 rule is fitted
    to those two cells, not derived: why bf16 gradients strand beside a mmapped input and fp32 ones do not
    is not explained. At one rank the shard is the whole
    layer and fits the hole, so only the compute-dtype gradients count (measured 2.2-5.2 B). With
    ``MALLOC_MMAP_THRESHOLD_`` fixed the excess vanishes (peak within 8 % of the live tensors), which is how
    the term was isolated: a fragmentation law of glibc's malloc fitted to these cells, not a count of
    tensors (another allocator makes it smaller). Not on a GPU: CUDA's caching allocator reuses the blocks."""
    if not shape.heap_backward:
        return 0
    cb = DTYPE_BYTES[shape.compute_dtype]
    trained = sum(layer_tensors(config, facts))
    flat = 4 * trained
    if flat >= MMAP_THRESHOLD_MAX:  # mmapped input: only bf16 gradients at several ranks (fitted, see above)
        return facts.layers * cb * trained if shape.ranks > 1 and cb < 4 else 0
    grads = cb * trained if shape.ranks == 1 or cb >= 4 else 0
    return facts.layers * (grads + (flat if shape.ranks > 1 else 0))


def actor_items(config: RunConfig, facts: ModelFacts, shape: RankShape) -> tuple[list[MemoryItem], list[MemoryItem]]:
    """One rank's (persistent state, working set): the state may move to the host (CPU offload); the
    working set (activations, logits, gathered layers) stays where the compute runs."""
    w, p = shape.ranks, facts.params
    adapter = lora_params(config, facts)
    trains = adapter if config.actor.lora is not None else p
    shard = f" / {w} ranks" if w > 1 else ""
    state = [MemoryItem("parameters (fp32)", 4 * p // w, f"{p:,} params x 4 B{shard}"),
             MemoryItem("gradients (fp32)", 4 * trains // w, f"{trains:,} trained x 4 B{shard}"),
             MemoryItem("AdamW moments (fp32)", 8 * trains // w, f"{trains:,} trained x 2 x 4 B{shard}")]
    if adapter:
        state.append(MemoryItem("LoRA adapter (fp32)", 4 * adapter // w, f"r={config.actor.lora.r}"))
    if config.algorithm.kl_coef > 0:
        state.append(MemoryItem("KL reference (fp32)", 4 * p // w, f"frozen copy{shard}"))
    if config.actor.value_head:
        state.append(MemoryItem("value head (+grad, AdamW)", 16 * (facts.hidden + 1), "hidden + 1 params"))
    tokens = micro_batch_tokens(config)
    work = [MemoryItem("activations (1 micro-batch)", activation_bytes(config, facts, shape.compute_dtype),
                       f"{tokens:,} tokens x {facts.layers} layers, checkpointing "
                       f"{config.actor.activation_checkpointing}"),
            MemoryItem("logits (1 micro-batch)", logits_bytes(config, facts),
                       f"min({tokens:,} x {facts.vocab:,} x 4 B, one chunk) x 3")]
    if shape.gathered_blocks:
        cb = DTYPE_BYTES[shape.compute_dtype]
        root = facts.embedding_params + facts.head_params if shape.gathers_root else 0
        held = shape.gathered_blocks * facts.block_params + root
        work.append(MemoryItem("gathered (unsharded) layers", held * cb + 4 * facts.block_params,
                               f"{shape.gathered_blocks} layer(s){' + embedding/head' if root else ''} in "
                               f"{shape.compute_dtype} + one layer's grad being reduce-scattered"))
    heap = heap_backward_bytes(config, facts, shape)
    if heap:
        cb = DTYPE_BYTES[shape.compute_dtype]
        per = ("compute-dtype grads" if w == 1 else "fp32 grads + fp32 reduce-scatter input" if cb >= 4
               else "fp32 reduce-scatter input")
        work.append(MemoryItem("backward blocks the heap keeps", heap, f"{facts.layers} layers x ({per}), "
                               "while a layer's fp32 input < 32 MiB; glibc, until the step's trim "
                               "(unirl.memory_plan.arithmetic.heap_backward_bytes)"))
    return state, work
