"""Questions over look-alike passages, as training samples: text only, laid out later (`layout.py`).

A sample is the prompt a corpus would send (instructions, k retrieved modules, a question) plus the
answer, written as the model itself tends to answer: the question's subject restated, then the fact.
Kinds:
- `fact`: a changelog entry's maintainer, date or closed bug, among entries of the same layout
  (other versions of the same package first); a package record's version, maintainer, sizes,
  section, first dependency or summary, among records of the same source package and maintainer;
- `cloze`: how a sentence of one passage goes on, among passages of the same source and family.
The passage holding the answer sits anywhere among the k; where retrieval puts it (last, next to the
question) is the most common place. Deterministic per (seed, index).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from rag_promptcache.tune.texts import Passage

INSTRUCTIONS_VARIANTS: tuple[str, ...] = (
    "Answer the question using the documents below.",
    "You answer questions about the reference documents below. Quote them exactly where you can.",
    "Use only the following documents to answer. Be brief.",
)
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*\"'(])")


@dataclass(frozen=True, slots=True)
class Sample:
    instructions: str
    passages: tuple[int, ...]  # indices into the passage list, in prompt order
    relevant: int  # index into `passages` of the one holding the answer
    question: str
    answer: str
    kind: str


class SampleMaker:
    """Draws samples from `passages`; `instructions` is the corpus's (a variant is drawn a third of the time)."""

    def __init__(self, passages: Sequence[Passage], instructions: str, *, k: tuple[int, int] = (1, 14),
                 seed: int = 0, neighbors: dict[int, list[int]] | None = None, fact_share: float = 0.45) -> None:
        """`neighbors[i]`: the passages a retriever ranks nearest to passage i (a corpus's own look-alikes),
        taken before others of its source and family; `fact_share`: how many samples ask a fact where
        one can be asked (the rest: clozes)."""
        if not passages:
            raise ValueError("no passages to make samples from")
        self.passages = list(passages)
        self.instructions = instructions
        self.k = k
        self.seed = seed
        self.neighbors = neighbors or {}
        self.fact_share = fact_share
        self.by_source: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.by_family: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.passages):
            self.by_source[(p.family, p.source)].append(i)
            self.by_family[p.family].append(i)
        self.facts = [i for i, p in enumerate(self.passages) if p.facts]
        self.clozes = [i for i, p in enumerate(self.passages) if _cloze_sentences(p.text)]
        if not self.facts and not self.clozes:
            raise ValueError("no passage has a fact or a sentence long enough to ask about")

    def __call__(self, index: int) -> Sample:
        rng = random.Random(self.seed * 1_000_003 + index)
        kind = "fact" if self.facts and (not self.clozes or rng.random() < self.fact_share) else "cloze"
        target = rng.choice(self.facts if kind == "fact" else self.clozes)
        question, answer = (_fact_question if kind == "fact" else _cloze_question)(self.passages[target], rng)
        k = rng.randint(*self.k)
        others = self._look_alikes(target, k - 1, rng)
        place = len(others) if rng.random() < 0.5 else rng.randint(0, len(others))
        order = [*others[:place], target, *others[place:]]
        instructions = self.instructions if rng.random() < 0.67 else rng.choice(INSTRUCTIONS_VARIANTS)
        return Sample(instructions, tuple(order), place, question, answer, kind)

    def _look_alikes(self, target: int, n: int, rng: random.Random) -> list[int]:
        p = self.passages[target]
        near = [i for i in self.neighbors.get(target, ()) if i != target][:n]
        same = [i for i in self.by_source[(p.family, p.source)] if i != target and i not in near]
        rng.shuffle(same)
        family = self.by_family[p.family]
        picked = near + same[: max(0, min(len(same), rng.randint(n // 2, n) - len(near)))]
        seen = {target, *picked}
        while len(picked) < n and len(seen) < len(self.passages):
            i = rng.choice(family if rng.random() < 0.8 else range(len(self.passages)))
            if i not in seen:
                seen.add(i)
                picked.append(i)
        rng.shuffle(picked)
        return picked


_PACKAGE_QUESTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "version": (("Which version of {p} is listed?", "What version is the {p} package?"), "{p} is at version {v}."),
    "maintainer": (("Who maintains {p}?", "Which team or person maintains the {p} package?"), "{p} is maintained by {v}."),
    "installed": (("What is the installed size of {p}?", "How many kB does {p} take once installed?"),
                  "{p} takes {v} kB once installed."),
    "size": (("How large is the {p} download, in bytes?", "What is the download size of {p}?"),
             "The {p} package is {v} bytes to download."),
    "section": (("Which section is {p} in?", "In what archive section is {p}?"), "{p} is in the {v} section."),
    "depends": (("Which package does {p} depend on first?", "What is the first dependency of {p}?"),
                "{p} depends first on {v}."),
    "summary": (("What is {p}?", "What does the {p} package provide?"), "{p}: {v}."),
}


def _package_question(p: Passage, rng: random.Random) -> tuple[str, str]:
    facts = dict(p.facts)
    kind = rng.choice([k for k in _PACKAGE_QUESTIONS if k in facts])
    questions, answer = _PACKAGE_QUESTIONS[kind]
    pkg = facts["package"]
    return rng.choice(questions).format(p=pkg), answer.format(p=pkg, v=facts[kind])


def shared_fact_neighbors(passages: Sequence[Passage], fact: str = "maintainer", limit: int = 24,
                          seed: int = 0) -> dict[int, list[int]]:
    """For each passage with `fact`, up to `limit` others with the same value of it (records of one
    maintainer look most alike), siblings of its own source first: `SampleMaker`'s `neighbors`."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(passages):
        value = dict(p.facts).get(fact)
        if value:
            groups[value].append(i)
    rng = random.Random(seed)
    out: dict[int, list[int]] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        for i in members:
            same = [j for j in members if j != i and passages[j].source == passages[i].source]
            rest = [j for j in rng.sample(members, min(len(members), limit + 1)) if j != i and j not in same]
            out[i] = (same + rest)[:limit]
    return out


def _fact_question(p: Passage, rng: random.Random) -> tuple[str, str]:
    if p.family == "package":
        return _package_question(p, rng)
    facts = dict(p.facts)
    pkg, version = facts["package"], facts["version"]
    kinds = ["name", "date"] + (["bug"] if "bug" in facts else [])
    kind = rng.choice(kinds)
    if kind == "name":
        q = rng.choice(["Who uploaded {p} {v}?", "Which maintainer signed the upload of {p} version {v}?",
                        "Who made the {p} {v} release?"])
        a = f"{pkg} {version} was uploaded by {facts['name']}."
    elif kind == "date":
        q = rng.choice(["When was {p} {v} uploaded?", "On what date was {p} version {v} released?",
                        "What is the date of the {p} {v} entry?"])
        a = f"{pkg} {version} was uploaded on {facts['date']}."
    else:
        q = rng.choice(["Which bug does {p} {v} close?", "What bug number is closed in {p} {v}?"])
        a = f"{pkg} {version} closes bug #{facts['bug']}."
    return q.format(p=pkg, v=version), a


def _cloze_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE.split(" ".join(text.split())) if 12 <= len(s.split()) <= 40]


def _cloze_question(p: Passage, rng: random.Random) -> tuple[str, str]:
    sentence = rng.choice(_cloze_sentences(p.text))
    words = sentence.split()
    cut = rng.randint(5, min(9, len(words) - 5))
    start = " ".join(words[:cut])
    q = rng.choice(['Complete this sentence from the documents: "{s} ..."',
                    'How does the sentence that begins "{s}" go on?',
                    'Finish the quote: "{s} ..."'])
    return q.format(s=start), sentence
