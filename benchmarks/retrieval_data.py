"""The real-document set of `python -m benchmarks.retrieval`: pages of two Debian documentation packages
(SQLite's `sqlite3-doc`, Git's `git-doc`; `make manuals` installs them) and questions about them checked
against each page's text, committed in `data/retrieval_manuals.json`; and which retrieved module
counts as the one that answers a question (`gold`).

A module answers a question when it comes from the question's page and holds its `evidence` (a phrase of
the page, compared as lower-case words) and one of its accepted answers; where the chunking put the
evidence and the answer in different modules, a module of the page holding the evidence counts.
The look-alike splits' questions (bench/fidelity_*.py) name their document; there a module of that
document holding the answer counts.

Not here: running retrieval or the model (benchmarks/retrieval.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.rag.fidelity import answer_contains

if TYPE_CHECKING:
    from rag_promptcache.rag.corpus import Corpus

DATA = Path(__file__).resolve().parent / "data" / "retrieval_manuals.json"


@dataclass(frozen=True, slots=True)
class RealQuestion:
    question: str
    answers: tuple[str, ...]  # any one stated is right
    source: str  # the page's path, as the corpus records its document
    evidence: str = ""  # a phrase of the page that marks the answer-bearing module ("": any module holding an answer)
    manual: str = ""


def words(text: str) -> str:
    """Text as lower-case words and numbers, one space apart: how evidence is compared."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def load(path: Path | None = None) -> tuple[dict[str, list[Path]], list[RealQuestion]]:
    """(the pages of each manual, the questions), from the committed set (or `path`). `ValueError` naming
    the package and `make manuals` when a manual's pages are not installed."""
    raw = json.loads(path.read_text() if path is not None else DATA.read_text())
    pages: dict[str, list[Path]] = {}
    for name, m in raw["manuals"].items():
        found = [Path(m["dir"]) / p for p in m["pages"]]
        if missing := [p for p in found if not p.is_file()]:
            raise ValueError(f"the {name} manual is not installed ({missing[0]} is missing): `make manuals`, or "
                             f"`apt-get install {m['package']}`, installs it")
        pages[name] = found
    questions = [RealQuestion(q["question"], tuple(q["answers"]), str((Path(raw["manuals"][q["manual"]]["dir"]) / q["page"]).resolve()),
                              q.get("evidence", ""), q["manual"]) for q in raw["questions"]]
    return pages, questions


def scopes(pages: dict[str, list[Path]], questions: list[RealQuestion]) -> dict[str, list[dict[str, object]]]:
    """Each question's metadata filter to its manual (its pages' files) and to its page (the file): the
    filtered rows of the scenario."""
    files = {name: [str(p.resolve()) for p in found] for name, found in pages.items()}
    return {"manual": [{"path": {"$in": files[q.manual]}} for q in questions],
            "page": [{"path": q.source} for q in questions]}


def by_source(corpus: Corpus) -> dict[str, dict[str, str]]:
    """Each document's modules and their text (without the header a module carries)."""
    out: dict[str, dict[str, str]] = {}
    for m, _ in corpus.table.modules():
        for s, _, _ in corpus.table.sources(m):
            out.setdefault(s, {})[m] = corpus.text(m)
    return out


def gold(texts_of: dict[str, dict[str, str]], question: RealQuestion) -> set[str]:
    """The modules that answer `question` (see the module docstring), among `by_source`'s; empty when
    none does, which the scenario reports (a page whose text changed since the question was written)."""
    texts = texts_of.get(question.source, {})
    modules = list(texts)
    evidence = words(question.evidence)
    holds = [m for m in modules if evidence and evidence in words(texts[m])]
    answered = [m for m in modules if any(answer_contains(texts[m], a) for a in question.answers)]
    both = set(holds) & set(answered)
    return both or set(holds) or (set(answered) if not evidence else set())


def ranks(found: list[str], relevant: set[str]) -> int | None:
    """The 1-based rank of the first relevant module in `found`, None when none is there."""
    return next((i for i, m in enumerate(found, 1) if m in relevant), None)
