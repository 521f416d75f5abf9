"""LoRA through peft: wrap the policy, publish merged weights, keep checkpoints to the adapter.

Why peft and not a hand-written low-rank layer: the adapter a user exports must load with
``PeftModel.from_pretrained`` and merge with ``merge_and_unload()`` exactly as peft does, and the one
way to be sure of that is to train peft's own modules.

Why merged weights for weight sync (``actor.lora.sync: merged``, the default): every engine (embedded, vLLM, SGLang) already loads full HF
weights, so ``W + (alpha / r) * B A`` per adapted layer is published in the base model's HF names and
no engine needs LoRA support. The merge is computed the way peft's ``merge`` computes it
(``base + get_delta_weight``), out of place, so the published tensors equal ``merge_and_unload()`` bit
for bit and the live base weights are never touched (an in-place merge + unmerge would drift them).
``actor.lora.sync: adapter`` sends the adapter alone instead (:meth:`Actor.export_adapter` into
``RolloutEngine.load_adapter``, :mod:`unirl.sync.inprocess`) to an engine that serves LoRA (vLLM).

Only vanilla LoRA is exposed (no DoRA, no LoRA bias, no ``modules_to_save``): those change what a
merge is, and :func:`merged_named_weights` refuses a layer it does not know how to merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from unirl.actor.checkpoint import (  # noqa: F401 - re-exported
    ADAPTER_FILE,
    REFERENCE_ADAPTER_FILE,
    adapter_state,
    load_adapter_state,
    staging_dir,
)
from unirl.kernel.errors import UniRLError

if TYPE_CHECKING:  # pragma: no cover
    from unirl.config import LoraSection

#: the one adapter name a UniRL actor trains (peft's default)
ADAPTER = "default"


class LoraError(UniRLError, ValueError):
    """``actor.lora`` cannot be applied to this model; the message names the field and the fix."""


def _missing_peft() -> LoraError:
    return LoraError("actor.lora needs peft, which is not installed (fix: pip install 'unirl-core[lora]', "
                     "or remove actor.lora)")


def apply_lora(model: torch.nn.Module, lora: LoraSection, *, base_path: str | None = None,
               seed: int | None = None) -> torch.nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))``: the base weights are frozen, only the adapter
    trains. ``base_path`` is recorded in the adapter config (``base_model_name_or_path``) so an exported
    adapter names the base it applies to. ``seed``: draw the adapter's random init (peft's ``lora_A``)
    from it, outside the process's RNG stream, so that every rank of a distributed actor starts from
    the same adapter (both actors pass ``run.seed``; None: from the process's RNG)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is in core's [lora] / [test] extras
        raise _missing_peft() from exc
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            wrapped = get_peft_model(model, cfg)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise LoraError(f"actor.lora.target_modules {lora.target_modules!r}: {exc} (fix: name linear layers of "
                        f"this model, one of {names}, or use all-linear)") from None
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base_path
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (what :func:`apply_lora` returns)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def _lora_layers(base: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def merged_named_weights(model: torch.nn.Module, named: Callable[[torch.nn.Module], Iterator[tuple[str, Tensor]]],
                         *, full: Callable[[Tensor], Tensor] | None = None) -> Iterator[tuple[str, Tensor]]:
    """The merged weights of peft ``model`` in the base model's HF names: ``named(base)`` (e.g.
    :func:`unirl.actor.skeleton.hf_named_weights`) with the adapter tensors dropped, ``.base_layer.``
    taken out of the names and each adapted weight replaced by ``base + delta``, ``delta`` computed as
    peft's ``get_delta_weight`` computes it (what ``merge`` adds in place).

    ``full`` maps a (possibly sharded) tensor to the whole tensor: a distributed actor passes its gather
    (FSDP: ``DTensor.full_tensor``, a collective, so every rank must consume this iterator in step) and
    the merge runs on the gathered base, ``lora_A`` and ``lora_B``. None: the tensors are whole already.
    Each merged tensor is a new tensor; the rest are what ``full`` returns (views of the live weights
    when nothing is gathered)."""
    full = full or (lambda t: t)
    base = model.get_base_model()
    layers = _lora_layers(base)
    for owner, layer in layers.items():
        if layer.lora_variant or any(layer.lora_bias.values()):
            raise LoraError(f"{owner}: a LoRA variant (DoRA) or LoRA bias, which this merge does not handle "
                            "(fix: plain LoRA, as actor.lora builds)")
    for name, t in named(base):
        if ".lora_" in name:
            continue
        owner, sep, leaf = name.rpartition(".base_layer.")
        t = full(t)
        if not sep:
            yield name, t.detach()
            continue
        if leaf == "weight":
            with torch.no_grad():
                t = t + _delta_weight(layers[owner], full).to(t.dtype)
        yield f"{owner}.{leaf}", t.detach()


def _delta_weight(layer: Any, full: Callable[[Tensor], Tensor]) -> Tensor:
    """peft's ``Linear.get_delta_weight(ADAPTER)`` on ``full`` of the adapter weights: ``B @ A`` (transposed
    for fan-in-fan-out layers) times the scaling, in fp32 for half-precision weights on the CPU, as peft
    does. Written out because peft's method reads the layer's own (sharded) parameters;
    ``core/tests/test_lora.py`` holds it to ``merge_and_unload()`` bit for bit."""
    from peft.utils.other import transpose

    a, b = full(layer.lora_A[ADAPTER].weight), full(layer.lora_B[ADAPTER].weight)
    dtype = b.dtype
    cast = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        a, b = a.float(), b.float()
    delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER]
    return delta.to(dtype) if cast else delta


def base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the frozen base weights (adapter excluded): a checkpoint holds only the adapter, so a
    resume must rebuild the same base, and this says whether it did."""
    from unirl.contracts import fingerprint

    base = model.get_base_model()
    return fingerprint((n, t) for n, t in base.state_dict().items() if ".lora_" not in n)


def check_base(where: str, saved: str | None, built: str) -> None:
    """Refuse an adapter checkpoint whose base fingerprint (``saved``) is not the one this run built."""
    if saved != built:
        raise LoraError(f"actor.lora: checkpoint {where}: its LoRA adapter was trained on base weights with "
                        f"fingerprint {str(saved)[:12]}, this run built {built[:12]} (fix: the same model.path / "
                        "model.build and run.seed as the run that wrote it)")


def write_adapter_dir(path: str, model: torch.nn.Module, tokenizer: Any = None, *,
                      state_dict: Mapping[str, Tensor] | None = None) -> None:
    """peft's ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``) + tokenizer into
    ``path``, atomically: ``PeftModel.from_pretrained(base, path)`` loads it. ``state_dict``: the adapter
    tensors in ``model.state_dict()`` names, gathered whole (a sharded model's own would be shards)."""
    with staging_dir(path) as tmp:
        model.save_pretrained(str(tmp), **({"state_dict": dict(state_dict)} if state_dict is not None else {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
