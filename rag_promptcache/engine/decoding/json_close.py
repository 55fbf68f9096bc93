"""The shortest text that ends a JSON value begun: what a constrained answer writes when its token budget
is about to run out, so that it stops as valid JSON instead of being cut inside a key.

    closing('{"name": "zorb')          -> '"}'
    closing('{"a": [1, {"b": tr')      -> 'ue}]}'
    closing('{"tools": {"toolname_js') -> '":0}}'

A pure function of the text so far (no tokens, no torch): one pass over it keeps the open containers, and
whether it stands inside a string (a key or a value), an escape, a number or a literal, and what the
grammar expects next. The text is taken to be a prefix of JSON (the grammar let nothing else through);
anything else gives None. What it must complete it completes the shortest way: a pending value is `0`,
a key that must follow a comma is `"_"`, an unfinished number gets a digit, a literal its letters, an
escape `n`, `\\u` escape's digits `0`s.

Out of scope: what a schema requires besides well-formed JSON (the grammar checks each closing token
and refuses one the schema does not allow: engine/decoding/grammar.py `GrammarState.closing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LITERALS = ("true", "false", "null")
WHITESPACE = " \t\n\r"
# what comes next, outside strings, numbers and literals
VALUE, FIRST_VALUE, KEY, FIRST_KEY, COLON, AFTER, DONE = "value", "first_value", "key", "first_key", "colon", "after", "done"


@dataclass(slots=True)
class _Scan:
    stack: list[str] = field(default_factory=list)  # "{" or "["
    expect: str = VALUE
    string: str | None = None  # "key" or "value" inside a string
    escape: int = 0  # -1: a backslash just read; n > 0: hex digits of a \u escape still to come
    number: str = ""  # the number being read
    literal: str = ""  # the literal being read

    def after_value(self) -> None:
        self.expect = AFTER if self.stack else DONE


def closing(text: str) -> str | None:
    """The shortest text that completes the JSON value `text` begins ("" when it is complete), or None
    where `text` is not the beginning of one JSON value."""
    s = _Scan()
    for ch in text:
        if not _step(s, ch):
            return None
    out = ""
    if s.string is not None:
        out += "n" if s.escape == -1 else "0" * max(s.escape, 0)
        out += '"'
        if s.string == "key":
            out += ":0"
    elif s.number:
        out += "0" if s.number[-1] in "-+.eE" else ""
    elif s.literal:
        out += next(w for w in LITERALS if w.startswith(s.literal))[len(s.literal):]
    elif s.expect in (VALUE,):
        out += "0" if s.stack else "{}"
    elif s.expect == KEY:
        out += '"_":0'
    elif s.expect == COLON:
        out += ":0"
    return out + "".join("}" if c == "{" else "]" for c in reversed(s.stack))


def _step(s: _Scan, ch: str) -> bool:
    """Read one character; False where the text stops being a prefix of JSON."""
    if s.string is not None:
        if s.escape == -1:
            s.escape = 4 if ch == "u" else 0
            return ch in '"\\/bfnrtu'
        if s.escape > 0:
            s.escape -= 1
            return ch in "0123456789abcdefABCDEF"
        if ch == "\\":
            s.escape = -1
        elif ch == '"':
            kind, s.string = s.string, None
            if kind == "key":
                s.expect = COLON
            else:
                s.after_value()
        return True
    if s.literal:
        word = next((w for w in LITERALS if w.startswith(s.literal + ch)), None)
        if word is not None:
            s.literal += ch
            if s.literal == word:
                s.literal = ""
                s.after_value()
            return True
        return False
    if s.number:
        if ch in "0123456789+-.eE":
            s.number += ch
            return True
        s.number = ""
        s.after_value()
    if ch in WHITESPACE:
        return True
    if s.expect in (VALUE, FIRST_VALUE):
        return _value(s, ch)
    if s.expect in (KEY, FIRST_KEY):
        if ch == '"':
            s.string = "key"
            return True
        if ch == "}" and s.expect == FIRST_KEY:
            s.stack.pop()
            s.after_value()
            return True
        return False
    if s.expect == COLON:
        s.expect = VALUE
        return ch == ":"
    if s.expect == AFTER:
        if ch == ",":
            s.expect = KEY if s.stack[-1] == "{" else VALUE
            return True
        if ch == ("}" if s.stack[-1] == "{" else "]"):
            s.stack.pop()
            s.after_value()
            return True
    return False


def _value(s: _Scan, ch: str) -> bool:
    if ch == "{":
        s.stack.append("{")
        s.expect = FIRST_KEY
    elif ch == "[":
        s.stack.append("[")
        s.expect = FIRST_VALUE
    elif ch == '"':
        s.string = "value"
    elif ch in "-0123456789":
        s.number = ch
    elif ch in "tfn":
        s.literal = ch
    elif ch == "]" and s.expect == FIRST_VALUE:
        s.stack.pop()
        s.after_value()
    else:
        return False
    return True
