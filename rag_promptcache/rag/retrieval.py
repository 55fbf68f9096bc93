"""Retrieval: a question → the modules that answer it → those that fit the model's context window with
the rest of the prompt and the answer, as `Hit`s; and for a conversation (`Conversations`), each user
turn's retrieval once, remembered for the turns after it.

`search` is the one place every path retrieves (`ask`, `chat`, `eval`, `tune`, the server, the
LangChain and LlamaIndex retrievers). Hybrid by default: the dense ranking (FAISS over the embedded
modules) and the lexical one (BM25, `lexical.py`), each `FUSION_DEPTH` deep, fused by reciprocal rank
(Cormack et al. 2009: each module scores the sum of weight / (RRF_K + its rank) over the rankings that
hold it), the lexical ranking weighted `LEXICAL_WEIGHT` (on manuals, where questions name options and
settings, it ranks the answer first more often: `python -m benchmarks.retrieval`, docs/retrieval.md),
and, where the question names an identifier a heading holds (`events.once`), a third ranking of the
modules under such headings (`LexicalIndex.search_names`), weighted `NAMES_WEIGHT`. A question with no
lexical match is ranked by the dense half alone. Whatever ranked it, each hit's
score is its cosine similarity to the question, so `min_score` means one thing in every mode.

The one rule for how history counts against the window: every earlier turn's text (system, user,
assistant) counts once, with the chat template's markup around them counted once for the whole prompt
(`TEMPLATE_TOKENS`).

Not here: the prompt built from them (`Corpus.prompt`, `prompts.build_prompt`) or generation.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong
from rag_promptcache.rag.chunker import SEPARATOR
from rag_promptcache.rag.embed import EmbedderLike
from rag_promptcache.rag.index import VectorIndex
from rag_promptcache.rag.lexical import LexicalIndex
from rag_promptcache.rag.table import ChunkTable

TEMPLATE_TOKENS = 32  # room for the chat template's role markup around the turns
RETRIEVALS_KEPT = 256  # conversation turns whose retrieval `Conversations` remembers (for the order of follow-ups)
# The answer, given without generating, when no chunk scores at least a caller's `min_score`.
NOT_FOUND = "Not found in the documents."
MODES = ("hybrid", "dense", "lexical")  # `search`'s rankings: fused (the default), FAISS alone, BM25 alone
RRF_K = 60  # reciprocal rank fusion's constant, as its authors set it
LEXICAL_WEIGHT = 1.5  # the BM25 ranking's weight in the fusion, the dense one's being 1
NAMES_WEIGHT = 1.0  # the ranking by identifiers named in headings (on API references: docs/retrieval.md)
FUSION_DEPTH = 50  # candidates each ranking gives the fusion
# The least answer room a question is asked with: a question that leaves less (with the instructions,
# earlier turns and the best chunk) is refused as too long, not answered with a token or two.
MIN_ANSWER_TOKENS = 32
SNIPPET_CHARS = 240  # a hit's snippet: the start of its chunk's text, cut at a word
_HEADING_LINE = re.compile(r"\s*#{1,6}\s|\s*$")  # a Markdown heading, or a blank line
EXACT_BATCH = 10_000  # vectors read per query by `exact` (below SQLite's limit on a statement's parameters)


@dataclass(frozen=True, slots=True)
class Hit:
    """One retrieved (or named) chunk as every answer path shows it; `Corpus.hit` fills it."""

    module_id: str
    label: str  # the document the chunk came from, as `Corpus.documents()` names it
    score: float | None  # cosine similarity to the question; None when the caller named the module
    section: str = ""  # the chunk's title and heading path in its document ("" where it has none)
    snippet: str = ""  # the start of the chunk's text, at most SNIPPET_CHARS

    @property
    def where(self) -> str:
        return where(self.label, self.section)


def where(label: str, section: str) -> str:
    """`label › section`, or the label alone: what a user reads to find a chunk."""
    return f"{label}{SEPARATOR}{section}" if section else label


def section_of(context: str, label: str) -> str:
    """A chunk's context (`chunker.context_of`: its title, else its document's label, then headings) →
    its section as shown after the label: the label not repeated, "" where the context is the label."""
    if context == label:
        return ""
    return context.removeprefix(label + SEPARATOR)


def snippet(text: str) -> str:
    """A chunk's text → its snippet: the start of its words, the heading lines it opens with dropped (the
    section names them)."""
    lines = text.strip().splitlines()
    while len(lines) > 1 and _HEADING_LINE.match(lines[0]):
        lines.pop(0)
    return shorten("\n".join(lines))


def shorten(text: str, chars: int = SNIPPET_CHARS) -> str:
    """`text` on one line, at most about `chars` characters, cut at a word (with " …")."""
    text = " ".join(text.split())
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " …"


def search(index: VectorIndex, lexical: LexicalIndex | None, lock: threading.RLock, embedder: EmbedderLike,
           table: ChunkTable, question: str, k: int, mode: str = "hybrid",
           allowed: np.ndarray | None = None) -> list[tuple[str, float]]:
    """The k modules that best answer the question by `mode` (see MODES and the module docstring):
    (module id, cosine score), best first. `allowed` (FAISS ids, a filter's: `metadata.Catalog`)
    restricts both rankings inside their search, so k come back whenever k modules are allowed. `lock`
    guards the indexes: FAISS indexes are not safe to search while another thread adds or removes."""
    if mode not in MODES:
        raise ValueError(f"unknown retrieval mode {mode!r}; valid: {', '.join(MODES)}")
    if allowed is not None and not len(allowed):
        return []
    depth = max(k, FUSION_DEPTH) if mode == "hybrid" else k
    vector = embedder.embed([question])  # [1, dim]
    with lock:
        dense = index.search(vector, depth, allowed)[0] if mode != "lexical" else []
        words = lexical.search(question, depth, allowed) if mode != "dense" and lexical is not None else []
        named = lexical.search_names(question, depth, allowed) if mode == "hybrid" and lexical is not None else []
    if allowed is not None and mode != "lexical" and len(dense) < min(depth, len(allowed)):
        dense = exact(table, vector[0], allowed, depth)
    ranked = fuse([[i for i, _ in dense], [i for i, _ in words], [i for i, _ in named]],
                  (1.0, LEXICAL_WEIGHT, NAMES_WEIGHT))
    names = table.module_ids_for(ranked)  # a module removed since the lexical index was built is gone here
    ranked = [i for i in ranked if i in names][:k]
    cosine = dict(dense)
    if missing := [i for i in ranked if i not in cosine]:
        stored = table.vectors_for(missing)
        cosine.update({i: float(stored[i] @ vector[0]) for i in missing if i in stored})
    return [(names[i], cosine[i]) for i in ranked if i in cosine]


def exact(table: ChunkTable, vector: np.ndarray, allowed: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k allowed modules nearest `vector` [dim] by their stored vectors, best first: the dense ranking
    where an approximate index (an HNSW graph, the IVF lists probed) held fewer allowed modules near the
    question than there are."""
    stored: dict[int, np.ndarray] = {}
    for start in range(0, len(allowed), EXACT_BATCH):
        stored.update(table.vectors_for(allowed[start:start + EXACT_BATCH].tolist()))
    ids = np.array(list(stored), dtype=np.int64)
    if not len(ids):
        return []
    scores = np.stack(list(stored.values())) @ vector  # [n]
    top = np.argsort(-scores, kind="stable")[:k]
    return [(int(ids[i]), float(scores[i])) for i in top]


def fuse(rankings: Sequence[Sequence[int]], weights: Sequence[float] | None = None) -> list[int]:
    """Weighted reciprocal rank fusion of rankings (ids, best first) into one, best first; ties keep the
    first ranking's order."""
    score: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights or [1.0] * len(rankings)):
        for rank, i in enumerate(ranking, start=1):
            score[i] = score.get(i, 0.0) + weight / (RRF_K + rank)
    return sorted(score, key=lambda i: -score[i])


