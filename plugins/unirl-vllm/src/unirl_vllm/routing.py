"""R3 on vLLM (``algorithm.routing_replay``): each sampled token's top-k expert ids, recorded in the workers.

Why not vLLM's own ``enable_return_routed_experts``: in vLLM 0.32 it needs Model Runner V2, which needs
Triton, which the CPU build lacks. So the record is taken where vLLM chooses the experts, without the
parity plugin and without ``UNIRL_PARITY_ENABLE``:

* **worker side** (:func:`install`, :func:`take`; called through the worker extension's
  ``unirl_routing_install`` / ``unirl_routing_take``): each MoE layer's ``MoERunner.router.select_experts``
  is wrapped, so the ``topk_ids`` vLLM routes by are captured as they are returned; the model runner's
  ``_model_forward`` is wrapped, so after each forward the rows of the flattened batch are mapped to
  their requests (the runner's ``input_batch.req_ids`` and ``query_start_loc``, the forward's
  ``positions``: the map the parity plugin's routing diagnostic also reads). A row at position ``p`` past
  its request's prompt is the forward that fed the response token at ``p``: its ids are filed under
  ``(request, p)``. Prompt rows are not kept (the trainer routes prompt tokens itself).
* **host side** (:class:`HostRoutes`, in :class:`~unirl_vllm.host.Host`): after every engine step it takes
  the workers' records (one TP rank's: the router is replicated) and, when a request finishes, hands its
  turn's records back as ``[tokens, layers, k]`` int16, -1 where none (the last sampled token is never fed).
* **engine side**: :func:`unirl.api.attach_routes` puts them on the sample (``Sample.routing``), the
  layout the embedded engine writes (:mod:`unirl.routing`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unirl.api import UniRLError

#: the id stored where nothing was recorded (``unirl.routing.NO_EXPERT``)
NO_EXPERT = -1


class _Tap:
    """Worker-side: the ids of the forward in progress, per layer, and the records filed so far."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.ids: dict[int, Any] = {}
        self.records: dict[str, list[tuple[int, np.ndarray]]] = {}

    def file(self, runner: Any, positions: Any) -> None:
        """Map this forward's rows to requests (module doc) and keep the response rows."""
        import torch

        ids, self.ids = self.ids, {}
        if positions is not None and positions.numel() and not ids:
            # a forward that fed tokens through no wrapped router: something replaced the MoE forward in
            # this process (the parity profile's MoE kernels route without select_experts); recording
            # nothing would train every token on the trainer's own routing, silently
            raise UniRLError("algorithm.routing_replay: vLLM's MoE layers routed without their router's "
                             "select_experts (another plugin replaced the MoE forward, e.g. the parity profile, "
                             "UNIRL_PARITY_ENABLE=1), so no expert ids were recorded; run R3 without it, or set "
                             "algorithm.routing_replay: false")
        if positions is None or len(ids) != self.layers:
            return
        batch = runner.input_batch
        n = int(batch.num_reqs)
        qsl = [int(x) for x in runner.query_start_loc.np[: n + 1]]
        if not n or any(v.shape[0] < qsl[-1] for v in ids.values()):
            return
        rows = torch.stack([ids[i][: qsl[-1]] for i in range(self.layers)], dim=1).to("cpu", torch.int16).numpy()
        pos = positions[: qsl[-1]].tolist()
        for r, rid in enumerate(batch.req_ids[:n]):
            state = runner.requests.get(rid)
            start = state.num_prompt_tokens if state is not None else 0
            keep = [(pos[j], rows[j]) for j in range(qsl[r], qsl[r + 1]) if pos[j] >= start]
            if keep:
                self.records.setdefault(rid, []).extend(keep)


