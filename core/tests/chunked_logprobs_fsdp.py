"""Two FSDP2 ranks over gloo: the chunked log-probs (the output projection called once per chunk inside
the root unit's forward, and again per chunk in the backward) against the direct path, on each rank.

Run by ``test_chunked_logprobs.py::test_fsdp2_two_ranks_chunked_equals_direct`` as a script (spawned
ranks import this file by path). Prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
VOCAB = 512


def _rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import test_chunked_logprobs as t
    from torch.distributed.fsdp import fully_shard

    from unirl.actor import chunked_logprobs as cl

    res = {}
    for mode, budget in (("direct", 10**12), ("chunked", cl.ROW_ALIGN * 4 * VOCAB)):
        cl.CHUNK_BYTES = budget
        model = t.big_vocab_model(vocab=VOCAB)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)  # the root: embeddings, norm and the tied lm_head
        packed = t.pack(t.samples_of(VOCAB, [150, 140, 60, 70][rank::world]))
        logp, ent, _ = cl.forward_logprobs(model, packed, with_entropy=True)
        t.weighted_backward(logp)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad():
            replay, _, _ = cl.forward_logprobs(model, packed)
        res[mode] = (logp.detach(), ent, replay, grads, len(cl.chunk_bounds(packed.num_tokens, VOCAB)))
    (d_logp, d_ent, d_replay, d_grads, _), (c_logp, c_ent, c_replay, c_grads, chunks) = res["direct"], res["chunked"]
    out = {"rank": rank, "chunks": chunks, "logp": torch.equal(c_logp, d_logp), "entropy": torch.equal(c_ent, d_ent),
           "replay": torch.equal(c_replay, d_replay),
           "grads_differ": sorted(n for n in d_grads if not torch.equal(c_grads[n], d_grads[n])),
           "grads_close": all(torch.allclose(c_grads[n], d_grads[n], rtol=1e-5, atol=1e-6) for n in d_grads)}
    # one write(2) per line: both ranks share the pipe, and print() writes the text and its newline apart
    # (two lines ran together in ci-local); a write under PIPE_BUF is atomic
    os.write(1, (json.dumps(out) + "\n").encode())
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
