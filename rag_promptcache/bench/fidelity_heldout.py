"""A held-out split for answer fidelity (issue 26 §3): other templates, other kinds of facts, another
seed, and documents of about the corpus's default chunk size (~256 tokens), so a recovery chosen on
bench/fidelity_data.py is confirmed on text it was not tuned on.

Two shapes, generated from a seed:
- `record`: look-alike ~250-token records of five kinds (stations, mines, hospitals, libraries,
  vineyards). Each states four facts (a month, a number, a surname, a town) in the same sentence
  templates as its kind, around eleven filler sentences shared by all of its kind; only the entity and
  the values differ. One question per document asks one fact.
- `inquiry`: a ~250-token inquiry report with one fact (a case number) in the middle of shared prose,
  the long-report shape.

Not here: building the corpus or running the model (research/selection_probe.py).
"""

from __future__ import annotations

import random

from rag_promptcache.bench.fidelity_data import Dataset, Question
from rag_promptcache.rag.sample import SampleDocument

SEED = 2611
PER_KIND = 6

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
# kind: [(fact, sentence, question)]; {n}: entity name, {v}: the value
KINDS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "station": (
        ("month", "Trains first stopped at {n} station in {v}.", "In which month did trains first stop at {n} station?"),
        ("number", "On a working day {v} passengers pass through {n} station.",
         "How many passengers pass through {n} station on a working day?"),
        ("person", "The station building was drawn by the architect Mr {v}.", "Which architect drew {n} station?"),
        ("town", "The line from {n} station runs north to the town of {v}.", "To which town does the line from {n} station run?"),
    ),
    "mine": (
        ("month", "Work at the {n} mine began in {v}.", "In which month did work at the {n} mine begin?"),
        ("number", "Its deepest shaft at {n} reaches {v} metres.", "How deep, in metres, is the deepest shaft of the {n} mine?"),
        ("person", "The first overseer of the {n} mine was Mrs {v}.", "Who was the first overseer of the {n} mine?"),
        ("town", "Ore from {n} is carried by cart to the town of {v}.", "To which town is ore from the {n} mine carried?"),
    ),
    "hospital": (
        ("month", "The {n} hospital took its first patients in {v}.", "In which month did the {n} hospital take its first patients?"),
        ("number", "The {n} hospital has {v} beds.", "How many beds does the {n} hospital have?"),
        ("person", "Its first chief physician at {n} was Dr {v}.", "Who was the first chief physician of the {n} hospital?"),
        ("town", "Most patients of {n} come from the town of {v}.", "From which town do most patients of the {n} hospital come?"),
    ),
    "library": (
        ("month", "The {n} library opened its doors in {v}.", "In which month did the {n} library open its doors?"),
        ("number", "The {n} library holds {v} thousand books.", "How many thousand books does the {n} library hold?"),
        ("person", "The first keeper of the {n} library was Ms {v}.", "Who was the first keeper of the {n} library?"),
        ("town", "A branch of the {n} library serves the town of {v}.", "Which town does a branch of the {n} library serve?"),
    ),
    "vineyard": (
        ("month", "The harvest at the {n} vineyard starts in {v}.", "In which month does the harvest at the {n} vineyard start?"),
        ("number", "The {n} vineyard covers {v} hectares.", "How many hectares does the {n} vineyard cover?"),
        ("person", "The {n} vineyard was planted by the grower Mr {v}.", "Which grower planted the {n} vineyard?"),
        ("town", "Wine from {n} is bottled in the town of {v}.", "In which town is wine from the {n} vineyard bottled?"),
    ),
}
FILLER = (
    "The records kept about it are held in the regional archive and are open to anyone who asks.",
    "Over the years the place has been repaired several times, most often after hard winters.",
    "Local people speak of it with some pride, and school classes visit it every spring.",
    "A short guide printed by the district council describes its history and its daily work.",
    "The roads that lead to it were widened some decades ago, which made the journey much easier.",
    "Old photographs show the same buildings, the same gates and the same long rows of trees.",
    "Its accounts are checked each year by inspectors sent from the capital.",
    "Several of the people who work there today are the grandchildren of the first workers.",
    "Plans for a new wing have been discussed many times, but nothing has been decided so far.",
    "In the quiet months only a few visitors come, most of them walkers on their way to the hills.",
    "A plaque by the entrance lists the names of those who paid for the first buildings.",
)
REPORT_BEFORE = (
    "The inquiry into the loss of the cargo barge {n} opened in the harbour court on a grey morning. "
    "The court heard from the crew, the harbour master and two merchants who had goods on board. "
    "All of them agreed that the weather had been calm when the barge left the quay in the evening. "
    "The barge had been inspected in the spring and was found to be in good order at that time. "
    "Witnesses described a loud noise near midnight, after which the barge began to take on water. "
    "The crew reached the shore in the small boat, and nobody was hurt in the accident. "
)
REPORT_FACT = "The court registered the loss of the {n} under case number {v}. "
REPORT_AFTER = (
    "Divers later examined the wreck and found a long split in the hull near the stern. "
    "The court considered whether the barge had been overloaded, and heard long arguments on both sides. "
    "In the end it found that the hull had been weakened by an old repair that had not been done well. "
    "The owners were asked to pay part of the merchants' losses, and the harbour rules were changed. "
    "The full record of the inquiry is kept in the archive of the harbour court."
)
REPORT_QUESTION = "Under which case number did the court register the loss of the barge {n}?"

