"""What a weight sync must deliver, and the checks run on it *before* the engine is touched.

Every engine (embedded torch, vLLM, SGLang) stages a sync through this module, so the same bad payload
is rejected with the same :class:`~unirl.kernel.errors.WeightSyncError` whichever engine serves. An
engine builds its :class:`WeightSpec` once (from its model, or from the checkpoint it was started
from), hands out an empty :class:`Staged` from ``RolloutEngine.stage()``, and loads a staged set only
after :meth:`Staged.finish` passed.

Why so strict: a bad in-place reload bricks a running vLLM engine (platform note: a shape mismatch raised mid-reload
left every later call failing with "Tensor on device cpu is not on the expected device meta"), and
one extra row was accepted silently and served wrong output. So every tensor is checked against the
checkpoint the engine was started from (names and shapes from the safetensors headers, dtype from the
engine) and for NaN/Inf while it is staged, and the set is checked for completeness, all before the
first byte reaches the model.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unirl.kernel.errors import SyncRefusedError, WeightSyncError

if TYPE_CHECKING:  # pragma: no cover
    import torch

TIED_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


__all__ = ["EMBED", "TIED_HEAD", "Fingerprint", "Staged", "SyncRefusedError", "WeightSpec", "WeightSyncError",
           "stage_all"]


class Fingerprint:
    """:func:`unirl.contracts.fingerprint` fed one tensor at a time: the same digest, byte for byte.

    Why: a streamed sync never holds the whole set, on either side, so sender and receiver fold each
    tensor in as it passes (a receiver across several calls of one session) instead of hashing a list."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        t = tensor.detach().contiguous().cpu()
        self._h.update(name.encode())
        self._h.update(str(tuple(t.shape)).encode())
        self._h.update(str(t.dtype).encode())
        self._h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself: no bytes copy
        self.count += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@dataclass(frozen=True)
