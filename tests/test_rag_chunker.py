"""Chunker properties: hard maximum, overlap, boundaries, exact offsets, stable ids, dedupe, laziness."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from test_rag_corpus import FakeTokenizer

from rag_promptcache.rag.chunker import Chunker, ChunkParams, module_id, module_text

WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex jolly bankers".split()


def make_doc(seed: int, paragraphs: int = 30) -> str:
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choices(WORDS, k=rng.randint(3, 18))).capitalize() + rng.choice([".", "!", "?"])  # noqa: E731
    return "\n\n".join(" ".join(sentence() for _ in range(rng.randint(1, 8))) for _ in range(paragraphs)) + "\n"


def blocks_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("chunk_tokens,overlap", [(32, 0), (48, 8), (128, 32)])
def test_max_never_exceeded_and_offsets_exact(seed: int, chunk_tokens: int, overlap: int) -> None:
    tok = FakeTokenizer()
    doc = make_doc(seed)
    params = ChunkParams(chunk_tokens, overlap)
    chunks = list(Chunker(tok, params).chunks(blocks_of(doc, 97), label="doc.txt"))
    assert chunks
    for c in chunks:
        assert c.num_tokens == len(tok.encode(c.module_text)) <= params.hard_max
        assert doc[c.start : c.end] == c.text
        assert c.module_text == module_text("doc.txt", c.text) and c.module_id == module_id(c.module_text)
    # every word of the document is covered by some chunk, in order
    assert chunks[0].start == 0 and chunks[-1].end >= len(doc.rstrip())
    for a, b in zip(chunks, chunks[1:]):
        assert b.start <= a.end, "no gaps between chunks"
        shared = a.end - b.start
        assert shared == 0 or len(tok.encode(doc[b.start : a.end])) <= overlap + 2
        if overlap == 0:
            assert shared == 0


def test_overlap_repeats_trailing_sentences() -> None:
    doc = " ".join(f"Sentence number {i} is here." for i in range(60))
    chunks = list(Chunker(FakeTokenizer(), ChunkParams(40, 12)).chunks([doc]))
    assert len(chunks) > 3
    assert all(b.start < a.end for a, b in zip(chunks, chunks[1:]))
    assert all(b.text.startswith("Sentence") for b in chunks[1:])  # overlap starts at a sentence


def test_prefers_paragraph_then_sentence_boundaries() -> None:
    paragraphs = [f"Paragraph {i} has a couple of short words." for i in range(12)]
    doc = "\n\n".join(paragraphs)
    chunks = list(Chunker(FakeTokenizer(), ChunkParams(40, 0)).chunks([doc]))
    for c in chunks:
        assert c.text.strip().startswith("Paragraph") and c.text.strip().endswith(".")
    long_paragraph = " ".join(f"Clause {i} ends here." for i in range(40))
    for c in Chunker(FakeTokenizer(), ChunkParams(32, 0)).chunks([long_paragraph]):
        assert c.text.startswith("Clause") and c.text.rstrip().endswith(".")


def test_overlong_words_are_cut_to_fit() -> None:
    doc = "short words then " + "".join(random.Random(1).choices("abcdef0123456789", k=5000)) + " and more"
    params = ChunkParams(32, 0)
    chunks = list(Chunker(FakeTokenizer(), params).chunks([doc], label="h"))
    assert all(c.num_tokens <= params.hard_max for c in chunks)
    assert "".join(c.text for c in chunks) == doc


def test_ids_are_stable_and_duplicates_dropped() -> None:
    doc = make_doc(7)
    first = [c.module_id for c in Chunker(FakeTokenizer(), ChunkParams(48, 8)).chunks([doc], "a")]
    again = [c.module_id for c in Chunker(FakeTokenizer(), ChunkParams(48, 8)).chunks(blocks_of(doc, 13), "a")]
    assert first == again and all(re.fullmatch(r"m[0-9a-f]{16}", m) for m in first)
    assert first != [c.module_id for c in Chunker(FakeTokenizer(), ChunkParams(48, 8)).chunks([doc], "b")]
    repeated = "The same paragraph, again and again.\n\n" * 20
    chunks = list(Chunker(FakeTokenizer(), ChunkParams(16, 0)).chunks([repeated]))
    assert len({c.module_id for c in chunks}) == len(chunks) == 1


def test_consumes_blocks_lazily() -> None:
    consumed = []

    def endless():
        for i in itertools.count():
            consumed.append(i)
            yield f"Block {i} says something. It has two sentences.\n\n"

    chunks = list(itertools.islice(Chunker(FakeTokenizer(), ChunkParams(32, 0)).chunks(endless()), 5))
    assert len(chunks) == 5 and len(consumed) < 50


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="chunk_tokens must be at least 16"):
        ChunkParams(8)
    with pytest.raises(ValueError, match="overlap must be between 0 and chunk_tokens/2"):
        ChunkParams(64, 40)
    with pytest.raises(ValueError, match="max_tokens"):
        ChunkParams(64, 8, max_tokens=32)
