"""Engine side of R3: each sampled token's top-k expert ids per sparse layer, onto its sample.

The embedded engine feeds each sampled token back in the next decode step; :class:`RouteRecorder`
hooks every router and, inside :meth:`RouteRecorder.step`, writes that step's ids into the batch's
buffer at ``[row, token]`` (the module doc of :mod:`unirl.routing` says why the step that *feeds* a
token is its record). Prefill is not recorded: prompt tokens are routed by the trainer's router.

Storage: ``Sample.routing`` is an int16 numpy array ``[response tokens, layers, k]`` (2 bytes an id:
up to 32,767 experts), :data:`~unirl.routing.routers.NO_EXPERT` where nothing was recorded. numpy,
not torch: samples cross processes and are pickled into checkpoints (``unirl.samples`` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from unirl.routing.routers import NO_EXPERT, RouterSpec, routers_or_refuse

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from unirl.config import RunConfig
    from unirl.samples import Sample

#: the stored dtype of an expert id
ROUTE_DTYPE = "int16"


class RouteRecorder:
    """Forward hooks on a model's routers that record decode steps into a ``[B, N, layers, k]`` buffer.

    One batch at a time (the engine's sampling loop is sequential): :meth:`begin` allocates the
    buffer, :meth:`step` marks which rows and token index the next forward feeds, :meth:`row` reads a
    finished row back."""

    def __init__(self, routers: Sequence[RouterSpec]) -> None:
        if not routers:
            raise ValueError("RouteRecorder needs at least one router (a Mixture-of-Experts model)")
        self.routers = list(routers)
        self.k = max(r.top_k for r in self.routers)
        self.buf: torch.Tensor | None = None
        self._at: tuple[torch.Tensor, int] | None = None
        self._handles = [r.module.register_forward_hook(self._hook(i, r.module)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int, owner: Any):
        def hook(module: Any, _args: tuple, output: tuple) -> None:
            if self._at is None or module is not owner or self.buf is None:
                return  # prefill, or a copy of the model that inherited the hook
            rows, t = self._at
            ids = output[2]
            self.buf[rows, t, i, : ids.shape[-1]] = ids.to(self.buf.dtype)
        return hook

    def begin(self, rows: int, tokens: int, device: Any = None) -> None:
        """A new batch of ``rows`` rows of at most ``tokens`` new tokens: nothing recorded yet."""
        import torch

        self.buf = torch.full((rows, tokens, len(self.routers), self.k), NO_EXPERT, dtype=torch.int16, device=device)

    @contextlib.contextmanager
    def step(self, rows: torch.Tensor, token: int) -> Iterator[None]:
        """The forward inside feeds token ``token`` of the batch rows ``rows`` (one input token a row)."""
        self._at = (rows, token)
        try:
            yield
        finally:
            self._at = None

    def row(self, r: int, n: int) -> np.ndarray:
        """Row ``r``'s first ``n`` tokens' records, ``[n, layers, k]`` int16 on the host."""
        assert self.buf is not None, "begin() first"
        return self.buf[r, :n].cpu().numpy()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def recorder_for(config: RunConfig, adapter: Any, model: Any) -> RouteRecorder | None:
    """An engine's recorder over ``model`` (built by ``adapter``) when ``algorithm.routing_replay`` is
    on; None when off."""
    if not config.algorithm.routing_replay:
        return None
    return RouteRecorder(routers_or_refuse(config, adapter, model))


def attach_routes(sample: Sample, routes: np.ndarray) -> None:
    """Store the records of the model turn just appended (its ``len(routes)`` tokens end
    ``sample.response_ids``) on ``sample.routing``, aligned with the response: earlier tokens without
    a record (observations, another engine's turn) get :data:`NO_EXPERT` rows."""
    import numpy as np

    n = routes.shape[0]
    prev = len(sample.response_ids) - n
    if prev < 0:
        raise ValueError(f"sample {sample.id}: {n} routing records for {len(sample.response_ids)} response tokens")
    old = routes_of(sample, prev, like=routes)
    sample.routing = np.concatenate([old, routes.astype(ROUTE_DTYPE, copy=False)])


def routes_of(sample: Sample, length: int | None = None, *, like: np.ndarray | None = None) -> np.ndarray | None:
    """``sample.routing`` cut or padded with :data:`NO_EXPERT` to ``length`` rows (default: the
    response's length); None when the sample carries no routing and ``like`` gives no shape."""
    import numpy as np

    n = len(sample.response_ids) if length is None else length
    have = sample.routing
    if have is None and like is None:
        return None
    shape = (have if have is not None else like).shape[1:]
    out = np.full((n, *shape), NO_EXPERT, dtype=ROUTE_DTYPE)
    if have is not None:
        m = min(n, have.shape[0])
        out[:m] = have[:m]
    return out
