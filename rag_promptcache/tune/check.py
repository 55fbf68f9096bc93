"""The check `rag-promptcache tune` runs before and after training, and its verdict.

Questions are asked as `Corpus.ask` asks them (retrieved by the question, in the corpus's order,
under its instructions) and answered with full prefill and with modules encoded on their own (recovery
`none`), by the base model, the shipped adapter where one ships, and the tuned one. They are the
user's own (the JSON lines `eval` reads), or made from modules kept out of training:
- `blank`: a fact lookup. A sentence with one number or name blanked ("Which word or number fills the
  blank in this sentence from the documents: "The Ostsarsar hospital has ___ beds."?"), where the
  sentence keeps another number or name that tells look-alike modules apart;
- `cloze`: how a sentence goes on, for modules with no such sentence. Small models seldom manage it
  even with full prefill, so it only fills in.
`kept`: of the base model's right answers with full prefill, the share a setting also gets right. A
question without an expected answer is right where the answer says what the base model's full
prefill says (`normalize_answer`). Not here: training (`train.py`), the CLI (`cli/tune_cmd.py`).
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_promptcache.rag.fidelity import EvalQuestion, answer_contains, normalize_answer
from rag_promptcache.tune.layout import Layouter
from rag_promptcache.tune.recipe import probe

if TYPE_CHECKING:
    from rag_promptcache.rag import Corpus

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_NUMBER = re.compile(r"(?<![\w.,:-])\d+(?:[.,:]\d+)*(?![\w-]|[.,:]\d)")
_NAME = re.compile(r"(?<![\w-])[A-Z][a-z]+(?:[- ][A-Z][a-z]+)*(?![\w-])")
BLANK = "___"


@dataclass(frozen=True, slots=True)
class CheckQuestion:
    question: str
    answers: tuple[str, ...]  # any one stated is right; none: right is saying what the base model's full prefill says
    modules: tuple[str, ...]  # the retrieved modules' texts, in prompt order
    instructions: str
    kind: str  # "blank", "cloze" or "user"


@dataclass(frozen=True, slots=True)
class Check:
    """Right answers out of `questions` per setting ("base/full", "base/none", "tuned/full", "tuned/none",
    and "default/full", "default/none" where an adapter ships for the model), `kept` per setting: of
    base/full's right answers, the share it also gets right, and how many questions of each kind."""

    questions: int
    right: dict[str, int]
    kept: dict[str, float | None]
    kinds: dict[str, int]


def blanks(text: str) -> list[tuple[str, str]]:
    """(sentence with one number or name blanked, the blanked word) for each sentence of `text` that has
    one and keeps another number or name. A number is blanked before a name; of names, the last word of
    the last one (the object of the sentence more often than its subject)."""
    out = []
    for sentence in _SENTENCE.split(text):
        sentence = " ".join(sentence.split())
        if not 5 <= len(sentence.split()) <= 40:
            continue
        numbers = list(_NUMBER.finditer(sentence))
        names = list(_NAME.finditer(sentence, sentence.find(" ") + 1))  # a sentence's first word says little
        if numbers:
            span = numbers[0].span()
        elif names:
            last = names[-1]
            span = (last.start() + last.group().rfind(" ") + 1, last.end())  # its last word (rfind: -1 for one word)
        else:
            continue
        word = sentence[span[0]:span[1]]
        anchors = [m.group() for m in [*numbers, *names] if m.end() <= span[0] or m.start() >= span[1]]
        if anchors and sentence.count(word) == 1:
            out.append((f"{sentence[:span[0]]}{BLANK}{sentence[span[1]:]}", word))
    return out


def _cloze(text: str, rng: random.Random) -> tuple[str, str] | None:
    sentences = [s for s in _SENTENCE.split(" ".join(text.split())) if 10 <= len(s.split()) <= 60]
    if not sentences:
        return None
    words = rng.choice(sentences).split()
    cut = rng.randint(4, min(8, len(words) - 4))
    return (f'How does the sentence that begins "{" ".join(words[:cut])}" go on?',
            " ".join(words[cut:cut + 3]).strip(",;:()\"'"))


# How a blanked sentence is asked (`phrase`): "blank" names the blank ("Which word or number fills the blank
# in this sentence ..."), "continue" gives the sentence up to the blank and asks how it goes on, as a user
# quoting the documents would. On SQLite's and Git's manuals the base model's full prefill answered 1 and 3
# of 24 (docs/retrieval.md, "`tune`'s checks"): neither judges an adapter there, and `tune` says so first.
PHRASINGS = ("blank", "continue")
PHRASING = "blank"


def phrase(sentence: str, how: str | None = None) -> str:
    """A blanked sentence (`blanks`) as a check question."""
    how = how or PHRASING
    if how == "blank":
        return f'Which word or number fills the blank in this sentence from the documents: "{sentence}"'
    head = sentence[: sentence.index(BLANK)].rstrip()
    return f'According to the documents, how does this go on (one word or number): "{head} ..."?'


