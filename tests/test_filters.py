"""The filter language (rag/filters.py) as pure bookkeeping: no corpus, no index, no tensors. Each
operator on the values chunks carry, LangChain's dict shapes, `--where` clauses, and refusals that name
what is valid."""

from __future__ import annotations

import pytest

from rag_promptcache.rag.filters import OPERATORS, Filter, where

CHUNK = {"source": "guide/fs.md", "path": "/docs/guide/fs.md", "type": "md", "title": "Files",
         "modified": "2026-03-04T10:00:00Z", "section": "Options › Sync", "year": 2021, "tags": ["io", "disk"],
         "draft": False}


def matches(spec: dict, record: dict = CHUNK) -> bool:
    flt = Filter.parse(spec)
    assert flt is not None
    return flt.matches(record)


@pytest.mark.parametrize("spec, want", [
    ({"source": "guide/fs.md"}, True),
    ({"source": "guide/net.md"}, False),
    ({"year": 2021}, True),
    ({"year": "2021"}, True),  # a CLI value and a stored number are the same year
    ({"year": {"$ne": 2021}}, False),
    ({"type": ["md", "html"]}, True),  # a list is one-of
    ({"type": {"$in": ["pdf", "html"]}}, False),
    ({"type": {"$nin": ["pdf", "html"]}}, True),
    ({"tags": "disk"}, True),  # a list field matches by its items
    ({"tags": {"$in": ["net", "io"]}}, True),
    ({"tags": {"$nin": ["io"]}}, False),
    ({"draft": False}, True),
    ({"draft": 0}, False),  # a boolean equals only a boolean
    ({"year": {"$gte": 2020}}, True),
    ({"year": {"$gt": 2021}}, False),
    ({"year": {"$gte": 2020, "$lt": 2022}}, True),  # a range: both bounds hold
    ({"year": {"$lte": 2020.5}}, False),
    ({"modified": {"$gte": "2026-03-01"}}, True),  # dates compare as dates
    ({"modified": {"$lt": "2026-03-04T09:00:00+00:00"}}, False),
    ({"modified": {"$gt": 1772000000}}, True),  # ... and with epoch seconds
    ({"source": {"$prefix": "guide/"}}, True),
    ({"path": {"$glob": "/docs/*/fs.*"}}, True),
    ({"source": {"$glob": "*.html"}}, False),
    ({"section": {"$glob": "Options*"}}, True),
    ({"source": "guide/fs.md", "year": 2020}, False),  # several keys: all must hold
    ({"$or": [{"year": 2020}, {"type": "md"}]}, True),
    ({"$and": [{"year": 2021}, {"$or": [{"type": "pdf"}, {"title": "Files"}]}]}, True),
    ({"missing": {"$ne": 1}}, True),  # a chunk without the key: only $ne and $nin hold
    ({"missing": 1}, False),
    ({"title": {"$gt": "A"}}, True),  # other strings compare as text
    ({"year": {"$gt": "A"}}, False),  # a number never orders against text
])
def test_each_operator(spec: dict, want: bool) -> None:
    assert matches(spec) is want, spec


def test_shapes_and_canonical_form() -> None:
    assert Filter.parse(None) is None and Filter.parse({}) is None
    a = Filter.parse({"year": {"$gte": 2020}, "type": "md"})
    b = Filter.parse({"type": {"$eq": "md"}, "year": {"$gte": 2020}})
    assert a.keys() == b.keys() == {"year", "type"}
    assert str(Filter.parse(a.to_dict())) == str(a)  # round-trips
    assert Filter.parse(a) is a
    assert Filter.parse({"$or": [{"a": 1}, {"b": {"$in": [1, 2]}}]}).keys() == {"a", "b"}


@pytest.mark.parametrize("spec, needle", [
    ({"year": {"$between": [1, 2]}}, "unknown filter operator '$between' for key 'year'; valid: " + ", ".join(OPERATORS)),
    ({"$not": [{"a": 1}]}, "valid: $and, $or"),
    ({"$or": []}, "$or takes a non-empty list"),
    ({"$and": [1]}, "each part of $and/$or is a non-empty dict"),
    ({"year": {}}, "an empty operator dict"),
    ({"type": {"$in": "md"}}, "$in takes a non-empty list"),
    ({"year": {"$gte": None}}, "$gte takes a number"),
    ({"year": {"$gte": [1]}}, "compares with a string, number"),
    ({"source": {"$glob": 3}}, "$glob takes a string"),
    ({"year": {"$lt": float("nan")}}, "a finite number"),
    ("source=a", "a filter is a dict"),
])
def test_malformed_filters_are_refused_by_name(spec, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        Filter.parse(spec)
    assert needle in str(e.value)


def test_nesting_is_bounded() -> None:
    spec: dict = {"a": 1}
    for _ in range(40):
        spec = {"$and": [spec]}
    with pytest.raises(ValueError, match="at most 16 deep"):
        Filter.parse(spec)


def test_unknown_keys_are_named_with_the_valid_ones() -> None:
    flt = Filter.parse({"yaer": 2021, "$or": [{"type": "md"}, {"tilte": "x"}]})
    with pytest.raises(ValueError) as e:
        flt.check_keys(CHUNK, note="a note")
    assert str(e.value) == ("unknown filter key(s) 'tilte', 'yaer'; valid: draft, modified, path, section, source, tags, "
                            "title, type, year (a note)")
    Filter.parse({"year": 1}).check_keys(CHUNK)  # known: no error


def test_where_clauses() -> None:
    flt = where(["type=md", "type=html", "year>=2020", "year<2023", "source~guide/*", "title!=Draft", "draft=false"])
    assert flt is not None and flt.matches(CHUNK)
    assert not flt.matches({**CHUNK, "type": "pdf"}) and not flt.matches({**CHUNK, "year": 2023})
    assert where(["version=1.10"]).matches({"version": "1.10"})  # not a JSON number's 1.1: the text stays
    assert where(["section=Options › Sync"]).matches(CHUNK)
    assert where(["a>=b=c"]).to_dict() == {"$and": [{"a": {"$gte": "b=c"}}]}  # the first operator splits
    assert where(['{"year": {"$gt": 2000}}']).matches(CHUNK)
    assert where([]) is None
    for bad, needle in (("year", "expected KEY=VALUE"), ("=2", "no key before '='"), ("{bad", "not valid JSON")):
        with pytest.raises(ValueError, match=needle):
            where([bad])