def fit(
    hits: list[tuple[str, float]],
    sizes: Sequence[int],
    count: Callable[[str], int],
    *,
    instructions: str,
    question: str,
    history: Sequence[tuple[str, str]],
    max_new: int,
    window: int,
) -> list[tuple[str, float]]:
    """Drop the lowest-scoring hits (`sizes`: each one's tokens) until the prompt and the answer fit
    the window. When even the best one does not: `QuestionTooLong` where what is left for the answer
    is under MIN_ANSWER_TOKENS (or `max_new`, if smaller), else `ContextWindowExceeded` with the
    `max_new` that fits; both name the question's tokens, what else takes the room, and the window."""
    parts = {"question": count(question), "instructions": count(instructions),
             "history": sum(count(u) + count(a) for u, a in history), "chat template (about)": TEMPLATE_TOKENS}
    fixed = sum(parts.values())
    sizes = list(sizes)
    best = sizes[0] if sizes else 0
    while hits and fixed + sum(sizes) + max_new > window:
        hits, sizes = hits[:-1], sizes[:-1]
    if hits or fixed + best + max_new <= window:
        return hits
    named = ", ".join(f"{n} {what}" for what, n in [*parts.items(), ("for the best retrieved chunk", best)] if n or what != "history")
    needs = f"the prompt needs {fixed + best} tokens ({named})"
    room, least = window - fixed - best, min(MIN_ANSWER_TOKENS, max_new)
    if room < least:
        most = parts["question"] + room - least  # the longest question that leaves `least`
        raise QuestionTooLong(
            f"the question is {parts['question']} tokens, too long for the model's {window}-token context window: "
            f"{needs}, which leaves {max(room, 0)} for the answer, under the least an answer is asked with ({least}); "
            + (f"shorten the question to at most {most} tokens" if most > 0 else "shorten the question and the conversation before it"),
            num_question_tokens=parts["question"], window=window)
    raise ContextWindowExceeded(
        f"{needs} plus max_new_tokens {max_new}: {fixed + best + max_new}, more than the model's {window}-token "
        f"window; lower max_new_tokens to at most {room}, or shorten the question", max_new_fits=room)