def made_questions(texts: Sequence[str], limit: int, seed: int) -> list[tuple[str, str, str]]:
    """Up to `limit` (question, answer, kind) about `texts`, taken from each text in turn: its blanks,
    or one cloze question where it has none."""
    rng = random.Random(seed)
    per_text = []
    for text in texts:
        found = blanks(text)
        rng.shuffle(found)
        rows = [(phrase(s), a, "blank") for s, a in found]
        if not rows and (cloze := _cloze(text, rng)) is not None:
            rows.append((*cloze, "cloze"))
        per_text.append(rows)
    in_turn = itertools.chain.from_iterable(itertools.zip_longest(*per_text))
    return [row for row in in_turn if row is not None][:limit]


def ask_as_corpus(corpus: Corpus, questions: Sequence[tuple[str, tuple[str, ...], str]], k: int) -> list[CheckQuestion]:
    """(question, answers, kind) with the modules `Corpus.ask` would retrieve for each."""
    out = []
    for question, answers, kind in questions:
        ids = corpus.order([m for m, _ in corpus.search(question, k)])
        out.append(CheckQuestion(question, answers, tuple(corpus.table.module(m)[0] for m in ids),
                                 corpus.manifest.instructions, kind))
    return out


def check_questions(corpus: Corpus, texts: Sequence[str], limit: int, seed: int, k: int,
                    user: Sequence[EvalQuestion] = ()) -> list[CheckQuestion]:
    """The user's questions where given, else ones made from `texts` (modules kept out of training)."""
    if user:
        return ask_as_corpus(corpus, [(q.question, tuple(q.answers), "user") for q in user], k)
    return ask_as_corpus(corpus, [(q, (a,), kind) for q, a, kind in made_questions(texts, limit, seed)], k)


def answers_of(model, tokenizer, rows: Sequence[CheckQuestion], layouter: Layouter, who: str) -> dict[str, list[str]]:
    """`who`'s answers with full prefill and with modules encoded on their own ("who/full", "who/none"),
    the latter with the link tokens `layouter` places, if any."""
    prompts = [layouter.lay(r.instructions, list(r.modules), r.question, "") for r in rows]
    return probe(model, tokenizer, prompts, who, 4, [], {})


def judge(rows: Sequence[CheckQuestion], texts: dict[str, list[str]]) -> dict[str, list[bool]]:
    """Per setting, whether each answer is right (against the expected answers, or the base model's
    full prefill where a question has none)."""
    reference = texts["base/full"]

    def right(row: CheckQuestion, text: str, ref: str) -> bool:
        if row.answers:
            return any(answer_contains(text, a) for a in row.answers)
        return normalize_answer(text) == normalize_answer(ref)

    return {s: [right(r, t, ref) for r, t, ref in zip(rows, said, reference)] for s, said in texts.items()}


def summarize(rows: Sequence[CheckQuestion], right: dict[str, list[bool]]) -> Check:
    ref = right["base/full"]
    kept = {s: (sum(a and b for a, b in zip(ref, r)) / sum(ref) if sum(ref) else None) for s, r in right.items()}
    return Check(len(ref), {s: sum(r) for s, r in right.items()}, kept, dict(Counter(r.kind for r in rows)))


MIN_RIGHT = 3  # base/full right answers below which `kept` cannot tell an adapter from chance
MIN_SHARE = 1 / 3  # ... nor where it answers fewer than this share of the questions made from the corpus


def too_few_to_judge(rows: Sequence[CheckQuestion], texts: dict[str, list[str]]) -> str | None:
    """Why questions made from the corpus cannot judge an adapter: the base model's full prefill answered
    too few of them (fewer than MIN_RIGHT, or than MIN_SHARE of them); else None. Asked before training, so
    the budget is not spent on an adapter nothing can judge. (The user's own questions are theirs to judge.)"""
    right = sum(judge(rows, {"base/full": texts["base/full"]})["base/full"])
    if right >= MIN_RIGHT and right >= MIN_SHARE * len(rows):
        return None
    return (f"the base model's full prefill answered {right} of the {len(rows)} check questions made from held-out "
            "modules: too few to judge an adapter, so nothing was trained; ask your own with --questions FILE "
            '(JSON lines: {"question": ..., "answer": ...}), or train unchecked with --check 0')


def verdict(check: Check) -> tuple[bool, str]:
    """Applied only where the tuned model's cached answers keep more than the model's would without this
    tune (the base model's, and the shipped adapter's where one ships), and its full prefill answers no
    fewer questions than the base model's."""
    tuned = check.kept["tuned/none"]
    before = [(who, check.kept[f"{who}/none"]) for who in ("base", "default") if f"{who}/none" in check.kept]
    who, base = max(before, key=lambda b: -1.0 if b[1] is None else b[1])
    if base is None or tuned is None:
        return False, ("the base model answered none of the check questions with full prefill: nothing to compare "
                       "(ask your own with --questions)")
    if check.right["tuned/full"] < check.right["base/full"]:
        return False, (f"full prefill got worse with the adapter ({check.right['tuned/full']} against "
                       f"{check.right['base/full']} of {check.questions} right)")
    name = "the base model's" if who == "base" else "the shipped adapter's"
    if tuned <= base:
        return False, f"cached answers did not get better (kept {tuned:.2f} against {name} {base:.2f})"
    return True, f"cached answers kept {tuned:.2f} of full prefill's right answers, against {name} {base:.2f}"
