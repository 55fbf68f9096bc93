"""A BM25 index over the corpus's modules (`bm25s`), beside the FAISS index: the lexical half of hybrid
retrieval. Its ids are the modules' FAISS ids, so both rankings name modules the same way.

What a module is indexed by (`chunker.search_text`): its document's title and heading path, then its
text. Tokens (`tokens`): lower case words; a compound such as `journal_mode`, `wal-index`,
`clean.requireForce` or `3.7.0` counts whole and by its parts; English stop words dropped; English
Snowball stems (PyStemmer) for plain words; runs of CJK characters, which carry no spaces, as character
bigrams. A question none of whose tokens the corpus has gets no lexical ranking (dense retrieval alone).

**Names in headings** (`search_names`): API references name their subject in a heading
(`events.once(emitter, name[, options])`), and a question that names an identifier (a compound joined by
`.`, `_`, `:` or `/`: `events.once`, `journal_mode`, `clean.requireForce`) asks for that section. A
second BM25 over the modules' context lines alone ranks the modules whose headings hold the identifiers
the question names; hybrid retrieval fuses it as a third ranking. Hyphenated words (`in-memory`) are not
identifiers: weighing the headings for every word lost answers on the manuals (docs/retrieval.md).

The index is derived data, built from the chunk table: bm25s cannot add or drop documents, so the
corpus rebuilds it after an ingest or a removal (seconds per 100k modules, `bench --scenarios
retrieval`), and between them the index lags (a module added meanwhile is found by FAISS only). Saved
as bm25s's own files plus `ids.npy` and `lexical.json` (format, table generation) in `<corpus>/lexical/`.

Not here: fusing it with the dense ranking (`retrieval.py`), when it is rebuilt or saved (`layout.py`,
the corpus).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

FORMAT = 2  # of the saved files (2: with the headings' index); another one is rebuilt from the table
HEADINGS = "headings"  # the folder, inside the saved index's, of the context lines' BM25
_WORD = re.compile(r"[^\W_]+(?:[_.:/-][^\W_]+)*")
# words of how a question is asked, not of what it asks (bm25s's English list keeps them)
QUESTION_WORDS = frozenset({"which", "what", "how", "when", "where", "why", "who", "whom", "whose", "does", "do",
                            "did", "can", "could", "should", "would", "i", "me", "my", "you", "your", "s"})
_IDENTIFIER = re.compile(r"(?=.*[a-z])[^_.:/]+(?:[_.:/][^_.:/]*)+")  # a compound term joined by `.`, `_`, `:` or `/`
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")


@lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN) | QUESTION_WORDS


@lru_cache(maxsize=1)
def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


def tokens(text: str) -> list[str]:
    """The index terms of `text`, in order (see the module docstring)."""
    text = text.lower()
    out: list[str] = []
    if _CJK.search(text):
        for run in _CJK.findall(text):
            out += [run] if len(run) == 1 else [run[i:i + 2] for i in range(len(run) - 1)]
        text = _CJK.sub(" ", text)
    for word in _WORD.findall(text):
        out += _terms(word)
    return out


@lru_cache(maxsize=1 << 18)
def _terms(word: str) -> tuple[str, ...]:
    """One word's terms: a compound whole, then each part; stop words dropped, plain words stemmed.
    Cached: a corpus repeats its words, and the stemmer is the cost of indexing."""
    stop, stem = _stopwords(), _stemmer()
    parts = re.split(r"[_.:/-]", word)
    out = [word] if len(parts) > 1 else []
    for part in parts:
        if part and part not in stop:
            out.append(stem.stemWord(part) if part.isalpha() else part)
    return tuple(out)


class LexicalIndex:
    """BM25 (bm25s, Lucene's variant) over `texts`, one per FAISS id in `ids`, and over their `headings`
    (each module's context line) for `search_names`."""

    def __init__(self, ids: np.ndarray, texts: Sequence[str], headings: Sequence[str] | None = None) -> None:
        assert len(ids) == len(texts), f"{len(ids)=} {len(texts)=}"
        headings = [""] * len(texts) if headings is None else headings
        assert len(headings) == len(texts), f"{len(headings)=} {len(texts)=}"
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self._bm25, self._headings = _bm25(texts), _bm25(headings)

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, query: str, k: int, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        """Up to k (FAISS id, BM25 score) with a score above zero, best first; empty when no query term
        is in the index. With `allowed` (FAISS ids), among those only: the others score zero before the top k
        is taken."""
        return self._top(self._bm25, tokens(query), k, allowed)

    def search_names(self, query: str, k: int, allowed: np.ndarray | None = None) -> list[tuple[int, float]]:
        """As `search`, over the modules' headings and by the identifiers the query names only (the module
        docstring); empty when it names none that a heading holds."""
        return self._top(self._headings, [t for t in tokens(query) if _IDENTIFIER.fullmatch(t)], k, allowed)

    def _top(self, bm25, terms: list[str], k: int, allowed: np.ndarray | None) -> list[tuple[int, float]]:
        if not len(self) or k < 1:
            return []
        terms = [t for t in terms if t in bm25.vocab_dict]
        if not terms:
            return []
        scores = bm25.get_scores(terms)  # [num_docs]
        if allowed is not None:
            scores = np.where(np.isin(self.ids, allowed), scores, 0.0)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(self.ids[i]), float(scores[i])) for i in top if scores[i] > 0]

    def save(self, path: Path, generation: int) -> None:
        """Into directory `path`, replacing what is there: written beside it, then swapped in."""
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.mkdir(parents=True)
        try:
            if len(self):
                self._bm25.save(str(tmp), show_progress=False)
                self._headings.save(str(tmp / HEADINGS), show_progress=False)
            np.save(tmp / "ids.npy", self.ids)
            meta = {"format": FORMAT, "generation": generation, "num_modules": len(self)}
            (tmp / "lexical.json").write_text(json.dumps(meta) + "\n")
            old = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls, path: Path) -> tuple[LexicalIndex, int]:
        """(the saved index, the table generation it reflects). `ValueError` naming what is wrong when
        the files are missing, from another format or damaged."""
        import bm25s

        try:
            meta = json.loads((path / "lexical.json").read_text())
            if not isinstance(meta, dict):
                raise ValueError(f"lexical.json holds a {type(meta).__name__}, not an object")
        except (OSError, ValueError) as e:
            raise _damaged(path, e) from e
        if isinstance(meta.get("format"), int) and meta["format"] != FORMAT:
            raise ValueError(f"{path} was saved in another format ({meta['format']}; this version reads {FORMAT}: "
                             "format 2 added the headings' index)")
        try:
            out = cls.__new__(cls)
            out.ids = np.load(path / "ids.npy", allow_pickle=False).astype(np.int64)
            out._bm25 = out._headings = bm25s.BM25()
            if len(out.ids):
                out._bm25 = bm25s.BM25.load(str(path), show_progress=False, verbosity=0)
                out._headings = bm25s.BM25.load(str(path / HEADINGS), show_progress=False, verbosity=0)
                for name, bm25 in (("texts", out._bm25), ("headings", out._headings)):
                    if bm25.scores["num_docs"] != len(out.ids):
                        raise ValueError(f"{bm25.scores['num_docs']} {name} for {len(out.ids)} ids")
            if meta.get("num_modules") != len(out.ids):
                raise ValueError(f"{len(out.ids)} ids, lexical.json says {meta.get('num_modules')}")
            return out, int(meta["generation"])
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            raise _damaged(path, e) from e


def _damaged(path: Path, error: Exception) -> ValueError:
    said = str(error).strip()
    return ValueError(f"{path} is missing or damaged ({said.splitlines()[0] if said else type(error).__name__})")


def _bm25(texts: Sequence[str]):
    import bm25s

    bm25 = bm25s.BM25()
    if len(texts):
        # an empty document keeps its row: ids and bm25s's rows stay aligned
        bm25.index([tokens(t) or [""] for t in texts], show_progress=False)
    return bm25
