"""A corpus directory on disk: its files, reading them with errors that say what to do, and the
saved FAISS index.

- `manifest.json`: model, fingerprint, embedder, chunking, versions (`records.Manifest`); it cannot be
  rebuilt from the others.
- `chunks.sqlite`: documents, chunks with offsets, module texts and vectors: the source of truth
  (`table.ChunkTable`).
- `index.faiss` + `index.json`: a saved index and the table generation it reflects. Derived data:
  rebuilt from the table when missing, behind it, or damaged; a missing or damaged one is saved
  again at once, with a `CorpusWarning`.
- `lexical/`: the BM25 index (`lexical.py`), derived the same way: a corpus made before it, or one
  whose copy is missing or damaged, gets it built from the table and saved, with a `CorpusWarning`.
  A read-only command (`info`) rebuilds either in memory and writes nothing: where an ingest was
  interrupted before saving them, its warning says so and that `ingest` resumes (and saves them).
- `store/`: module KV (`corpus_store.py`).

Not here: what ingest writes (`ingestor.py`) or how the index is searched (`retrieval.py`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rag_promptcache.rag.index import VectorIndex
from rag_promptcache.rag.lexical import LexicalIndex
from rag_promptcache.rag.records import Manifest
from rag_promptcache.rag.table import ChunkTable

MANIFEST = "manifest.json"
TABLE = "chunks.sqlite"
INDEX = "index.faiss"
INDEX_META = "index.json"
LEXICAL = "lexical"
STORE = "store"


class CorpusWarning(UserWarning):
    """What the user of a corpus should know: a file was damaged and has been rebuilt from the others
    (nothing was lost), or it was encoded without the tuned adapter its model now ships with."""


def is_corpus(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def check_corpus(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path where it holds a corpus, else a ValueError that says how to make one. Cheap (no
    model, no torch): the CLI asks it before loading anything."""
    path = Path(path)
    if not is_corpus(path):
        what = "does not exist" if not path.exists() else "is not a corpus (no manifest.json)"
        raise ValueError(f"{path} {what}; create one with: rag-promptcache ingest PATH --corpus {path}")
    return path


def find_corpora(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The corpora `paths` name, in order: each a corpus, or a folder whose subdirectories that are corpora
    count (in name order). A corpus's directory name is what a server serves it as, so two with one name
    are refused, as is a path given twice; a path that is neither is `check_corpus`'s error. Cheap (no model)."""
    found: list[Path] = []
    for given in map(Path, paths):
        inside = sorted(p for p in given.iterdir() if is_corpus(p)) if given.is_dir() and not is_corpus(given) else []
        found.extend(inside or [check_corpus(given)])
    names: dict[str, Path] = {}
    for path in found:
        other = names.setdefault(path.resolve().name, path)
        if other is not path:
            same = "is given twice" if other.resolve() == path.resolve() else f"and {other} have one name"
            raise ValueError(f"corpus {path} {same}: each corpus is served as its directory's name, so names must "
                             "differ (rename a directory, or serve the folder that holds them)")
    return found


def package_version() -> str:
    """This package's version, recorded in each manifest."""
    try:
        return version("rag-promptcache")
    except PackageNotFoundError:
        return "0+unknown"


def read_manifest(path: Path) -> Manifest:
    file = path / MANIFEST
    try:
        return Manifest.from_json(file.read_text(), str(file))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        if str(file) in str(e):
            raise  # already names the file and the fix (a format from another version)
        raise ValueError(f"{file} is damaged ({e}); it records the corpus's model and settings and cannot be "
                         "rebuilt: re-ingest the documents into a new corpus") from e


def write_manifest(path: Path, manifest: Manifest) -> None:
    write_atomic(path / MANIFEST, manifest.to_json())


def open_table(path: Path, *, read_only: bool = False) -> ChunkTable:
    file = path / TABLE
    try:
        return ChunkTable(file, read_only=read_only)
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{file} is damaged ({e}); it holds the corpus's chunks and vectors: re-ingest the "
                         "documents into a new corpus (a damaged module store is checked with "
                         "`rag-promptcache store verify`)") from e


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def check_files(path: Path) -> None:
    """An existing corpus must still have its chunk table: opening would otherwise make an empty one."""
    if not (path / TABLE).is_file():
        raise ValueError(f"{path / TABLE} is missing; it holds the corpus's chunks and vectors and cannot be rebuilt: "
                         "restore it from a backup, or re-ingest the documents into a new corpus")


