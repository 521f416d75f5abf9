"""The research tools: ``search(query, k)``, ``open(doc_id)`` and ``visit(doc_id, section)``.

A bad call (a missing or mistyped argument, an unknown document or section) is a tool *error* the model
sees (``ToolResult(error=True)``) naming the argument and what would be valid, so the model can learn to
call correctly; it is never a failure of the trajectory. All three read one shared index, built once per
process from ``plugins.agentic.search`` (the corpus options)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import Tool, ToolResult
from unirl_agentic.options import agentic_options, tool_options
from unirl_agentic.search.corpus import CorpusOptions
from unirl_agentic.search.index import SearchIndex, search_index


class SearchToolOptions(BaseModel):
    """``plugins.agentic.tools.search``."""

    model_config = ConfigDict(extra="forbid")

    k: int = Field(3, ge=1, le=50, description="hits returned when the call gives no k")
    max_k: int = Field(10, ge=1, le=50, description="largest k a call may ask for")
    max_query_chars: int = Field(200, ge=1)


class _ReadOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


def corpus_options(config: Any) -> CorpusOptions:
    """``plugins.agentic.search`` (from the kernel-validated section) as the corpus options."""
    return CorpusOptions.model_validate(agentic_options(config).search if config else {})


def _string_arg(tool: str, arguments: dict[str, Any], key: str, example: str) -> str | ToolResult:
    value = arguments.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in arguments else f"{type(value).__name__} {value!r}"[:60]
        return ToolResult(f"{tool}: argument {key!r} must be a non-empty string (got {got}); "
                          f"call it as {example}", error=True)
    return value


class _CorpusTool(Tool):
    def __init__(self, *, config: Any = None, index: SearchIndex | None = None, options: Any = None):
        self.index = index if index is not None else search_index(corpus_options(config))
        opts = options if options is not None else tool_options(config, self.name)
        self.options = opts if isinstance(opts, BaseModel) else self.Config.model_validate(opts or {})

    def _doc(self, arguments: dict[str, Any], example: str):
        doc_id = _string_arg(self.name, arguments, "doc_id", example)
        if isinstance(doc_id, ToolResult):
            return doc_id
        doc = self.index.corpus.get(doc_id)
        if doc is None:
            hits = self.index.search(doc_id, 3)
            near = ", ".join(h.doc.doc_id for h in hits) or "none"
            return ToolResult(f"{self.name}: no document {doc_id!r} (doc ids come from search results; "
                              f"closest: {near})", error=True)
        return doc


class Search(_CorpusTool):
    """``{"query": "Zuviv", "k": 2}`` -> one line per hit: ``[doc_id] summary``."""

    name: ClassVar[str] = "search"
    description: ClassVar[str] = "Search the encyclopedia: {query: str, k: int} -> the top k documents."
    Config = SearchToolOptions

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        example = '{"name": "search", "arguments": {"query": "<words>", "k": 3}}'
        query = _string_arg(self.name, arguments, "query", example)
        if isinstance(query, ToolResult):
            return query
        if len(query) > self.options.max_query_chars:
            return ToolResult(f"search: query longer than {self.options.max_query_chars} characters", error=True)
        k = arguments.get("k", self.options.k)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.options.max_k:
            return ToolResult(f"search: argument 'k' must be an integer in 1..{self.options.max_k} (got {k!r})",
                              error=True)
        unknown = sorted(set(arguments) - {"query", "k"})
        if unknown:
            return ToolResult(f"search: unknown argument(s) {', '.join(unknown)} (search takes query and k)",
                              error=True)
        hits = self.index.search(query, k)
        if not hits:
            return ToolResult(f"no results for {query!r}")
        return ToolResult("\n".join(f"[{h.doc.doc_id}] {h.doc.sections['summary']}" for h in hits))


class Open(_CorpusTool):
    """``{"doc_id": "zov"}`` -> the whole document."""

    name: ClassVar[str] = "open"
    description: ClassVar[str] = "Read a whole document: {doc_id: str}."
    Config = _ReadOptions

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        doc = self._doc(arguments, '{"name": "open", "arguments": {"doc_id": "<id from search>"}}')
        return doc if isinstance(doc, ToolResult) else ToolResult(doc.text)


class Visit(_CorpusTool):
    """``{"doc_id": "zov", "section": "summary"}`` -> one section of a document."""

    name: ClassVar[str] = "visit"
    description: ClassVar[str] = "Read one section of a document: {doc_id: str, section: str}."
    Config = _ReadOptions

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        example = '{"name": "visit", "arguments": {"doc_id": "<id>", "section": "summary"}}'
        doc = self._doc(arguments, example)
        if isinstance(doc, ToolResult):
            return doc
        section = _string_arg(self.name, arguments, "section", example)
        if isinstance(section, ToolResult):
            return section
        text = doc.sections.get(section.strip().lower())
        if text is None:
            return ToolResult(f"visit: {doc.doc_id} has no section {section!r} (sections: "
                              f"{', '.join(doc.sections)})", error=True)
        return ToolResult(text)