def above(hits: list[tuple[str, float]], min_score: float | None) -> list[tuple[str, float]]:
    """The hits scoring at least `min_score` (None: all of them)."""
    if min_score is not None and not -1.0 <= min_score <= 1.0:
        raise ValueError(f"min_score is a cosine similarity between -1 and 1, got {min_score}")
    return hits if min_score is None else [(m, s) for m, s in hits if s >= min_score]


def keep_order(rankings: Sequence[Sequence[str]]) -> list[str]:
    """Each user turn's retrieved module ids (best first), oldest turn first → the last turn's ids in
    the order to import them: the previous turn's order when it retrieved the same modules (and so on
    back), else its own ranking. A follow-up over the same modules then repeats the previous prompt
    token for token up to its new question, the prefix the engine's prefix cache reuses; a new
    ranking of the same modules would move them and break that prefix at the first module."""
    order: list[str] = []
    for ranked in rankings:
        if not order or set(order) != set(ranked):
            order = list(ranked)
    return order


@dataclass(frozen=True, slots=True)
class Retrieved:
    """A conversation's last user turn's retrieval: its `hits` (best first, fitted to the window) and the
    module ids in `keep_order`'s order over every user turn's retrieval (best first)."""

    hits: tuple[Hit, ...]
    order: tuple[str, ...]


# (question, history for the window) → the question's hits fitted to the window: `Corpus.retrieve`
Retrieve = Callable[[str, Sequence[tuple[str, str]]], list[Hit]]


def window_history(turns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Earlier turns (role, text) as `fit`'s history: each turn's text once, whatever its role."""
    return [(text, "") for _, text in turns]


class Conversations:
    """Each user turn's retrieval by the conversation up to it, remembered (at most `max_kept`, least
    recently used first out), since every later turn of the conversation asks again for its order. The
    last turn is always searched afresh (the corpus may have changed since it was remembered) and then
    remembered. Not thread-safe: the corpus calls it under its lock."""

    def __init__(self, max_kept: int = RETRIEVALS_KEPT) -> None:
        self.max_kept = max_kept
        self._kept: OrderedDict[tuple[object, ...], list[Hit]] = OrderedDict()
        self.num_searches = 0

    def retrieve(self, turns: Sequence[tuple[str, str]], k: int, max_new_tokens: int, search: Retrieve,
                 min_score: float | None = None, scope: str = "") -> Retrieved:
        """`turns` (role, text), the last one the user's question → its retrieval (less the hits scoring
        below `min_score`; empty when none does) and the import order. `scope` names what `search` is
        restricted to (a filter's canonical form): a turn remembered under another scope is searched again."""
        assert turns and turns[-1][0] == "user", f"{turns[-1:]=}"
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        rankings = [self._one(turns[: i + 1], k, max_new_tokens, search, scope, fresh=i == users[-1]) for i in users]
        scored = dict(above([(h.module_id, h.score) for h in rankings[-1]], min_score))
        rankings[-1] = [h for h in rankings[-1] if h.module_id in scored]
        if not rankings[-1]:
            return Retrieved((), ())
        return Retrieved(tuple(rankings[-1]), tuple(keep_order([[h.module_id for h in r] for r in rankings])))

    def _one(self, turns: Sequence[tuple[str, str]], k: int, max_new_tokens: int, search: Retrieve, scope: str,
             fresh: bool) -> list[Hit]:
        key = (tuple(turns), k, max_new_tokens, scope)
        if key in self._kept and not fresh:
            self._kept.move_to_end(key)
            return self._kept[key]
        self.num_searches += 1
        hits = search(turns[-1][1], window_history(turns[:-1]))
        self._kept[key] = hits
        self._kept.move_to_end(key)
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)
        return hits