def install(worker: Any) -> dict[str, int]:
    """Wrap the routers and the forward of ``worker``'s model (module doc); ``{"layers", "k"}``."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    if getattr(worker, "_unirl_routes", None) is not None:
        return worker._unirl_routes_shape
    found = sorted((int(name.split("layers.")[1].split(".")[0]), mod) for name, mod in
                   runner.get_model().named_modules() if isinstance(mod, MoERunner) and "layers." in name)
    if not found:
        raise UniRLError("algorithm.routing_replay: the model vLLM serves has no MoE layers to record (use an MoE "
                         "model, e.g. model.adapter: qwen3_moe, or set algorithm.routing_replay: false)")
    if len({id(m.router) for _, m in found}) != len(found) or any(
            m.routed_experts.quant_method.is_monolithic for _, m in found):
        raise UniRLError("algorithm.routing_replay: this vLLM build routes inside a fused kernel (or shares one "
                         "router between layers), so the expert ids cannot be recorded; set "
                         "algorithm.routing_replay: false or use rollout.engine: torch")
    tap = _Tap(len(found))
    for i, (_, mod) in enumerate(found):
        mod.router.select_experts = _capturing(mod.router.select_experts, tap, i)
    forward = runner._model_forward

    def _model_forward(input_ids: Any = None, positions: Any = None, *args: Any, **kwargs: Any) -> Any:
        tap.ids = {}
        out = forward(input_ids, positions, *args, **kwargs)
        tap.file(runner, positions)
        return out

    runner._model_forward = _model_forward
    k = int(worker.vllm_config.model_config.get_num_experts_per_tok())
    worker._unirl_routes, worker._unirl_routes_shape = tap, {"layers": len(found), "k": k}
    return worker._unirl_routes_shape


def _capturing(select: Any, tap: _Tap, layer: int) -> Any:
    def select_experts(*args: Any, **kwargs: Any) -> Any:
        weights, ids = select(*args, **kwargs)
        tap.ids[layer] = ids.detach()
        return weights, ids
    return select_experts


def take(worker: Any) -> dict[str, list[tuple[int, np.ndarray]]]:
    """The records filed since the last call, by request id (and forgotten here)."""
    tap = worker._unirl_routes
    out, tap.records = tap.records, {}
    return out


class HostRoutes:
    """Host-side: each live request's prompt length, tokens so far and records by position."""

    def __init__(self, layers: int, k: int) -> None:
        self.layers, self.k = layers, k
        self.prompt: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.got: dict[str, dict[int, np.ndarray]] = {}

    def start(self, rid: str, prompt_len: int) -> None:
        self.prompt[rid], self.tokens[rid], self.got[rid] = prompt_len, 0, {}

    def add(self, taken: dict[str, list[tuple[int, np.ndarray]]]) -> None:
        """The workers' records, by the worker's request id: vLLM 0.32 appends ``-<random suffix>`` to the
        id a request was added with, so an id not known as it is is looked up without its last part."""
        for rid, rows in taken.items():
            into = self.got.get(rid)
            if into is None:
                into = self.got.get(rid.rsplit("-", 1)[0])
            if into is not None:
                into.update(rows)

    def gained(self, rid: str, n: int) -> None:
        if rid in self.tokens:
            self.tokens[rid] += n

    def finish(self, rid: str) -> np.ndarray | None:
        """The request's records ``[tokens, layers, k]`` (and forget it); None for an unknown request."""
        if rid not in self.prompt:
            return None
        p, n, got = self.prompt.pop(rid), self.tokens.pop(rid), self.got.pop(rid)
        k = self.k or next((v.shape[-1] for v in got.values()), 1)
        out = np.full((n, self.layers, k), NO_EXPERT, dtype=np.int16)
        for pos, ids in got.items():
            if 0 <= pos - p < n:
                out[pos - p, :, : ids.shape[-1]] = ids
        return out

    def forget(self, rids: list[str]) -> None:
        for rid in rids:
            self.prompt.pop(rid, None), self.tokens.pop(rid, None), self.got.pop(rid, None)


def unrecorded(n: int, shape: dict[str, int]) -> np.ndarray:
    """``n`` tokens without a record (an aborted request's partial turn)."""
    return np.full((n, shape["layers"], max(1, shape["k"])), NO_EXPERT, dtype=np.int16)
