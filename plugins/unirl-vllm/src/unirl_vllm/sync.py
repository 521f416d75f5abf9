"""The ``vllm`` weight sync: stream an actor's weights into a running vLLM engine, receipted.

Works for any actor whose ``named_weights()`` yields ``(name, tensor)`` pairs: the embedded actor's
parameters, or the FSDP actor's gathered buckets. The stream is consumed once: each tensor is cast to
the engine's dtype, renamed by the model adapter, checked and staged by the engine, and folded into
the sender's manifest fingerprint on the way. Then the engine loads the staged set in one session and
commits the version only when every worker's receipt carries that fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from unirl.contracts import Actor, Receipt, RolloutEngine, WeightSync, fingerprint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unirl.config import RunConfig


class VLLMWeightSync(WeightSync):
    """Publishes an actor's weights into a :class:`unirl_vllm.engine.VLLMEngine`."""

    def __init__(self, *, config: RunConfig | None = None, **_: Any) -> None:
        self.config = config

    def publish(self, actor: Actor, engine: RolloutEngine, version: int) -> tuple[list[Receipt], str]:
        stage = getattr(engine, "stage", None)
        if stage is None:
            raise TypeError(f"the vllm weight sync needs a vllm engine, got {type(engine).__name__}")
        staged = stage()
        dtype = _torch_dtype(engine.dtype)

        def cast(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                yield name, tensor.detach().to(dtype)

        # fingerprint() pulls the stream through the staging area: one pass, no second copy.
        staged.fingerprint = fingerprint(staged.tap(cast(iter(actor.named_weights()))))
        receipts = engine.load_weights(staged, version)
        return receipts, staged.fingerprint


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, str(name).removeprefix("torch."))
