"""A deterministic synthetic encyclopedia and the multi-hop questions asked about it.

Why synthetic: every entity, attribute and answer is generated from ``seed``, so a model can only answer a
question by looking it up (nothing was in any pre-training text), and a test can check retrieval against
the known documents.

The world: countries (each with a capital city), people (each born in a country, with an occupation and a
friend) and companies (each founded by a person, based in a country). A document per entity, with named
sections (``summary`` first: what a search hit shows). Questions need at least two lookups:

* ``capital_of_birthplace``: "the capital of the country where <person> was born" (person -> country ->
  capital);
* ``birthplace_of_founder``: "the country where the founder of <company> was born" (company -> person ->
  country).

Held-out questions ask about people / companies that no training question names (``split``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

QuestionKind = Literal["capital_of_birthplace", "birthplace_of_founder"]
_CONS, _VOW = "bdfgklmnprstvz", "aeiou"
OCCUPATIONS = ("painter", "sailor", "baker", "poet", "miner", "judge")


class CorpusOptions(BaseModel):
    """``plugins.agentic.search``: the encyclopedia, its questions and the held-out split."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="the world (and so every document and answer) is a function of this seed")
    countries: int = Field(8, ge=2, le=200)
    people: int = Field(400, ge=4, le=20000)
    companies: int = Field(40, ge=0, le=5000)
    questions: list[QuestionKind] = Field(
        default_factory=lambda: ["capital_of_birthplace"], min_length=1,
        description="question templates to ask (capital_of_birthplace, birthplace_of_founder)")
    n_eval: int = Field(32, ge=1, description="held-out questions: about entities no training question names")
    word_tokenizer: bool = Field(
        False, description="`unirl agentic-data` also writes a tokenizer whose tokens are the task's template "
        "words and tool-call syntax (never a generated name: people, companies, countries and capitals stay "
        "letters) to model.tokenizer: a lookup trace is ~2.5x fewer tokens than bytes, and a name is copied "
        "letter by letter as before")


@dataclass(frozen=True)
class Document:
    doc_id: str  # the entity's name, lower case (what ``open`` takes)
    title: str
    kind: str  # country | person | company
    sections: dict[str, str]

    @property
    def text(self) -> str:
        """The whole document as ``open`` returns it: the title, then ``section: text`` lines."""
        return "\n".join([self.title, *(f"{k}: {v}" for k, v in self.sections.items())])


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    kind: str
    subject: str  # the entity the question names (the first lookup)
    hops: tuple[str, ...]  # the doc ids an agent has to read, in order


@dataclass
class Corpus:
    options: CorpusOptions
    docs: dict[str, Document] = field(default_factory=dict)
    born: dict[str, str] = field(default_factory=dict)  # person -> country
    capital: dict[str, str] = field(default_factory=dict)  # country -> capital city
    founder: dict[str, str] = field(default_factory=dict)  # company -> person

    def get(self, doc_id: str) -> Document | None:
        return self.docs.get(doc_id.strip().lower())

    def question(self, kind: str, subject: str) -> Question:
        if kind == "capital_of_birthplace":
            country = self.born[subject]
            return Question(f"the capital of the country where {subject} was born?", self.capital[country],
                            kind, subject, (subject.lower(), country.lower()))
        person = self.founder[subject]
        return Question(f"the country where the founder of {subject} was born?", self.born[person], kind, subject,
                        (subject.lower(), person.lower()))

    def questions(self, split: Literal["train", "eval"]) -> list[Question]:
        """Every question of ``split``. The held-out subjects are a seeded draw of ``n_eval`` (person or
        company) subjects; training questions never name them."""
        subjects = []
        for kind in self.options.questions:
            pool = sorted(self.born) if kind == "capital_of_birthplace" else sorted(self.founder)
            subjects += [(kind, s) for s in pool]
        rng = random.Random(f"{self.options.seed}:split")
        rng.shuffle(subjects)
        n_eval = min(self.options.n_eval, len(subjects) // 4)
        chosen = subjects[:n_eval] if split == "eval" else subjects[n_eval:]
        return [self.question(kind, s) for kind, s in chosen]


def _names(rng: random.Random, n: int, shape: str, taken: set[str]) -> list[str]:
    """``n`` unique pronounceable names of ``shape`` (C = consonant, V = vowel), capitalised."""
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(_CONS if c == "C" else _VOW) for c in shape).capitalize()
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


@lru_cache(maxsize=8)
def _build(options_json: str) -> Corpus:
    o = CorpusOptions.model_validate_json(options_json)
    rng = random.Random(o.seed)
    taken: set[str] = set()
    countries = _names(rng, o.countries, "CVC", taken)
    capitals = _names(rng, o.countries, "CVCV", taken)
    people = _names(rng, o.people, "CVCVC", taken)
    companies = _names(rng, o.companies, "CVCCV", taken)
    c = Corpus(o)
    for country, city in zip(countries, capitals, strict=True):
        c.capital[country] = city
    for person in people:
        c.born[person] = rng.choice(countries)
    for company in companies:
        c.founder[company] = rng.choice(people)
    founded: dict[str, list[str]] = {}
    for company, person in c.founder.items():
        founded.setdefault(person, []).append(company)
    for country, city in c.capital.items():
        natives = sorted(p for p, b in c.born.items() if b == country)
        c.docs[country.lower()] = Document(country.lower(), country, "country", {
            "summary": f"{country} is a country; its capital is {city}.",
            "geography": f"{country} lies between the rivers {rng.choice(capitals)}a and {rng.choice(capitals)}o.",
            "people": f"{len(natives)} notable people were born in {country}.",
        })
    for person in people:
        country = c.born[person]
        friend = rng.choice(people)
        c.docs[person.lower()] = Document(person.lower(), person, "person", {
            "summary": f"{person} was born in {country}.",
            "life": f"{person} worked as a {rng.choice(OCCUPATIONS)} and was a friend of {friend}.",
            "links": ", ".join([country, friend, *founded.get(person, [])]),
        })
    for company, person in c.founder.items():
        c.docs[company.lower()] = Document(company.lower(), company, "company", {
            "summary": f"{company} is a company founded by {person}.",
            "history": f"{company} sold {rng.choice(['lamps', 'boats', 'bread', 'maps'])} for "
                       f"{rng.randint(2, 90)} years.",
            "links": person,
        })
    return c


def build_corpus(options: CorpusOptions | None = None) -> Corpus:
    """The encyclopedia of ``options`` (cached per process: every tool of a run shares one)."""
    return _build((options or CorpusOptions()).model_dump_json())
