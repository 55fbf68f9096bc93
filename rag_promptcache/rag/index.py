"""A FAISS inner-product index over unit vectors whose ids are module ids (as int64).

`flat` (exact, the default) is right up to ~100k chunks; `hnsw` answers faster on larger corpora at
a small recall cost and more memory; `ivf` trains centroids on the vectors present when it is
built and suits very large corpora that are rebuilt now and then. Search returns `(id, score)` pairs
and never text. Not here: mapping ids back to text (the corpus's chunk table) or persistence
ordering (the corpus decides when the index is saved and checks it against its table).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import faiss

KINDS = ("flat", "hnsw", "ivf")
_ID_MASK = (1 << 63) - 1


def _faiss():
    """FAISS, imported when an index is first made or read. Importing the package needs no FAISS: the
    engine's benches and `make gpu-check` import `rag_promptcache.rag` without building an index, and
    the GPU machine they run on carries no FAISS wheel."""
    import faiss

    return faiss


def faiss_id(module_id: str) -> int:
    """The int64 FAISS id of a module id `m<16 hex>`: its 64-bit hash, top bit dropped."""
    assert module_id.startswith("m") and len(module_id) == 17, f"{module_id=}"
    return int(module_id[1:], 16) & _ID_MASK


class VectorIndex:
    def __init__(self, dim: int, kind: str = "flat") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown index kind {kind!r}; valid: {', '.join(KINDS)}")
        self.dim = dim
        self.kind = kind
        self.index = self._empty(0)

    def _empty(self, num_train: int) -> faiss.Index:
        faiss = _faiss()
        if self.kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        if self.kind == "hnsw":
            return faiss.IndexIDMap2(faiss.IndexHNSWFlat(self.dim, 32, faiss.METRIC_INNER_PRODUCT))
        # ~39 training points per centroid keeps k-means quiet; at least one list.
        nlist = max(1, min(int(4 * math.sqrt(max(num_train, 1))), num_train // 39))
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        # ids: [n] int64, vectors: [n, dim] float32
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        assert vectors.shape == (len(ids), self.dim), f"{vectors.shape=} {self.dim=}"
        if not len(ids):
            return
        if not self.index.is_trained:
            self.index = self._empty(len(ids))
            self.index.train(vectors)
        self.index.add_with_ids(vectors, ids)

    def remove(self, ids: np.ndarray) -> int:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.kind != "hnsw":
            return int(self.index.remove_ids(ids))
        # HNSW graphs cannot drop nodes: rebuild from the vectors that stay.
        all_ids = _faiss().vector_to_array(self.index.id_map).astype(np.int64)
        keep = ~np.isin(all_ids, ids)
        vectors = self.index.index.reconstruct_n(0, len(all_ids)) if len(all_ids) else np.zeros((0, self.dim), np.float32)
        self.index = self._empty(0)
        self.add(all_ids[keep], vectors[keep])
        return int((~keep).sum())

    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[list[tuple[int, float]]]:
        """For each query row, up to k (id, inner product) pairs, best first; with `allowed` (ids [n]
        int64), among those ids only, inside the search (FAISS's ID selector). A `hnsw` graph or the `ivf`
        lists probed may hold fewer than k allowed ids near the query: the caller tops up (`retrieval.search`)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if not len(self) or (allowed is not None and not len(allowed)):
            return [[] for _ in queries]
        faiss = _faiss()
        nprobe = {"nprobe": max(1, self.index.nlist // 4)} if self.kind == "ivf" else {}
        if self.kind == "ivf":
            self.index.nprobe = nprobe["nprobe"]
        params = None
        if allowed is not None:
            selector = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
            kind = {"flat": faiss.SearchParameters, "hnsw": faiss.SearchParametersHNSW, "ivf": faiss.SearchParametersIVF}
            params = kind[self.kind](sel=selector, **nprobe)  # `selector` stays referenced until the search returns
        scores, ids = self.index.search(queries, min(k, len(self)), params=params)
        return [[(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i != -1] for row_ids, row_scores in zip(ids, scores)]

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        _faiss().write_index(self.index, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, dim: int, kind: str) -> "VectorIndex":
        out = cls(dim, kind)
        out.index = _faiss().read_index(str(path))
        assert out.index.d == dim, f"{out.index.d=} {dim=}"
        return out