class WeightSpec:
    """The tensors an engine expects, in checkpoint (HF) names."""

    shapes: dict[str, tuple[int, ...]]
    dtype: str  # e.g. "torch.float32": the engine's serving dtype
    tied_head: bool = False  # lm_head.weight may be sent (must equal the embedding) or left out

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, dtype: str) -> WeightSpec:
        """Read names and shapes from the safetensors headers (no tensor data is read)."""
        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"{model_dir} has no *.safetensors file to take the weight spec from")
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        tied = False
        cfg = Path(model_dir, "config.json")
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            tied = bool(data.get("tie_word_embeddings", False)) or bool(
                data.get("text_config", {}).get("tie_word_embeddings", False)
            )
        if TIED_HEAD not in shapes and EMBED in shapes:
            tied = True  # a checkpoint that omits the head ties it (what save_pretrained writes)
        return cls(shapes=shapes, dtype=_dtype_str(dtype), tied_head=tied and TIED_HEAD not in shapes)

    @classmethod
    def from_model(cls, model: Any) -> WeightSpec:
        """Names and shapes of a live ``torch.nn.Module``'s state dict, each storage once.

        A weight tied to an earlier one (``lm_head.weight`` sharing the embedding) is left out and
        marked tied, exactly as ``save_pretrained`` writes a checkpoint, so a spec from a model equals
        the spec from that model's checkpoint."""
        shapes: dict[str, tuple[int, ...]] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        tied = False
        dtype = None
        for name, t in model.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape))
            if t.numel() and key in seen:
                tied = tied or name == TIED_HEAD
                continue
            seen.add(key)
            shapes[name] = tuple(t.shape)
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
        return cls(shapes=shapes, dtype=_dtype_str(dtype), tied_head=tied)

    # ------------------------------------------------------------------ checks
    def check_one(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        """Name, shape and dtype of one tensor; raises with what was expected."""
        expected = self.shapes.get(name)
        if expected is None and self.tied_head and name == TIED_HEAD:
            expected = self.shapes.get(EMBED)
        if expected is None:
            close = difflib.get_close_matches(name, list(self.shapes), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise WeightSyncError(
                f"unexpected tensor '{name}': the engine's model has no such weight.{hint} "
                "(Is the model adapter's engine_weight_name mapping right?)"
            )
        if tuple(shape) != tuple(expected):
            raise WeightSyncError(f"tensor '{name}' has shape {tuple(shape)}, the engine expects {tuple(expected)}")
        if _dtype_str(dtype) != self.dtype:
            raise WeightSyncError(
                f"tensor '{name}' has dtype {_dtype_str(dtype)}, the engine serves {self.dtype} "
                "(cast before sending; the vllm weight sync does)"
            )

    def check_manifest(self, manifest: Iterable[tuple[str, tuple[int, ...], str]],
                       kept: Collection[str] = ()) -> None:
        """Every tensor valid, none twice, none missing but those ``kept``: declared held by the engine
        from an earlier sync and unchanged since (a frozen part, :mod:`unirl.sync.held`)."""
        seen: set[str] = set()
        for name, shape, dtype in manifest:
            if name in seen:
                raise WeightSyncError(f"tensor '{name}' was sent twice in one sync")
            seen.add(name)
            self.check_one(name, tuple(shape), dtype)
        missing = sorted(set(self.shapes) - seen - set(kept))
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightSyncError(
                f"sync is missing {len(missing)} tensor(s): {', '.join(missing[:5])}{more}. A sync must carry "
                "the full model: a partial in-place reload leaves fused layers half-updated."
            )


def weight_buckets(tensors: Iterable[tuple[str, Any]], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """Split ``(name, tensor)`` pairs, in order, into lists of at most ``limit`` bytes each (a tensor
    larger than ``limit`` is a bucket of its own). Why: a sync ships a model in bounded pieces so peak
    extra memory on either side is one bucket, not a second copy of the model."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def stage_all(spec: WeightSpec, named: Iterable[tuple[str, torch.Tensor]],
              rename: Callable[[str], str] = lambda n: n,
              expand: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None) -> Staged:
    """Stage a whole iterable and check it complete (for callers holding a plain list)."""
    staged = Staged(spec=spec, rename=rename, expand=expand)
    for name, tensor in named:
        staged.add_all(name, tensor)
    return staged


def _dtype_str(dtype: Any) -> str:
    text = str(dtype)
    return text if text.startswith("torch.") else f"torch.{text}"


@dataclass
class Staged:
    """Validated, engine-named tensors of one sync, held until the engine loads them in one session.

    Staging costs one host copy of the model; it is what makes "validate before touching" possible
    for a streamed (bucketed) source. With ``keep=False`` the staged copies are not held: an engine that
    loads each tensor as it passes (and can put its previous weights back when a later tensor fails)
    streams a sync through the same checks in memory bounded by what it holds at once; :meth:`finish`
    then checks completeness from the names and shapes seen, and the tied head by digest.
    """

    spec: WeightSpec
    rename: Callable[[str], str] = lambda n: n
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    closed: bool = False
    fingerprint: str | None = None  # the sender's, when it fingerprinted the stream through tap()
    #: one actor tensor -> the engine's tensors (``ModelAdapter.engine_weights``); None: ``rename`` only
    expand: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]] | None = None
    #: False: staged pairs are handed back by add() and not held in ``tensors`` (a streamed sync)
    keep: bool = True
    #: engine names this sync leaves out on purpose: the engine holds them unchanged (:meth:`leave_out`)
    kept: frozenset[str] = frozenset()
    _manifest: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    _tied_digests: dict[str, str] = field(default_factory=dict)

    def leave_out(self, unchanged: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
        """Declare the actor tensors ``unchanged`` (actor name -> full shape) as left out of this sync,
        mapped to engine names through ``rename`` / ``expand`` (on meta tensors: no data is touched);
        :meth:`finish` then accepts their absence. Each engine name must be one the engine has, so a
        wrong mapping fails here, not as a silently stale weight. Returns the engine names."""
        import torch

        names: set[str] = set()
        for name, shape in unchanged.items():
            meta = torch.empty(shape, device="meta")
            pairs = self.expand(name, meta) if self.expand is not None else [(name, meta)]
            for wire, t in pairs:
                wire = self.rename(wire)
                self.spec.check_one(wire, tuple(t.shape), self.spec.dtype)
                names.add(wire)
        self.kept = frozenset(names)
        return self.kept

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Rename, check and copy one tensor; returns the (engine name, staged tensor) pair."""
        import torch

        if self.closed:
            raise WeightSyncError("this staged sync was already loaded; stage a new one")
        wire = self.rename(name)
        if wire in self.kept:
            raise WeightSyncError(f"tensor '{wire}' was declared kept (unchanged) but sent in the same sync")
        if wire in self._names:
            raise WeightSyncError(f"tensor '{wire}' (from '{name}') was sent twice in one sync")
        self.spec.check_one(wire, tuple(tensor.shape), str(tensor.dtype))
        staged = tensor.detach().to("cpu", copy=True).contiguous()
        # Any NaN/Inf makes the sum non-finite; the sum is one cheap pass, the exact count runs only then.
        if staged.is_floating_point() and not bool(torch.isfinite(staged.sum(dtype=torch.float64))):
            bad = int((~torch.isfinite(staged)).sum())
            if bad:
                raise WeightSyncError(f"tensor '{wire}' has {bad} NaN/Inf value(s); refusing to load it")
        self._names.add(wire)
        self._manifest.append((wire, tuple(staged.shape), str(staged.dtype)))
        if self.keep:
            self.tensors.append((wire, staged))
        elif self.spec.tied_head and wire in (TIED_HEAD, EMBED):
            digest = Fingerprint()
            digest.update("", staged)
            self._tied_digests[wire] = digest.hexdigest()
        return wire, staged

    def add_all(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """:meth:`add` each engine tensor ``expand`` makes of one actor tensor (just ``tensor`` without it)."""
        pairs = self.expand(name, tensor) if self.expand is not None else [(name, tensor)]
        return [self.add(n, t) for n, t in pairs]

    def tap(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Stage each tensor as it streams past and yield the staged pair (for a sender's fingerprint)."""
        for name, tensor in named:
            yield from self.add_all(name, tensor)

    def finish(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Check completeness and the tied head; return the manifest (name, shape, dtype) in order."""
        manifest = list(self._manifest)
        self.spec.check_manifest(manifest, self.kept)
        if TIED_HEAD in self._names and self.spec.tied_head:
            import torch

            if self.keep:
                head = next(t for n, t in self.tensors if n == TIED_HEAD)
                embed = next(t for n, t in self.tensors if n == EMBED)
                same = torch.equal(head, embed)
            else:
                same = self._tied_digests.get(TIED_HEAD) == self._tied_digests.get(EMBED)
            if not same:
                raise WeightSyncError(
                    f"the engine's model ties {TIED_HEAD} to {EMBED}, but the sync sends different values: "
                    "the actor untied them"
                )
        return manifest