def load_indexes(path: Path, manifest: Manifest, table: ChunkTable, *,
                 writable: bool = True) -> tuple[VectorIndex, LexicalIndex, int]:
    """The vector index, the BM25 index and the table generation that one reflects, each loaded, else
    rebuilt from the table; a missing or damaged one is saved where `writable`, and said once."""
    generation = table.generation
    index, problem = load_index(path, manifest, table)
    if problem:
        _repaired(path, table, problem, "the vector index", len(index), writable,
                  lambda: save_index(path, index, generation))
    lexical, lexical_generation, problem = load_lexical(path, table)
    if problem:
        _repaired(path, table, problem, "the lexical (BM25) index", len(index), writable,
                  lambda: save_lexical(path, lexical, lexical_generation))
    return index, lexical, lexical_generation


def _repaired(path: Path, table: ChunkTable, problem: str, what: str, num_modules: int, writable: bool,
              save: Callable[[], None]) -> None:
    """Save a derived index rebuilt from the table on open (where `writable`), and say so once."""
    if not writable:
        if any(not d.complete for d in table.documents()):
            said = (f"the last ingest into {path} was interrupted before it saved {what} ({Path(problem.split(' is ')[0]).name}): "
                    "run ingest again to resume; this command rebuilt it in memory and wrote nothing")
        else:
            said = f"{problem}; this command rebuilt {what} in memory and wrote nothing (the next ingest saves it)"
        warnings.warn(said, CorpusWarning, stacklevel=5)
        return
    try:
        save()
        done = "saved"
    except OSError as e:
        done = f"not saved ({e.strerror or e}): it is rebuilt on each open until the corpus is writable"
    warnings.warn(f"{problem}; rebuilt {what} from {TABLE} ({num_modules} modules) and {done}", CorpusWarning,
                  stacklevel=5)


def load_index(path: Path, manifest: Manifest, table: ChunkTable) -> tuple[VectorIndex, str | None]:
    """The saved index when it reflects the table's generation, else one rebuilt from the table; with
    what was wrong when the saved one was missing or damaged (the caller saves the rebuilt one and warns,
    once). One merely behind the table (an ingest stopped between commit and save, or one under way in
    another process) is rebuilt without a word: that ingest saves it."""
    file, meta = path / INDEX, path / INDEX_META
    if file.exists() and meta.exists():
        try:
            saved = json.loads(meta.read_text())
            if saved.get("generation") == table.generation and saved.get("kind") == manifest.index:
                return VectorIndex.load(file, manifest.dim, manifest.index), None
        except (ValueError, RuntimeError, AssertionError) as e:  # faiss raises RuntimeError on a damaged file
            # the index is derived data: the table holds every vector, so rebuild rather than fail
            return _rebuilt(manifest, table), f"{file} or {meta.name} is damaged ({str(e).strip().splitlines()[0]})"
        return _rebuilt(manifest, table), None
    index = _rebuilt(manifest, table)
    return index, (f"{file.name if not file.exists() else meta.name} is missing" if len(index) else None)


def _rebuilt(manifest: Manifest, table: ChunkTable) -> VectorIndex:
    index = VectorIndex(manifest.dim, manifest.index)
    index.add(*table.vectors(manifest.dim))
    return index


def save_index(path: Path, index: VectorIndex, generation: int) -> None:
    """Save the index with the table generation it reflects (the caller holds the index's lock)."""
    index.save(path / INDEX)
    meta = {"generation": generation, "kind": index.kind, "num_vectors": len(index)}
    write_atomic(path / INDEX_META, json.dumps(meta) + "\n")


def load_lexical(path: Path, table: ChunkTable) -> tuple[LexicalIndex, int, str | None]:
    """The saved BM25 index and the table generation it reflects when it reflects the current one,
    else one built from the table now; with what was wrong when the saved one was missing (a corpus
    made before hybrid retrieval) or damaged, for the caller to save it and warn once."""
    folder = path / LEXICAL
    generation = table.generation
    if folder.is_dir():
        try:
            index, saved = LexicalIndex.load(folder)
            if saved == generation:
                return index, generation, None
            return build_lexical(table)[0], generation, None  # behind: whoever ingested saves it
        except ValueError as e:
            return build_lexical(table)[0], generation, str(e)
    index = build_lexical(table)[0]
    return index, generation, (f"{folder} is missing (a corpus made before hybrid retrieval)" if len(index) else None)


def build_lexical(table: ChunkTable) -> tuple[LexicalIndex, int]:
    """The BM25 index of every module in the table, and the table generation it reflects."""
    generation = table.generation  # first: a batch committed meanwhile makes the index look behind, never ahead
    return LexicalIndex(*table.search_texts()), generation


def save_lexical(path: Path, index: LexicalIndex, generation: int) -> None:
    index.save(path / LEXICAL, generation)


def store_bytes(path: Path) -> int:
    store = path / STORE
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.exists() else 0


def store_keys(path: Path) -> set[str]:
    """The keys whose entries the corpus's disk tier holds (its files, as store/disk.py names them)."""
    from rag_promptcache.store.disk import SUFFIX

    return {f.name.removesuffix(SUFFIX) for f in (path / STORE).glob(f"??/*{SUFFIX}")}