SYLLABLES = ("bra", "ost", "vel", "kin", "dor", "umi", "sar", "tev", "plo", "gan", "ria", "mos", "hel", "vak",
             "tor", "lin", "esk", "rud", "fal", "nor", "bim", "cho", "wen", "zar", "jol", "pra", "sil", "kem")
SURNAMES = ("Abernathy", "Bellamy", "Cartwright", "Delacroix", "Ellsworth", "Fairbanks", "Goodwin", "Hargreaves",
            "Ingram", "Jefferies", "Kingsley", "Lockhart", "Merriweather", "Northcott", "Oakley", "Pemberton",
            "Radcliffe", "Sutherland", "Thornbury", "Underwood", "Vance", "Whitlock", "Yardley", "Ashdown",
            "Blackwood", "Crane", "Dunmore", "Everly", "Fenwick", "Greaves", "Holloway", "Kendrick")


def _names(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3, 3)))).capitalize()
        if name not in out and name not in taken and 5 <= len(name) <= 10:
            out.append(name)
    return out


def generate(per_kind: int = PER_KIND, reports: int = PER_KIND, seed: int = SEED) -> Dataset:
    """`per_kind` records of each kind and `reports` inquiry reports, one question each, interleaved so
    that any prefix of the questions covers every kind and both shapes."""
    rng = random.Random(seed)
    names = _names(rng, per_kind * len(KINDS) + reports, set())
    towns = _names(rng, per_kind * len(KINDS), set(names))
    surnames = rng.sample(SURNAMES, len(SURNAMES))
    by_kind: list[list[tuple[SampleDocument, Question]]] = []
    i = 0
    for kind, facts in KINDS.items():
        rows = []
        for _ in range(per_kind):
            n = names[i]
            values = {"month": rng.choice(MONTHS), "number": str(rng.randint(130, 990)),
                      "person": surnames[i % len(surnames)], "town": towns[i]}
            s = [t.format(n=n, v=values[f]) for f, t, _ in facts]
            f = FILLER
            text = " ".join([f[0], s[0], f[1], f[2], s[1], f[3], f[4], s[2], f[5], f[6], s[3], f[7], f[9], f[8], f[10]])
            source = f"{kind}/{n.lower()}"
            fact, _, question = facts[(i + 1) % len(facts)]
            rows.append((SampleDocument(text, {"source": source}),
                         Question(question.format(n=n), values[fact], source, "record", fact)))
            i += 1
        by_kind.append(rows)
    inquiries = []
    for _ in range(reports):
        n, v = names[i], str(rng.randint(10000, 99999))
        text = REPORT_BEFORE.format(n=n) + REPORT_FACT.format(n=n, v=v) + REPORT_AFTER
        inquiries.append((SampleDocument(text, {"source": f"inquiry/{n.lower()}"}),
                          Question(REPORT_QUESTION.format(n=n), v, f"inquiry/{n.lower()}", "inquiry", "case")))
        i += 1
    by_kind.append(inquiries)
    pairs = [rows[j] for j in range(max(len(r) for r in by_kind)) for rows in by_kind if j < len(rows)]
    return Dataset(tuple(d for d, _ in pairs), tuple(q for _, q in pairs))
