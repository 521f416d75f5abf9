"""Bad weight-sync payloads every engine must reject the same way (test support, not a test module).

Every engine stages a sync through :mod:`unirl.weights`, so the same bad payload must raise the same
:class:`~unirl.kernel.errors.WeightSyncError` (same message) on the embedded torch engine, on vLLM and
on any other engine, before a single served tensor changes. The engine tests feed each payload to
their engine's ``load_weights`` and check the weights are byte-identical afterwards.

``good`` is a complete, valid payload for the engine under test: ``(name, tensor)`` pairs in the
engine's names and serving dtype (e.g. its own weights, perturbed). With the tiny tied Qwen3 it holds
no ``lm_head.weight`` (the spec leaves a tied head out).

Test modules run under ``--import-mode=importlib``, so import this file by path::

    import importlib.util, pathlib
    _p = pathlib.Path(__file__).parents[N] / "core/tests/weight_payloads.py"
    _spec = importlib.util.spec_from_file_location("unirl_weight_payloads", _p)
    weight_payloads = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(weight_payloads)
"""

from __future__ import annotations

import re

import torch

EMBED = "model.embed_tokens.weight"
TIED_HEAD = "lm_head.weight"
UNKNOWN = "model.layers.99.mlp.up_proj.weight"


def bad_payloads(good: list[tuple[str, torch.Tensor]]) -> list[tuple[str, list[tuple[str, torch.Tensor]], str]]:
    """``(label, payload, match_regex)`` for each way a payload can be wrong.

    The corrupted tensor is the *last* (or a late) one of the stream where the case allows, so an
    engine that copied tensors as they arrived would already have changed the earlier ones."""
    good = list(good)
    names = [n for n, _ in good]
    if len(set(names)) != len(names):
        raise ValueError("bad_payloads: the good payload itself repeats a name")
    last_name, last = good[-1]
    mat_name = next(n for n, t in reversed(good) if t.dim() == 2)
    float_name = next(n for n, t in reversed(good) if t.is_floating_point())
    q = re.escape

    def replace(target: str, fn) -> list[tuple[str, torch.Tensor]]:
        return [(n, fn(t) if n == target else t) for n, t in good]

    def with_nan(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[t.numel() // 2] = float("nan")
        return t

    wrong_dtype = torch.float16 if last.dtype != torch.float16 else torch.float32
    cases = [
        ("unknown name", [*good, (UNKNOWN, dict(good)[mat_name])],
         rf"unexpected tensor '{q(UNKNOWN)}': the engine's model has no such weight"),
        ("wrong shape", replace(mat_name, lambda t: t[:-1]),
         rf"tensor '{q(mat_name)}' has shape \(.*\), the engine expects"),
        ("wrong dtype", replace(last_name, lambda t: t.to(wrong_dtype)),
         rf"tensor '{q(last_name)}' has dtype {q(str(wrong_dtype))}, the engine serves"),
        ("nan", replace(float_name, with_nan), rf"tensor '{q(float_name)}' has 1 NaN/Inf value"),
        ("missing tensor", good[:-1], rf"sync is missing 1 tensor\(s\): {q(last_name)}"),
        ("duplicate name", [*good, good[0]], rf"tensor '{q(good[0][0])}' .*was sent twice"),
    ]
    if EMBED in names and TIED_HEAD not in names:  # a tied model: the actor untied its head
        head = dict(good)[EMBED] + 1
        cases.append(("untied lm_head", [*good, (TIED_HEAD, head)],
                      rf"ties {q(TIED_HEAD)} to {q(EMBED)}, but the sync sends different values"))
    return cases
