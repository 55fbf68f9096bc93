"""The manuals split (bench/fidelity_manuals.py): deterministic per seed, every answer in its own document
and in no look-alike, its entities and templates its own, and documents of the size that makes k = 4, 8
and 12 about 600, 1.2k and 2k context tokens."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from rag_promptcache.bench import fidelity_data, fidelity_heldout, fidelity_manuals
from rag_promptcache.bench.fidelity_manuals import PROCEDURES, TABLES, generate
from rag_promptcache.rag.chunker import Chunker, module_text
from rag_promptcache.rag.fidelity import answer_contains


def kind(source: str) -> str:
    return source.split("/")[0]


def test_deterministic_per_seed_and_shaped_like_the_other_splits():
    a, b = generate(), generate()
    assert a == b and len(a.documents) == len(a.questions) == 42
    other = generate(seed=fidelity_manuals.SEED + 1)
    assert {q.question for q in other.questions}.isdisjoint(q.question for q in a.questions)
    assert len({d.metadata["source"] for d in a.documents}) == 42
    assert Counter(q.shape for q in a.questions) == {"procedure": 24, "table": 18}
    assert {q.fact for q in a.questions if q.shape == "procedure"} == {"flag", "port", "seconds", "step"}
    assert {kind(q.source) for q in a.questions[:7]} == {*PROCEDURES, *TABLES}  # any prefix covers every kind
    assert len(generate(1, 1).questions) == len(PROCEDURES) + len(TABLES)
    with pytest.raises(ValueError, match="at most 6 documents per kind"):
        generate(7)


@pytest.mark.parametrize("seed_offset", [0, 1])
def test_every_answer_is_in_its_document_and_in_no_look_alike(seed_offset):
    data = generate(seed=fidelity_manuals.SEED + seed_offset)
    texts = {d.metadata["source"]: d.page_content for d in data.documents}
    for d, q in zip(data.documents, data.questions):
        assert q.source == d.metadata["source"] and q.is_right(d.page_content)
        if q.fact == "step":  # every guide numbers its steps: the asked action's step differs between look-alikes
            line = f"Step {q.answer}: {PROCEDURES[kind(q.source)][1]}"
            look_alikes = [t for s, t in texts.items() if kind(s) == kind(q.source) and s != q.source]
            assert line in d.page_content and len(look_alikes) == 5 and all(line not in t for t in look_alikes)
        else:  # a flag, a port, a wait or a cell: in this document and no other
            assert [s for s, t in texts.items() if answer_contains(t, q.answer)] == [q.source]
        # the question names its product, which one document holds
        product = re.search(r"the ([A-Z][a-z]+ [A-Z][a-z]+) ", q.question).group(1)
        assert [s for s, t in texts.items() if product in t] == [q.source]


def test_look_alikes_share_their_layout_and_differ_in_values():
    data = generate()
    mixers = [d.page_content for d in data.documents if kind(d.metadata["source"]) == "mixer"]
    rows = [re.findall(r"^\| ([a-z ]+) \| (\d+) \| ", t, re.M) for t in mixers]
    assert len(mixers) == 6 and len({tuple(spec for spec, _ in r) for r in rows}) == 1  # the same rows, in order
    assert all(len(r) == 6 for r in rows) and len({v for r in rows for _, v in r}) == 6 * 6  # every value differs
    guides = [d.page_content for d in data.documents if kind(d.metadata["source"]) == "printer"]
    # the same steps in the same words, around the values and the product: only those and the step order differ
    masked = {tuple(sorted(re.sub(r"--[\w-]+|\d+|[A-Z][a-z]+ [A-Z][a-z]+", "#", t).split("\n"))) for t in guides}
    assert len(guides) == 6 and len(masked) == 1
    assert len({t.index(PROCEDURES["printer"][1]) for t in guides}) == 6


def test_its_own_entities_and_templates():
    assert not set(fidelity_manuals.SYLLABLES) & (set(fidelity_data.SYLLABLES) | set(fidelity_heldout.SYLLABLES))
    mine = {s for _, action, steps, _, qs in PROCEDURES.values() for s in (action, *steps, *qs.values())}
    mine |= {q for _, q, _ in TABLES.values()}
    theirs = {s for _, facts in fidelity_data.KINDS.values() for _, s, q in facts for s in (s, q)}
    theirs |= {s for facts in fidelity_heldout.KINDS.values() for _, s, q in facts for s in (s, q)}
    theirs |= {*fidelity_data.FILLER, *fidelity_heldout.FILLER}
    words = lambda s: set(re.findall(r"[a-z]+", s.lower())) - {"the", "of", "in", "is", "a", "to", "on", "does"}  # noqa: E731
    for s in mine:  # no template of another split, nor one close to it
        assert all(len(words(s) & words(t)) < max(3, len(words(s)) // 2) for t in theirs), s


def test_documents_chunk_to_one_module_of_a_few_hundred_tokens(tokenizer):
    chunker = Chunker(tokenizer)
    sizes = []
    for d in generate().documents:
        chunks = list(chunker.chunks([d.page_content], d.metadata["source"]))
        assert len(chunks) == 1, d.metadata["source"]
        sizes.append(chunker.count(module_text(d.metadata["source"], d.page_content)))
    mean = sum(sizes) / len(sizes)
    assert 140 <= mean <= 170 and max(sizes) <= 200  # k = 4, 8, 12: about 600 / 1.2k / 2k context tokens
