"""The FAISS index: module ids in and out, (id, score) pairs best first, removal, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rag_promptcache.rag.chunker import module_id
from rag_promptcache.rag.index import KINDS, VectorIndex, faiss_id


def unit_rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_faiss_ids_are_stable_positive_int64() -> None:
    ids = [faiss_id(module_id(f"text {i}")) for i in range(1000)]
    assert len(set(ids)) == 1000 and all(0 <= i < 2**63 for i in ids)
    assert faiss_id(module_id("text 1")) == ids[1]


@pytest.mark.parametrize("kind", KINDS)
def test_search_remove_save_load(kind: str, tmp_path: Path) -> None:
    vectors = unit_rows(200, 16)
    ids = np.array([faiss_id(module_id(str(i))) for i in range(200)], dtype=np.int64)
    index = VectorIndex(16, kind)
    assert index.search(vectors[:1], 3) == [[]]
    index.add(ids, vectors)
    assert len(index) == 200
    hits = index.search(vectors[[5, 9]], 4)
    assert [row[0][0] for row in hits] == [ids[5], ids[9]]
    assert all(isinstance(i, int) and isinstance(s, float) for row in hits for i, s in row)
    assert all(row[0][1] == pytest.approx(1.0, abs=1e-4) for row in hits)
    assert all(a[1] >= b[1] for row in hits for a, b in zip(row, row[1:]))
    assert index.remove(ids[:50]) == 50 and len(index) == 150
    assert ids[5] not in {i for i, _ in index.search(vectors[5], 10)[0]}
    index.save(tmp_path / "i.faiss")
    again = VectorIndex.load(tmp_path / "i.faiss", 16, kind)
    assert len(again) == 150 and again.search(vectors[60], 1)[0][0][0] == ids[60]


def test_k_larger_than_index_and_bad_input() -> None:
    index = VectorIndex(4)
    index.add(np.array([1, 2], dtype=np.int64), unit_rows(2, 4))
    assert len(index.search(unit_rows(1, 4), 10)[0]) == 2
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(unit_rows(1, 4), 0)
    with pytest.raises(ValueError, match="unknown index kind 'annoy'; valid: flat, hnsw, ivf"):
        VectorIndex(4, "annoy")
