"""``search``: ``tool_env`` over the research tools, plus what the task adds: its demonstrations (the
SFT warm start's traces) and its dataset files.

The protocol is ``tool_env``'s (Qwen3-style ``<tool_call>`` turns, a turn with no call is the answer,
graded by ``reward.name``: ``exact_match`` or ``f1``). A demonstration is built exactly as a rollout builds a
trajectory, with the *real* tools' outputs as its tool turns (loss mask 0): an expert trace looks the
subject up, then the linked document, then answers; a non-expert one answers at once (unaided it can
only guess, which is what RL then learns to stop doing).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from unirl.api import Sample, Tool, build_demo_tokenizer
from unirl_agentic.environment import FORMATS, ToolEnvironment, render_call
from unirl_agentic.options import AgenticOptions
from unirl_agentic.search.corpus import Corpus, Question
from unirl_agentic.search.tools import Search, corpus_options
from unirl_agentic.word_tokenizer import tokenizer_dir

PROMPT = "Q: {question} A:"


def prompt_text(question: Question) -> str:
    return PROMPT.format(question=question.text)


class SearchEnvironment(ToolEnvironment):
    """``tool_env`` whose tools default to ``search`` (and whatever ``rollout.tools`` lists)."""

    def __init__(self, *, config: Any = None, tools: dict[str, Tool] | None = None, tokenizer: Any = None,
                 options: AgenticOptions | None = None):
        tools = dict(tools or {})
        if "search" not in tools:
            tools["search"] = Search(config=config)
        super().__init__(config=config, tools=tools, tokenizer=tokenizer, options=options)
        self.search = tools["search"]
        self.corpus: Corpus = self.search.index.corpus
        self._questions = {prompt_text(q): q for split in ("train", "eval") for q in self.corpus.questions(split)}

    def question(self, prompt: Sample) -> Question:
        q = self._questions.get(prompt.prompt_text.strip())
        if q is None:
            raise ValueError(f"search: prompt {prompt.id} ({prompt.prompt_text[:60]!r}) is not a question of this "
                             "corpus; fix: write the data with `unirl agentic-data RECIPE` using the same "
                             "plugins.agentic.search options")
        return q

    def demonstration(self, prompt: Sample, tokenizer: Any, *, expert: bool) -> Sample:
        """One SFT trace (see the module doc)."""
        s = prompt.child(0)
        eos = tokenizer.eos_token_id
        if expert:
            q = self.question(prompt)
            second = self.corpus.docs[q.hops[1]].title
            queries = [q.subject, f"capital {second}" if q.kind == "capital_of_birthplace" else second]
            for i, query in enumerate(queries):
                call = (" " if i == 0 else "") + render_call("search", {"query": query})
                ids = tokenizer.encode(call, add_special_tokens=False)
                s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", text=call, role="tool_call")
                obs = self.template.format(content=self.search.call({"query": query}).content)
                s.append_observation(tokenizer.encode(obs, add_special_tokens=False), text=obs)
            text = q.answer
        else:
            text = f" {prompt.answer}"
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        s.append_model_turn(ids, [-1.0] * len(ids), 0, "stop", text=text)
        return s


def task_words(corpus: Corpus) -> list[str]:
    """The template words (``tool_call`` is one) and punctuation runs of every document, question and
    tool call, as the text writes them in lower case. A word the text only ever writes capitalised is a
    generated name (a person, company, country, capital or river) and is left out: names stay letters
    (``unirl.api.build_demo_tokenizer(words=)``), the same tokens in the text and in the call or answer
    that copies them, and a held-out name is as many known tokens as a training one. Why every name:
    with bytes, each expert trace copies three names letter by letter (the person, the country, the
    capital) and the warm start learns the copy in ~400 steps; with the countries and capitals as words
    only the person's name was letters, and the copy came at ~1,400 steps (2 of 3 seeds failed at 1000)."""
    texts = [d.text for d in corpus.docs.values()]
    texts += [prompt_text(q) for split in ("train", "eval") for q in corpus.questions(split)]
    texts += [t.format(content=render_call(tool, {"query": "q", "k": 1, "doc_id": "d", "section": "s"}))
              for t in FORMATS.values() for tool in ("search", "open", "visit")]
    found = {w for t in texts for w in re.findall(r"[A-Za-z_]+|[^\sA-Za-z0-9_]+", t)}
    return sorted(w for w in found if not w[0].isupper())


def write_dataset(config: Any, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The train and held-out questions as ``.jsonl`` (``prompt``, ``answer``): at ``data.source`` /
    ``data.eval_source``, or in ``out_dir``; with ``word_tokenizer``, the tokenizer at ``model.tokenizer``.
    Deterministic: the same options write the same bytes."""
    from unirl_agentic.search.corpus import build_corpus

    options = corpus_options(config)
    corpus = build_corpus(options)
    if options.word_tokenizer:
        build_demo_tokenizer(tokenizer_dir(config, "search"), words=task_words(corpus))
    if out_dir is not None:
        paths = (Path(out_dir) / "train.jsonl", Path(out_dir) / "eval.jsonl")
    else:
        paths = (Path(config.data.source), Path(config.data.eval_source))
    for path, split in zip(paths, ("train", "eval"), strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [json.dumps({"prompt": prompt_text(q), "answer": q.answer}) for q in corpus.questions(split)]
        path.write_text("\n".join(rows) + "\n")
    return paths
