"""An exact fast path for the openai SDK's request transform of ``chat.completions.create``.

Why: the agents' own ``openai`` client dominated the endpoint's per-turn cost. Profiled on the overhead
benchmark (py-spy, 16-token turns, 2026-12-07), ~34 % of the agents' loop thread was the SDK's
``async_maybe_transform``: before every request it walks the whole message list against the params'
type graph (each message against all six message TypedDicts of the union), to rename aliased keys,
format dates / base64 files and dump pydantic models. The chat-completion params have no aliased key
and no formatted field, so for plain JSON input that walk only copies the dicts and drops the top
level's omitted arguments.

:func:`install` replaces the name ``async_maybe_transform`` in the SDK's chat-completions module with
:func:`fast_async_maybe_transform`, which returns that result directly when it provably equals the
SDK's: the data is plain JSON (dicts with str keys, lists, str/int/float/bool/None; only the top level
may hold omitted values) **and** no ``PropertyInfo`` with an alias or a format is reachable from the
expected type (walked once per type, cached). Anything else (pydantic models, tuples, generators, dates,
files, another SDK's types) goes to the SDK's own transform unchanged. The patch is checked before it
is made (the module's name must still be the SDK's function), so an SDK that moved it is left alone.
``test_sdk_fastpath.py`` compares both paths on the shapes agents send.

:func:`prime_platform` is the other per-agent cost found there (~11 % of that loop): each new
``AsyncOpenAI`` runs ``get_platform()`` on a worker thread (``asyncify``) before its first request, and
every trajectory gets a new client (its own session key). The answer is the process's, so it is computed
once and handed to each new client, which then skips the thread hop.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

_JSON_SCALARS = (str, int, float, bool, type(None))
_alias_free_cache: dict[Any, bool] = {}
_original: Any = None
_platform: Any = None


def _plain(value: Any, depth: int = 0) -> bool:
    """Plain JSON: exactly the types the SDK's transform passes through unchanged (no subclasses)."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if depth > 64:
        return False
    if kind is list:
        return all(_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


def alias_free(expected_type: Any) -> bool:
    """Whether no ``PropertyInfo`` that renames a key or formats a value is reachable from the type."""
    hit = _alias_free_cache.get(expected_type)
    if hit is None:
        hit = _alias_free_cache[expected_type] = _walk(expected_type, set())
    return hit


def _walk(tp: Any, seen: set[int]) -> bool:
    from openai._compat import is_typeddict
    from openai._utils._transform import PropertyInfo, get_type_hints

    if id(tp) in seen:
        return True
    seen.add(id(tp))
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return True  # Literal's arguments are values, not types
    if origin is typing.Annotated:
        meta = tp.__metadata__
        if any(isinstance(m, PropertyInfo) and (m.alias is not None or m.format is not None) for m in meta):
            return False
        return _walk(tp.__origin__, seen)
    if is_typeddict(tp):  # the SDK's test (its TypedDicts are typing_extensions')
        try:
            hints = get_type_hints(tp, include_extras=True)
        except Exception:  # noqa: BLE001 - an unresolvable forward reference: not provably alias-free
            return False
        return all(_walk(h, seen) for h in hints.values())
    if origin is not None or isinstance(tp, types.UnionType):
        return all(_walk(a, seen) for a in typing.get_args(tp))
    return isinstance(tp, type) and not _is_pydantic(tp)


def _is_pydantic(tp: type) -> bool:
    import pydantic

    return issubclass(tp, pydantic.BaseModel)


async def fast_async_maybe_transform(data: object, expected_type: object) -> Any:
    """The SDK's ``async_maybe_transform``, without its walk where the result is known (module doc)."""
    from openai._utils import is_given

    if isinstance(data, Mapping) and type(data) is dict and alias_free(expected_type):
        given = {k: v for k, v in data.items() if is_given(v)}
        if _plain(given):
            return given
    return await _original(data, expected_type)


def install() -> bool:
    """Put the fast path in front of the SDK's chat-completions transform; False (and nothing patched)
    when the SDK's module no longer has the function this replaces. Idempotent."""
    global _original
    from openai._utils import _transform
    from openai.resources.chat.completions import completions

    current = getattr(completions, "async_maybe_transform", None)
    if current is fast_async_maybe_transform:
        return True
    if current is not _transform.async_maybe_transform:
        return False
    _original = current
    completions.async_maybe_transform = fast_async_maybe_transform
    return True


def prime_platform(client: Any) -> None:
    """Give a new client the process's ``get_platform()`` answer (what its first request would compute on
    a worker thread; the headers it sends are the same). Left alone when the SDK has no such slot."""
    global _platform
    from openai import _base_client

    if getattr(client, "_platform", False) is not None or not callable(getattr(_base_client, "get_platform", None)):
        return
    if _platform is None:
        _platform = _base_client.get_platform()
    client._platform = _platform
