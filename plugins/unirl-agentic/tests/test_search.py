"""The search environment against the real bm25s: the corpus, the index's results on known documents,
the tools' errors on malformed calls, grading, the demonstrations and the dataset files."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

if os.environ.get("CI") != "true" and importlib.util.find_spec("bm25s") is None:  # in CI: a failure, not a skip
    # find_spec, not importorskip: importing bm25s here would load numba with no mask (see search/index.py),
    # and an in-process vLLM engine started later in this process would then crash on llvmlite's wrappers
    pytest.skip("bm25s is not installed", allow_module_level=True)

from unirl_agentic.calls import CallError, parse_calls  # noqa: E402
from unirl_agentic.environment import render_call  # noqa: E402
from unirl_agentic.search.corpus import CorpusOptions, build_corpus  # noqa: E402
from unirl_agentic.search.grading import exact_match, f1, normalize  # noqa: E402
from unirl_agentic.search.index import SearchIndex, search_index  # noqa: E402
from unirl_agentic.search.tools import Open, Search, Visit  # noqa: E402

from unirl.api import Sample, load_kernel  # noqa: E402

OPTS = CorpusOptions(seed=3, countries=5, people=60, companies=10, n_eval=8,
                     questions=["capital_of_birthplace", "birthplace_of_founder"])


@pytest.fixture(scope="module")
def index() -> SearchIndex:
    return search_index(OPTS)


def test_corpus_is_deterministic_and_questions_need_two_lookups():
    a, b = build_corpus(OPTS), build_corpus(CorpusOptions(**OPTS.model_dump()))
    assert a is b or {k: d.text for k, d in a.docs.items()} == {k: d.text for k, d in b.docs.items()}
    other = build_corpus(OPTS.model_copy(update={"seed": 4}))
    assert set(other.docs) != set(a.docs)
    assert len(a.docs) == 5 + 60 + 10
    train, held = a.questions("train"), a.questions("eval")
    assert len(held) == 8 and len(train) == 60 + 10 - 8
    assert not {q.subject for q in train} & {q.subject for q in held}  # held-out subjects are never trained on
    for q in train + held:
        first, second = (a.docs[h] for h in q.hops)
        assert q.subject in first.text and second.title in first.text  # hop 1 names hop 2
        assert q.answer in second.sections["summary"] and q.answer not in first.text  # only hop 2 answers
    kinds = {q.kind for q in train}
    assert kinds == {"capital_of_birthplace", "birthplace_of_founder"}


def test_index_ranks_the_known_document_first(index):
    corpus = index.corpus
    person = sorted(corpus.born)[0]
    country = corpus.born[person]
    hits = index.search(person, 3)
    assert hits[0].doc.doc_id == person.lower()
    assert hits == sorted(hits, key=lambda h: -h.score) and all(h.score > 0 for h in hits)
    (top,) = index.search(f"capital {country}", 1)
    assert top.doc.doc_id == country.lower() and top.doc.kind == "country"
    assert f"its capital is {corpus.capital[country]}" in top.doc.sections["summary"]
    company = sorted(corpus.founder)[0]
    assert index.search(company, 1)[0].doc.doc_id == company.lower()
    assert index.search("zzzzqqq", 5) == []  # no term of the query is in the corpus
    assert len(index.search("born", 4)) == 4


def test_every_question_is_answerable_through_the_index(index):
    """Following the hops with search alone (k=1) answers every question: the task is solvable."""
    corpus = index.corpus
    for q in corpus.questions("train") + corpus.questions("eval"):
        first = index.search(q.subject, 1)[0].doc
        assert first.doc_id == q.hops[0]
        second_title = corpus.docs[q.hops[1]].title
        query = f"capital {second_title}" if q.kind == "capital_of_birthplace" else second_title
        assert index.search(query, 1)[0].doc.doc_id == q.hops[1], q


def test_tools_return_documents_and_sections(index):
    search, open_, visit = Search(index=index), Open(index=index), Visit(index=index)
    person = sorted(index.corpus.born)[1]
    res = search.call({"query": person, "k": 2})
    assert not res.error and res.content.splitlines()[0] == f"[{person.lower()}] {person} was born in " \
        f"{index.corpus.born[person]}."
    doc = open_.call({"doc_id": person.upper()})  # ids are case-insensitive
    assert not doc.error and doc.content.startswith(person + "\nsummary: ") and "\nlife: " in doc.content
    sec = visit.call({"doc_id": person.lower(), "section": "links"})
    assert not sec.error and index.corpus.born[person] in sec.content


@pytest.mark.parametrize("tool,args,needle", [
    ("search", {}, "argument 'query' must be a non-empty string (got missing)"),
    ("search", {"query": 7}, "argument 'query' must be a non-empty string (got int 7)"),
    ("search", {"query": "x", "k": 0}, "argument 'k' must be an integer in 1..10"),
    ("search", {"query": "x", "k": "3"}, "argument 'k' must be an integer"),
    ("search", {"query": "x", "limit": 3}, "unknown argument(s) limit"),
    ("search", {"query": "x" * 500}, "query longer than 200 characters"),
    ("open", {"id": "kel"}, "argument 'doc_id' must be a non-empty string (got missing)"),
    ("open", {"doc_id": "nosuchdoc"}, "no document 'nosuchdoc'"),
    ("visit", {"doc_id": "__person__"}, "argument 'section' must be a non-empty string"),
    ("visit", {"doc_id": "__person__", "section": "history"}, "has no section 'history' (sections: summary, life, links)"),
])
def test_malformed_tool_calls_are_tool_errors_naming_the_problem(index, tool, args, needle):
    person = sorted(index.corpus.born)[0].lower()
    args = {k: (person if v == "__person__" else v) for k, v in args.items()}
    res = {"search": Search, "open": Open, "visit": Visit}[tool](index=index).call(args)
    assert res.error and needle in res.content, res.content


def test_malformed_calls_through_the_environment_are_errors_the_model_sees(tok, index):
    from unirl_agentic.search.environment import SearchEnvironment

    env = SearchEnvironment(tools={"search": Search(index=index), "open": Open(index=index)}, tokenizer=tok)
    s = Sample(id="p0/0", prompt_ids=[1], answer="x")
    env.reset(s)
    try:
        bad_json = env.step(s, '<tool_call>{"name": "search", "arguments": {"query": }</tool_call>')
        assert not bad_json.done and "error: tool call is not valid JSON" in bad_json.observation
        unknown = env.step(s, render_call("browse", {"url": "x"}))
        assert "error: unknown tool 'browse' (tools: open, search)" in unknown.observation
        missing = env.step(s, render_call("open", {}))
        assert "error: open: argument 'doc_id' must be a non-empty string" in missing.observation
        assert s.meta["tool_errors"] == 3 and s.meta["tool_calls"] == 3
    finally:
        env.close(s)
    assert isinstance(parse_calls("<tool_call>{}")[0], CallError)


def test_grading_exact_match_and_f1():
    s = Sample(id="p0", prompt_ids=[1], answer="Tufi")
    assert exact_match(" Tufi", s) == 1.0 and exact_match("the tufi.\nmore", s) == 1.0
    assert exact_match("Tufu", s) == 0.0 and exact_match("", s) == 0.0
    two = Sample(id="p1", prompt_ids=[1], answer="Kel Mora")
    assert f1("Kel", two) == pytest.approx(2 / 3) and f1("kel mora", two) == 1.0 and f1("zed", two) == 0.0
    assert normalize("  The  Tufi! ") == "tufi"
    with pytest.raises(ValueError, match="must be a non-empty string"):
        exact_match.parse_gold("")


def test_demonstrations_are_real_lookups_with_masked_results(tok, tmp_path):
    from unirl_agentic.search.environment import SearchEnvironment, prompt_text

    from unirl.api import load_config

    config = load_config(None, ["plugins.agentic.search.seed=3", "plugins.agentic.search.people=60",
                                "plugins.agentic.search.countries=5", "plugins.agentic.search.n_eval=8",
                                "plugins.agentic.tools.search.k=1"])
    env = SearchEnvironment(config=config, tokenizer=tok)
    q = env.corpus.questions("train")[0]
    p = Sample(id="p0", prompt_ids=tok.encode(prompt_text(q)), prompt_text=prompt_text(q), answer=q.answer)
    s = env.demonstration(p, tok, expert=True)
    s.validate()
    assert [g.kind for g in s.segments] == ["model", "observation", "model", "observation", "model"]
    turns = [tok.decode(s.response_ids[g.start:g.end], skip_special_tokens=True) for g in s.segments]
    (call1,), (call2,) = parse_calls(turns[0]), parse_calls(turns[2])
    assert call1.arguments == {"query": q.subject} and q.hops[1] in turns[1].lower()
    assert call2.arguments == {"query": f"capital {env.corpus.docs[q.hops[1]].title}"}
    assert f"its capital is {q.answer}" in turns[3]
    assert turns[4] == q.answer and s.response_ids[-1] == tok.eos_token_id
    for g in s.segments:
        assert set(s.loss_mask[g.start:g.end]) == ({0} if g.kind == "observation" else {1})
    unaided = env.demonstration(p, tok, expert=False)
    assert [g.kind for g in unaided.segments] == ["model"] and unaided.response_text.strip() == q.answer

    from unirl_agentic.search.environment import write_dataset

    train, held = write_dataset(config, tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert rows[0] == {"prompt": prompt_text(q), "answer": q.answer}
    assert len(held.read_text().splitlines()) == 8
    assert write_dataset(config, tmp_path / "again")[0].read_bytes() == train.read_bytes()  # deterministic


def test_word_tokenizer_keeps_names_as_letters_copied_as_the_same_tokens(tmp_path):
    """``search.word_tokenizer``: agentic-data writes it to ``model.tokenizer``; the task's words are one
    token each, no person's name is in the vocabulary (held-out names tokenize like training ones), the name
    in the question and in the expert's call are the same tokens, and a lookup trace is under half its
    bytes. Without ``model.tokenizer`` it is an error naming both fields, in agentic-data and in preflight."""
    from unirl_agentic.plugin import unirl_preflight
    from unirl_agentic.search.environment import SearchEnvironment, prompt_text, task_words, write_dataset

    from unirl.api import build_demo_tokenizer, load_config, load_tokenizer

    base = ["plugins.agentic.search.seed=3", "plugins.agentic.search.people=60", "plugins.agentic.search.countries=5",
            "plugins.agentic.search.n_eval=8", "plugins.agentic.tools.search.k=1", "rollout.environment=search",
            "rollout.controller=agentic", "rollout.tools=[search]", "plugins.agentic.search.word_tokenizer=true",
            f"data.source={tmp_path / 'train.jsonl'}", f"data.eval_source={tmp_path / 'eval.jsonl'}"]
    unset = load_config(None, base)
    with pytest.raises(ValueError, match=r"search\.word_tokenizer.*model\.tokenizer"):
        write_dataset(unset)
    assert any(v.field == "plugins.agentic.search.word_tokenizer" for v in unirl_preflight(config=unset, kernel=load_kernel()))
    config = load_config(None, [*base, f"model.tokenizer={tmp_path / 'tok'}"])
    write_dataset(config)
    tok = load_tokenizer(tmp_path / "tok")
    env = SearchEnvironment(config=config, tokenizer=tok)
    corpus = env.corpus
    words = task_words(corpus)
    assert {"capital", "country", "born", "query", '":"'} <= set(words)
    assert not {p.lower() for p in corpus.born} & set(tok.get_vocab())
    assert [w for w in words if len(tok.encode(w, add_special_tokens=False)) != 1] == []
    q = env.corpus.questions("train")[0]
    p = Sample(id="p0", prompt_ids=tok.encode(prompt_text(q)), prompt_text=prompt_text(q), answer=q.answer)
    s = env.demonstration(p, tok, expert=True)
    name = tok.encode(q.subject, add_special_tokens=False)
    first_call = s.response_ids[s.segments[0].start:s.segments[0].end]

    def holds(seq, part):
        return any(list(seq[i:i + len(part)]) == part for i in range(len(seq) - len(part) + 1))

    assert holds(p.prompt_ids, name) and holds(first_call, name)
    text = tok.decode(list(p.prompt_ids) + list(s.response_ids), skip_special_tokens=True)
    assert len(p.prompt_ids) + len(s.response_ids) < 0.5 * len(build_demo_tokenizer().encode(text))
