"""A deterministic benchmark of confusable documents, for answer accuracy (issue 11).

Two task shapes, generated from a seed (no download, the same on every machine):
- `fact`: short documents (~80-110 tokens) of six kinds (bridges, ships, festivals, lakes,
  companies, observatories). Every document states four facts (a year, a number, a person, a count)
  in the SAME sentence templates as the other documents of its kind, around filler sentences shared
  by all of them; only the entity and the values differ. One question per document asks one fact.
- `prose`: a longer report (~200 tokens) with one fact (an altitude) in the middle of shared prose.

An answer is right when it contains the expected fact (a whole number or a surname). Not here:
building the corpus or running the model (bench/fidelity.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rag_promptcache.rag.fidelity import answer_contains
from rag_promptcache.rag.sample import SampleDocument

SEED = 11
PER_KIND = 6

# kind: (noun, [(fact, sentence, question)]); {n}: entity name, {v}: the value
KINDS: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "bridge": ("bridge", (
        ("year", "The {n} bridge was opened in {v}.", "In which year was the {n} bridge opened?"),
        ("number", "Its main span is {v} metres long.", "How long, in metres, is the main span of the {n} bridge?"),
        ("person", "It was designed by the engineer {v}.", "Which engineer designed the {n} bridge?"),
        ("count", "The {n} bridge rests on {v} stone pillars.", "On how many stone pillars does the {n} bridge rest?"),
    )),
    "ship": ("ship", (
        ("year", "The research ship {n} was launched in {v}.", "In which year was the research ship {n} launched?"),
        ("number", "The {n} is {v} metres long.", "How long, in metres, is the research ship {n}?"),
        ("person", "Its first captain was {v}.", "Who was the first captain of the research ship {n}?"),
        ("count", "The {n} carries a crew of {v} sailors.", "How many sailors does the research ship {n} carry?"),
    )),
    "festival": ("festival", (
        ("year", "The {n} festival was first held in {v}.", "In which year was the {n} festival first held?"),
        ("number", "Its main stage seats {v} people.", "How many people does the main stage of the {n} festival seat?"),
        ("person", "It was founded by the musician {v}.", "Which musician founded the {n} festival?"),
        ("count", "The {n} festival lasts {v} days.", "How many days does the {n} festival last?"),
    )),
    "lake": ("lake", (
        ("year", "Lake {n} was first mapped in {v}.", "In which year was Lake {n} first mapped?"),
        ("number", "Lake {n} is {v} metres deep at its deepest point.", "How deep, in metres, is Lake {n}?"),
        ("person", "It was first surveyed by the geographer {v}.", "Which geographer first surveyed Lake {n}?"),
        ("count", "Lake {n} has {v} islands.", "How many islands does Lake {n} have?"),
    )),
    "company": ("company", (
        ("year", "The {n} company was founded in {v}.", "In which year was the {n} company founded?"),
        ("number", "It employs {v} people.", "How many people does the {n} company employ?"),
        ("person", "Its first director was {v}.", "Who was the first director of the {n} company?"),
        ("count", "The {n} company runs {v} factories.", "How many factories does the {n} company run?"),
    )),
    "observatory": ("observatory", (
        ("year", "The {n} observatory was built in {v}.", "In which year was the {n} observatory built?"),
        ("number", "It stands {v} metres above the sea.", "How many metres above the sea does the {n} observatory stand?"),
        ("person", "Its first astronomer was {v}.", "Who was the first astronomer of the {n} observatory?"),
        ("count", "The {n} observatory has {v} telescopes.", "How many telescopes does the {n} observatory have?"),
    )),
}
FILLER = (
    "It is well known in the region and appears in many local guidebooks.",
    "Visitors often arrive in the summer, when the weather is mild.",
    "A small museum nearby tells its history in some detail.",
)
PROSE_BEFORE = (
    "The {n} expedition set out in the early spring with a small team of climbers, surveyors and porters. "
    "The journey to the mountains took several weeks, over rough roads and through narrow valleys. "
    "The team carried food, tents, ropes and instruments for measuring the weather and the snow. "
    "Letters sent home describe long days of walking, cold nights and the slow work of mapping the valleys. "
)
PROSE_FACT = "The base camp of the {n} expedition was set up at an altitude of {v} metres. "
PROSE_AFTER = (
    "From there the climbers made several attempts on the higher ridges, turning back more than once because of "
    "storms. The surveyors completed their maps of the glaciers and measured the flow of the ice. "
    "At the end of the season the team returned to the coast, and the reports they wrote are still read today."
)
PROSE_QUESTION = "At what altitude, in metres, was the base camp of the {n} expedition?"

SYLLABLES = ("ka", "ve", "lor", "mi", "dra", "sen", "tu", "gor", "an", "bel", "ris", "to", "nar", "el", "quin",
             "sha", "vo", "dun", "ix", "pe", "mar", "ol", "tha", "ren", "zu", "cal", "fen", "ho", "ly", "ber")
FIRST = ("Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Ingrid", "Jonas", "Karla", "Leon",
         "Marta", "Nils", "Olga", "Pavel", "Rosa", "Stefan", "Tilda", "Viktor")
LAST = ("Halvorsen", "Brandt", "Okafor", "Lindqvist", "Moreau", "Castellano", "Novak", "Ferreira", "Kowalski",
        "Dubois", "Haddad", "Sorensen", "Tanaka", "Ivanova", "Mbeki", "Larsen", "Petrov", "Quinlan", "Rossi",
        "Valdez", "Weber", "Yilmaz", "Zeller", "Almeida", "Becker", "Carlsson", "Duarte", "Eriksen", "Fischer",
        "Gallo", "Horvat", "Jansen", "Keller", "Lopez", "Meyer", "Nowak", "Ortiz", "Pires", "Ricci", "Schultz",
        "Toivonen", "Urban")


@dataclass(frozen=True, slots=True)
class Question:
    question: str
    answer: str  # the fact an answer must contain (a whole number, or a surname)
    source: str  # the document that holds it
    shape: str  # "fact" or "prose"
    fact: str  # year, number, person, count, altitude

    def is_right(self, text: str) -> bool:
        return answer_contains(text, self.answer)


@dataclass(frozen=True, slots=True)
class Dataset:
    documents: tuple[SampleDocument, ...]
    questions: tuple[Question, ...]


def _names(rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((3, 3, 4)))).capitalize()
        if name not in out and 6 <= len(name) <= 11:
            out.append(name)
    return out


def generate(per_kind: int = PER_KIND, prose: int = PER_KIND, seed: int = SEED) -> Dataset:
    """`per_kind` fact documents of each kind and `prose` reports, one question each, interleaved so
    that any prefix of the questions covers every kind and both shapes."""
    rng = random.Random(seed)
    names = _names(rng, per_kind * len(KINDS) + prose)
    surnames = rng.sample(LAST, len(LAST))
    by_kind: list[list[tuple[SampleDocument, Question]]] = []
    i = 0
    for kind, (_, facts) in KINDS.items():
        rows = []
        for j in range(per_kind):
            n = names[i]
            person = f"{rng.choice(FIRST)} {surnames[i % len(surnames)]}"
            values = {"year": str(rng.randint(1702, 1968)), "number": str(rng.randint(120, 980)),
                      "person": person, "count": str(rng.randint(3, 29))}
            sentences = [s.format(n=n, v=values[f]) for f, s, _ in facts]
            # the same fillers for all, placed the same way: only entity and values tell documents apart
            text = " ".join([sentences[0], FILLER[0], sentences[1], sentences[2], FILLER[1], sentences[3], FILLER[2]])
            source = f"{kind}/{n.lower()}"
            fact, _, question = facts[i % len(facts)]
            answer = values[fact].split()[-1]
            rows.append((SampleDocument(text, {"source": source}),
                         Question(question.format(n=n), answer, source, "fact", fact)))
            i += 1
        by_kind.append(rows)
    reports = []
    for _ in range(prose):
        n, v = names[i], str(rng.randint(2100, 5900))
        text = PROSE_BEFORE.format(n=n) + PROSE_FACT.format(n=n, v=v) + PROSE_AFTER
        source = f"expedition/{n.lower()}"
        reports.append((SampleDocument(text, {"source": source}),
                        Question(PROSE_QUESTION.format(n=n), v, source, "prose", "altitude")))
        i += 1
    by_kind.append(reports)
    pairs = [rows[j] for j in range(max(len(r) for r in by_kind)) for rows in by_kind if j < len(rows)]
    return Dataset(tuple(d for d, _ in pairs), tuple(q for _, q in pairs))
