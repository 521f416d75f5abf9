"""Deep research in miniature: a synthetic encyclopedia (:mod:`.corpus`), a BM25 index over it
(:mod:`.index`, real ``bm25s``), the ``search`` / ``open`` / ``visit`` tools (:mod:`.tools`), the ``search``
environment with its demonstration traces (:mod:`.environment`) and exact-match / F1 grading
(:mod:`.grading`). Everything is generated from a seed, so no answer can have been memorised."""
