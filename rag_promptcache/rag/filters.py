"""Metadata filters: which chunks a search may return, in the shape LangChain's vector stores take.

A filter is a dict: `{"source": "fs.md"}` (equality), `{"year": {"$gte": 2020}}` (an operator),
several keys at once (all must hold), `{"$and": [...]}` and `{"$or": [...]}` of filters, and a list
value as one-of (`{"lang": ["en", "de"]}`, the same as `$in`). Operators: `OPERATORS`. A key a chunk
does not have never matches, except under `$ne` and `$nin`. A metadata value that is a list (a record's
`tags`) matches equality and one-of when any of its items does. Ranges compare numbers as numbers and
dates as dates: an ISO-8601 date or date-time (`"2026-01-31"`, `"2026-01-31T12:00:00Z"`) and a number
of seconds since the epoch compare with each other; other strings compare as text. `$prefix` and `$glob`
(`fnmatch`: `*`, `?`, `[...]`; `*` crosses `/`) match strings, such as a path.

`Filter.parse` checks the shape and the operators; `Filter.check_keys` refuses a key the corpus's
chunks do not carry, naming the valid ones (the corpus calls it). `where` reads the CLI's `--where`.

Pure bookkeeping: no tables, no indexes. Not here: which chunks carry what (`metadata.py`), the
search that applies a filter (`retrieval.py`).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

COMPARISONS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")
OPERATORS = (*COMPARISONS, "$in", "$nin", "$prefix", "$glob")
LOGICAL = ("$and", "$or")
# `--where` operators, longest first so that `>=` is not read as `>`
WHERE_OPERATORS = {">=": "$gte", "<=": "$lte", "!=": "$ne", "~": "$glob", ">": "$gt", "<": "$lt", "=": "$eq"}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}:?\d{2})?$")
MAX_DEPTH = 16  # levels of $and/$or
Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Condition:
    """One key's test: `key op value` (`value`: a tuple for `$in`/`$nin`)."""

    key: str
    op: str
    value: Scalar | tuple[Scalar, ...]

    def matches(self, record: Mapping[str, object]) -> bool:
        if self.key not in record or record[self.key] is None:
            return self.op in ("$ne", "$nin")
        got = record[self.key]
        items = list(got) if isinstance(got, (list, tuple)) else [got]
        if self.op in ("$eq", "$in"):
            wanted = self.value if isinstance(self.value, tuple) else (self.value,)
            return any(_equal(i, w) for i in items for w in wanted)
        if self.op in ("$ne", "$nin"):
            wanted = self.value if isinstance(self.value, tuple) else (self.value,)
            return not any(_equal(i, w) for i in items for w in wanted)
        if self.op in ("$prefix", "$glob"):
            test = str.startswith if self.op == "$prefix" else fnmatch.fnmatchcase
            return any(isinstance(i, str) and test(i, str(self.value)) for i in items)
        return any(_ordered(i, self.op, self.value) for i in items)

    def to_dict(self) -> dict[str, object]:
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return {self.key: {self.op: value}}


