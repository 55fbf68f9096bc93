"""Retrieval: a question → the modules that answer it → those that fit the model's context window with
the rest of the prompt and the answer, as `Hit`s; and for a conversation (`Conversations`), each user
turn's retrieval once, remembered for the turns after it.

`search` is the one place every path retrieves (`ask`, `chat`, `eval`, `tune`, the server, the
LangChain and LlamaIndex retrievers). Hybrid by default: the dense ranking (FAISS over the embedded
modules) and the lexical one (BM25, `lexical.py`), each `FUSION_DEPTH` deep, fused by reciprocal rank
(Cormack et al. 2009: each module scores the sum of weight / (RRF_K + its rank) over the rankings that
hold it), the lexical ranking weighted `LEXICAL_WEIGHT` (on manuals, where questions name options and
settings, it ranks the answer first more often: `python -m benchmarks.retrieval`, docs/retrieval.md). A
question with no lexical match is ranked by the dense half alone. Whatever ranked it, each hit's
score is its cosine similarity to the question, so `min_score` means one thing in every mode.

The one rule for how history counts against the window: every earlier turn's text (system, user,
assistant) counts once, with the chat template's markup around them counted once for the whole prompt
(`TEMPLATE_TOKENS`).

Not here: the prompt built from them (`Corpus.prompt`, `prompts.build_prompt`) or generation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rag_promptcache.engine.errors import ContextWindowExceeded
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
FUSION_DEPTH = 50  # candidates each ranking gives the fusion


@dataclass(frozen=True, slots=True)
class Hit:
    module_id: str
    label: str  # the document the chunk came from, as `Corpus.documents()` names it
    score: float | None  # cosine similarity to the question; None when the caller named the module


def search(index: VectorIndex, lexical: LexicalIndex | None, lock: threading.RLock, embedder: EmbedderLike,
           table: ChunkTable, question: str, k: int, mode: str = "hybrid") -> list[tuple[str, float]]:
    """The k modules that best answer the question by `mode` (see MODES and the module docstring):
    (module id, cosine score), best first. `lock` guards the indexes: FAISS indexes are not safe to
    search while another thread adds or removes."""
    if mode not in MODES:
        raise ValueError(f"unknown retrieval mode {mode!r}; valid: {', '.join(MODES)}")
    depth = max(k, FUSION_DEPTH) if mode == "hybrid" else k
    vector = embedder.embed([question])  # [1, dim]
    with lock:
        dense = index.search(vector, depth)[0] if mode != "lexical" else []
        words = lexical.search(question, depth) if mode != "dense" and lexical is not None else []
    ranked = fuse([[i for i, _ in dense], [i for i, _ in words]], (1.0, LEXICAL_WEIGHT))
    names = table.module_ids_for(ranked)  # a module removed since the lexical index was built is gone here
    ranked = [i for i in ranked if i in names][:k]
    cosine = dict(dense)
    if missing := [i for i in ranked if i not in cosine]:
        stored = table.vectors_for(missing)
        cosine.update({i: float(stored[i] @ vector[0]) for i in missing if i in stored})
    return [(names[i], cosine[i]) for i in ranked if i in cosine]


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
    the window; `ContextWindowExceeded` naming what takes the room when even the best one does not."""
    parts = {"instructions": count(instructions), "question": count(question),
             "history": sum(count(u) + count(a) for u, a in history), "chat template (about)": TEMPLATE_TOKENS}
    fixed = sum(parts.values())
    sizes = list(sizes)
    best = sizes[0] if sizes else 0
    while hits and fixed + sum(sizes) + max_new > window:
        hits, sizes = hits[:-1], sizes[:-1]
    if not hits and fixed + best + max_new > window:
        named = ", ".join(f"{n} {what}" for what, n in [("for the best retrieved chunk", best), *parts.items()] if n or what != "history")
        raise ContextWindowExceeded(
            f"the prompt needs {fixed + best} tokens ({named}) plus max_new_tokens {max_new}: "
            f"{fixed + best + max_new}, more than the model's {window}-token window; "
            + (f"lower max_new_tokens to at most {window - fixed - best}" if window > fixed + best else "shorten the question"),
            max_new_fits=window - fixed - best if window > fixed + best else None,
        )
    return hits


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
                 min_score: float | None = None) -> Retrieved:
        """`turns` (role, text), the last one the user's question → its retrieval (less the hits scoring
        below `min_score`; empty when none does) and the import order."""
        assert turns and turns[-1][0] == "user", f"{turns[-1:]=}"
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        rankings = [self._one(turns[: i + 1], k, max_new_tokens, search, fresh=i == users[-1]) for i in users]
        scored = dict(above([(h.module_id, h.score) for h in rankings[-1]], min_score))
        rankings[-1] = [h for h in rankings[-1] if h.module_id in scored]
        if not rankings[-1]:
            return Retrieved((), ())
        return Retrieved(tuple(rankings[-1]), tuple(keep_order([[h.module_id for h in r] for r in rankings])))

    def _one(self, turns: Sequence[tuple[str, str]], k: int, max_new_tokens: int, search: Retrieve,
             fresh: bool) -> list[Hit]:
        key = (tuple(turns), k, max_new_tokens)
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
