"""The engine over every store tier, with the real SmolLM2: a cold store is filled by the first
request, a second engine on the same backing answers from it, and a second *process* started later
answers from the disk tier without recomputing anything."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.store import DiskStore, MemoryStore, RedisStore, TieredStore

SCHEMA = """<schema name="facts"><system>Answer from the documents.</system>
<module name="eiffel">The Eiffel Tower in Paris was completed in 1889 for the World's Fair.</module>
<module name="nile">The Nile is about 6,650 kilometres long and flows into the Mediterranean Sea.</module>
</schema>"""
PROMPT = '<prompt schema="facts"><nile/><eiffel/><user>When was the Eiffel Tower completed?</user></prompt>'

# name -> (make the store, make a second handle on the same backing)
TIERS = {
    "disk": lambda p, url, c: DiskStore(p / "kv", codec=c),
    "redis": lambda p, url, c: RedisStore(url, prefix=f"t-{p.name}", codec=c),
    "memory+disk": lambda p, url, c: TieredStore([MemoryStore(codec=c), DiskStore(p / "kv", codec=c)]),
    "memory+redis": lambda p, url, c: TieredStore([MemoryStore(codec=c), RedisStore(url, prefix=f"t-{p.name}",
                                                                                   codec=c)]),
}


@pytest.mark.smollm
@pytest.mark.parametrize("tier,codec", [(t, "native") for t in TIERS] + [("disk", "int8"), ("memory+redis", "fp16")])
def test_second_engine_answers_from_the_tier(tier, codec, smollm, tmp_path, request):
    model, tokenizer = smollm
    url = request.getfixturevalue("redis_server").url if "redis" in tier else ""
    first = PromptCache(model, tokenizer, store=TIERS[tier](tmp_path, url, codec))
    first.add_schema(SCHEMA)
    cold = first.generate(PROMPT, max_new_tokens=6)
    assert set(cold.missed_modules) == {"nile", "eiffel"}
    first.store.close()

    second = PromptCache(model, tokenizer, store=TIERS[tier](tmp_path, url, codec))
    second.add_schema(SCHEMA)
    warm = second.generate(PROMPT, max_new_tokens=6)
    assert warm.missed_modules == () and set(warm.hit_modules) == {"nile", "eiffel"}
    if codec == "native":
        assert warm.token_ids == cold.token_ids
    cmp = second.compare(PROMPT)
    assert cmp.top1_match and cmp.kl < 0.05, cmp


@pytest.mark.smollm
def test_memory_store_hits_within_a_process(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer)  # the default store: memory
    pc.add_schema(SCHEMA)
    pc.generate(PROMPT, max_new_tokens=1)
    warm = pc.generate(PROMPT, max_new_tokens=1)
    assert warm.missed_modules == () and pc.store.stats().num_hits >= 2


@pytest.mark.smollm
def test_a_later_process_answers_from_disk_without_recomputing(smollm, tmp_path):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=DiskStore(tmp_path / "kv"))
    pc.add_schema(SCHEMA)
    report = pc.encode("facts")
    assert report.num_modules == 3  # both documents and the schema's own text
    expected = pc.generate(PROMPT, max_new_tokens=12)
    script = textwrap.dedent(f"""
        import json
        from rag_promptcache.engine import PromptCache
        from rag_promptcache.store import DiskStore
        pc = PromptCache.from_pretrained("smollm2-135m-instruct", device="cpu", dtype="float32",  # the fixture's
                                         store=DiskStore({str(tmp_path / "kv")!r}))
        pc.add_schema({SCHEMA!r})
        res = pc.generate({PROMPT!r}, max_new_tokens=12)
        print(json.dumps({{"missed": res.missed_modules, "hits": res.hit_modules, "tokens": res.token_ids,
                          "computed": res.computed_tokens, "prompt": res.prompt_tokens}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["missed"] == [] and set(got["hits"]) == {"nile", "eiffel"}
    assert got["tokens"] == list(expected.token_ids)
    # only what this process computes anyway was computed: the question (and the default recovery's module)
    assert got["computed"] == expected.computed_tokens < got["prompt"] - 25


@pytest.mark.smollm
def test_a_store_attached_for_a_schema_holds_its_modules_and_only_its(smollm):
    """What lets corpora share one model (rag/corpora.py): schema `other` (and its `.ingest` twin) reads and
    writes the store attached for it; every other schema, the engine's own."""
    model, tokenizer = smollm
    own, attached = MemoryStore(), MemoryStore()
    engine = PromptCache(model, tokenizer, store=own)
    engine.add_schema(SCHEMA)
    engine.add_schema(SCHEMA.replace('name="facts"', 'name="other"'))
    engine.add_schema(SCHEMA.replace('name="facts"', 'name="other.ingest"'))
    engine.attach_store("other", attached)
    assert engine.store_of("other") is engine.store_of("other.ingest") is attached and engine.store_of("facts") is own
    engine.generate(PROMPT.replace('schema="facts"', 'schema="other"'), max_new_tokens=2)
    assert attached.stats().num_entries > 0 and own.stats().num_entries == 0
    engine.encode("facts")
    held = own.stats().num_entries
    assert held > 0 and engine.is_cached("facts", "nile") and engine.is_cached("other", "nile")
    engine.encode("other.ingest")  # an ingest batch's twin: into the store attached for `other`
    assert own.stats().num_entries == held and attached.stats().num_entries >= 2
    with pytest.raises(ValueError, match="already has a store attached"):
        engine.attach_store("other", MemoryStore())
    with pytest.raises(ValueError, match="without a dot"):
        engine.attach_store("a.b", MemoryStore())
    assert engine.detach_store("other") is attached and engine.store_of("other") is own