@dataclass(frozen=True, slots=True)
class Filter:
    """`$and` or `$or` over conditions and filters; what `parse` returns."""

    op: str
    parts: tuple[Condition | Filter, ...]

    @classmethod
    def parse(cls, spec: Filter | Mapping[str, object] | None) -> Filter | None:
        """A filter from its dict (see the module docstring); None for None or `{}`. `ValueError` naming
        what is wrong and what is valid."""
        if spec is None or isinstance(spec, Filter):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"a filter is a dict such as {{\"source\": \"guide.md\"}}, got a {type(spec).__name__}")
        return cls._parse(spec, 1) if spec else None

    @classmethod
    def _parse(cls, spec: Mapping[str, object], depth: int) -> Filter:
        if depth > MAX_DEPTH:
            raise ValueError(f"a filter nests $and/$or at most {MAX_DEPTH} deep")
        if not isinstance(spec, Mapping) or not spec:
            raise ValueError(f"each part of $and/$or is a non-empty dict such as {{\"source\": \"guide.md\"}}, got {spec!r}")
        parts: list[Condition | Filter] = []
        for key, value in spec.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"a filter key is a non-empty string, got {key!r}")
            if key.startswith("$"):
                if key not in LOGICAL:
                    raise ValueError(f"unknown filter operator {key!r} at the top of a filter; valid: {', '.join(LOGICAL)} "
                                     f"(and, under a key, {', '.join(OPERATORS)})")
                if not isinstance(value, Sequence) or isinstance(value, str) or not value:
                    raise ValueError(f"{key} takes a non-empty list of filters, got {value!r}")
                subs = [cls._parse(v, depth + 1) for v in value]
                # a one-key dict inside $and/$or is that key's condition, not an $and of one
                parts.append(cls(key, tuple(f.parts[0] if f.op == "$and" and len(f.parts) == 1 else f for f in subs)))
            elif isinstance(value, Mapping):
                if not value:
                    raise ValueError(f"filter key {key!r}: an empty operator dict; valid operators: {', '.join(OPERATORS)}")
                parts += [_condition(key, op, v) for op, v in value.items()]
            elif isinstance(value, (list, tuple)):
                parts.append(_condition(key, "$in", value))
            else:
                parts.append(_condition(key, "$eq", value))
        return parts[0] if len(parts) == 1 and isinstance(parts[0], Filter) else cls("$and", tuple(parts))

    def matches(self, record: Mapping[str, object]) -> bool:
        test = all if self.op == "$and" else any
        return test(p.matches(record) for p in self.parts)

    def keys(self) -> frozenset[str]:
        """Every metadata key the filter names."""
        return frozenset(k for p in self.parts for k in (p.keys() if isinstance(p, Filter) else (p.key,)))

    def check_keys(self, valid: Iterable[str], note: str = "") -> None:
        """`ValueError` naming each key the filter names that is not in `valid`, and the valid keys
        (then `note`, what a caller can do about a missing one)."""
        valid = sorted(set(valid))
        if unknown := sorted(self.keys() - set(valid)):
            raise ValueError(f"unknown filter key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}"
                             + (f" ({note})" if note else ""))

    def to_dict(self) -> dict[str, object]:
        return {self.op: [p.to_dict() for p in self.parts]}

    def __str__(self) -> str:
        """Canonical JSON: equal filters print the same, so it keys a cache."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)


def _condition(key: str, op: str, value: object) -> Condition:
    if op not in OPERATORS:
        raise ValueError(f"unknown filter operator {op!r} for key {key!r}; valid: {', '.join(OPERATORS)}")
    if op in ("$in", "$nin"):
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{key!r}: {op} takes a non-empty list of values, got {value!r}")
        return Condition(key, op, tuple(_scalar(key, op, v) for v in value))
    value = _scalar(key, op, value)
    if op in ("$prefix", "$glob") and not isinstance(value, str):
        raise ValueError(f"{key!r}: {op} takes a string, got {value!r}")
    if op in ("$gt", "$gte", "$lt", "$lte") and (value is None or isinstance(value, bool) or _rank(value) is None):
        raise ValueError(f"{key!r}: {op} takes a number, an ISO-8601 date or a string, got {value!r}")
    return Condition(key, op, value)


def _scalar(key: str, op: str, value: object) -> Scalar:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{key!r}: {op} compares with a string, number, boolean or null, got a {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key!r}: {op} takes a finite number, got {value!r}")
    return value


def _rank(value: object) -> tuple[str, float | str] | None:
    """What a value orders by: ("n", a number; dates as epoch seconds) or ("s", text); None: unordered."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return ("n", float(value))
    if isinstance(value, str):
        if _DATE.match(value.strip()):
            try:
                when = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            except ValueError:
                return ("s", value)
            return ("n", (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp())
        return ("s", value)
    return None


def _equal(got: object, want: Scalar) -> bool:
    """Equality across the forms a value takes: 2021 and "2021", two spellings of one date; a boolean
    equals only a boolean."""
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want
    if got == want:
        return True
    a, b = _rank(got), _rank(want)
    if a is not None and b is not None and a[0] == b[0] == "n":
        return a == b
    return isinstance(got, (str, int, float)) and isinstance(want, (str, int, float)) and str(got) == str(want)


def _ordered(got: object, op: str, bound: Scalar) -> bool:
    a, b = _rank(got), _rank(bound)
    if a is None or b is None or a[0] != b[0]:
        return False
    return {"$gt": a > b, "$gte": a >= b, "$lt": a < b, "$lte": a <= b}[op]


def where(clauses: Sequence[str]) -> Filter | None:
    """The CLI's `--where` clauses as one filter: `KEY=VALUE` (a repeated key: one of its values),
    `KEY!=VALUE`, `KEY>VALUE`, `KEY>=VALUE`, `KEY<VALUE`, `KEY<=VALUE`, `KEY~GLOB`; all must hold. A
    value that reads as a JSON number, true, false or null is one; anything else is a string. A clause
    starting with `{` is a filter as JSON. `ValueError` naming the clause and the forms."""
    parts: list[dict[str, object]] = []
    same: dict[str, list[object]] = {}
    for clause in clauses:
        if clause.lstrip().startswith("{"):
            try:
                parts.append(json.loads(clause))
            except json.JSONDecodeError as e:
                raise ValueError(f"--where {clause!r}: not valid JSON ({e.msg} at column {e.colno})") from e
            continue
        at = [(clause.find(sym), sym) for sym in WHERE_OPERATORS if sym in clause]
        if not at:
            raise ValueError(f"--where {clause!r}: expected KEY=VALUE (or KEY!=, KEY>, KEY>=, KEY<, KEY<=, KEY~GLOB, "
                             "or a JSON filter)")
        index = min(i for i, _ in at)
        sym = max((s for i, s in at if i == index), key=len)
        key, value = clause[:index].strip(), _value(clause[index + len(sym):].strip())
        if not key:
            raise ValueError(f"--where {clause!r}: no key before {sym!r}")
        if sym == "=":
            same.setdefault(key, []).append(value)
        else:
            parts.append({key: {WHERE_OPERATORS[sym]: value}})
    parts += [{k: v[0] if len(v) == 1 else {"$in": v}} for k, v in same.items()]
    if not parts:
        return None
    return Filter.parse(parts[0] if len(parts) == 1 else {"$and": parts})


def _value(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    # a number only where it reads back the same: "1.10" (a version) stays text
    return value if value is None or isinstance(value, bool) or (isinstance(value, (int, float)) and json.dumps(value) == text) else text
