"""LoRA through peft: wrap the policy, publish merged weights, keep checkpoints to the adapter.

Why peft and not a hand-written low-rank layer: the adapter a user exports must load with
``PeftModel.from_pretrained`` and merge with ``merge_and_unload()`` exactly as peft does, and the one
way to be sure of that is to train peft's own modules.

Why merged weights for weight sync: every engine (embedded, vLLM, SGLang) already loads full HF
weights, so ``W + (alpha / r) * B A`` per adapted layer is published in the base model's HF names and
no engine needs LoRA support. The merge is computed the way peft's ``merge`` computes it
(``base + get_delta_weight``), out of place, so the published tensors equal ``merge_and_unload()`` bit
for bit and the live base weights are never touched (an in-place merge + unmerge would drift them).
Sending the adapter alone to vLLM's LoRA support is not built.

Only vanilla LoRA is exposed (no DoRA, no LoRA bias, no ``modules_to_save``): those change what a
merge is, and :func:`merged_named_weights` refuses a layer it does not know how to merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


def apply_lora(model: torch.nn.Module, lora: LoraSection, *, base_path: str | None = None) -> torch.nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))``: the base weights are frozen, only the adapter
    trains. ``base_path`` is recorded in the adapter config (``base_model_name_or_path``) so an exported
    adapter names the base it applies to."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is in core's [lora] / [test] extras
        raise _missing_peft() from exc
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     bias="none", task_type="CAUSAL_LM")
    try:
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


def merged_named_weights(model: torch.nn.Module, named: Callable[[torch.nn.Module], Iterator[tuple[str, Tensor]]]
                         ) -> Iterator[tuple[str, Tensor]]:
    """The merged weights of peft ``model`` in the base model's HF names: ``named(base)`` (e.g.
    :func:`unirl.actor.skeleton.hf_named_weights`) with the adapter tensors dropped, ``.base_layer.``
    taken out of the names and each adapted weight replaced by ``base + get_delta_weight(ADAPTER)``,
    which is what peft's ``merge`` adds in place. Each merged tensor is a new tensor; the rest are views."""
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
        if not sep:
            yield name, t
            continue
        if leaf == "weight":
            with torch.no_grad():
                t = t + layers[owner].get_delta_weight(ADAPTER).to(t.dtype)
        yield f"{owner}.{leaf}", t.detach()


def base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the frozen base weights (adapter excluded): a checkpoint holds only the adapter, so a
    resume must rebuild the same base, and this says whether it did."""
    from unirl.contracts import fingerprint

    base = model.get_base_model()
    return fingerprint((n, t) for n, t in base.state_dict().items() if ".lora_" not in n)


def write_adapter_dir(path: str, model: torch.nn.Module, tokenizer: Any = None) -> None:
    """peft's ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``) + tokenizer into
    ``path``, atomically: ``PeftModel.from_pretrained(base, path)`` loads it."""
    with staging_dir(path) as tmp:
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
