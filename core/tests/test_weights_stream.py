"""A streamed sync's building blocks (unirl.weights): the incremental fingerprint and a Staged that keeps nothing.

The vLLM engine streams a sync bucket by bucket (plugins/unirl-vllm, issue 65): sender and receivers fold
each tensor into a :class:`Fingerprint` as it passes, and a ``Staged(keep=False)`` checks each tensor without
holding it. Both must give exactly what the whole-list forms give, or receipts would stop matching.
"""

from __future__ import annotations

import pytest
import torch

from unirl.contracts import fingerprint
from unirl.kernel.errors import WeightSyncError
from unirl.weights import EMBED, TIED_HEAD, Fingerprint, Staged, WeightSpec


def _payload() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(16, 8, generator=g)
    return [
        (EMBED, embed),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(12, 8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
        (TIED_HEAD, embed.clone()),
    ]


def _spec() -> WeightSpec:
    return WeightSpec(shapes={n: tuple(t.shape) for n, t in _payload() if n != TIED_HEAD}, dtype="torch.float32",
                      tied_head=True)


def test_incremental_fingerprint_equals_the_whole_list():
    tensors = _payload() + [("odd", torch.arange(12, dtype=torch.int64).view(3, 4).t()),  # not contiguous
                            ("half", torch.ones(5, dtype=torch.bfloat16))]
    f = Fingerprint()
    for name, t in tensors:
        f.update(name, t)
    assert f.hexdigest() == fingerprint(tensors) and f.count == len(tensors)
    g = Fingerprint()
    for name, t in reversed(tensors):
        g.update(name, t)
    assert g.hexdigest() != f.hexdigest()  # order is part of it


def test_staged_without_keep_checks_the_same_and_holds_nothing():
    kept, streamed = Staged(spec=_spec()), Staged(spec=_spec(), keep=False)
    for name, t in _payload():
        a, b = kept.add(name, t), streamed.add(name, t)
        assert torch.equal(a[1], b[1]) and a[1].data_ptr() != t.data_ptr()  # a checked copy is handed back
    assert streamed.tensors == [] and len(kept.tensors) == 4
    assert streamed.finish() == kept.finish()


def test_staged_without_keep_refuses_what_the_kept_form_refuses():
    missing = Staged(spec=_spec(), keep=False)
    for name, t in _payload()[:2]:
        missing.add(name, t)
    with pytest.raises(WeightSyncError, match="missing 1 tensor"):
        missing.finish()
    untied = Staged(spec=_spec(), keep=False)
    for name, t in _payload():
        untied.add(name, t + 1 if name == TIED_HEAD else t)
    with pytest.raises(WeightSyncError, match="untied"):
        untied.finish()
    nan = Staged(spec=_spec(), keep=False)
    with pytest.raises(WeightSyncError, match="NaN"):
        nan.add(EMBED, torch.full((16, 8), float("nan")))
