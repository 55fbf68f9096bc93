"""PML mistakes a user makes: an omitted parameter, a schema name registered twice, and error
messages about the plain (schema-less) prompt, which must never show an empty schema name."""

from __future__ import annotations

import pytest

from rag_promptcache import PMLError
from rag_promptcache.engine import PromptCache
from rag_promptcache.pml import ast
from rag_promptcache.store import MemoryStore
from tests.tiny import build

SCHEMA = """<schema name="s">
  <module name="trip">Plan a trip for <param name="duration" len="4"/> around the city.</module>
  <module name="a">The quick brown fox.</module>
</schema>"""


@pytest.fixture(scope="module")
def pc(tokenizer):
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never")
    pc.add_schema(SCHEMA)
    return pc


def test_an_omitted_parameter_is_an_error_naming_it(pc):
    with pytest.raises(PMLError, match=r"module 'trip' needs its parameter 'duration'.*<trip duration=") as e:
        pc.generate('<prompt schema="s">\n<trip/> Go.</prompt>', max_new_tokens=1)
    assert (e.value.line, e.value.column) == (2, 1)
    record = ast.Prompt("s", (ast.Import("trip", ()), ast.Text(" Go.")))  # built in Python, not parsed
    with pytest.raises(PMLError, match="needs its parameter 'duration'"):
        pc.generate(record, max_new_tokens=1)
    pc.generate('<prompt schema="s"><trip duration=""/> Go.</prompt>', max_new_tokens=1)  # empty is explicit


def test_add_schema_refuses_other_content_under_a_registered_name(pc):
    same = pc.add_schema("\n\n" + SCHEMA)  # the same content at other source lines: a no-op
    assert same is pc.schema("s")
    other = SCHEMA.replace("The quick brown fox.", "A slow red hen.")
    with pytest.raises(ValueError, match=r"schema 's' is already registered with other content; pass replace=True"):
        pc.add_schema(other)
    assert pc.plan('<prompt schema="s"><a/> Go.</prompt>').kvs["a"] is not None  # the old one still works
    pc.add_schema(other, replace=True)
    assert "slow red hen" in pc.tokenizer.decode(pc.plan('<prompt schema="s"><a/> Go.</prompt>').kvs["a"].token_ids)
    pc.add_schema(SCHEMA, replace=True)
    with pytest.raises(ValueError, match="non-empty name"):
        pc.add_schema(ast.Schema("", ()))


def test_errors_never_show_an_empty_schema_name(pc):
    with pytest.raises(PMLError) as e:
        pc.generate('<prompt schema="nope"><a/></prompt>')
    assert e.value.message.endswith("known: s") and "''" not in str(e.value)
    with pytest.raises(ValueError) as e:
        pc.schema("nope")
    assert str(e.value) == "unknown schema 'nope'; known: 's'"
    with pytest.raises(PMLError) as e:
        pc.generate(ast.Prompt("", (ast.Import("a", ()), ast.Text("Go."))))
    assert "''" not in str(e.value) and "a prompt without a schema" in str(e.value)
