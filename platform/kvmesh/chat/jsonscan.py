"""A JSON scanner that tells a value that is still arriving from one that is wrong.

Tool-call parsers read model output as it streams: at any moment the text holds a JSON
prefix that may be a valid start (`{"name": "f", "argum`), complete, or already invalid
(`{"name": f`). `json.loads` cannot tell the first from the last, so this module scans
JSON by hand and reports, per value, where it starts and where it ends (None while it
continues past the text). It never decodes numbers or builds values; `json.loads` on a
complete span does that. Invariant: a span reported complete on a prefix is the same on
every longer text, and a text reported invalid stays invalid, so a streaming parser may
act on either as soon as it sees it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("+-.eE0123456789")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


class Invalid(ValueError):
    """The text cannot be (the start of) the expected JSON."""


class Incomplete(Exception):
    """The text ends inside the value (it may still become valid)."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int:
    """End of the JSON string starting at `s[i] == '"'` (the index after its closing quote)."""
    j = i + 1
    n = len(s)
    while j < n:
        c = s[j]
        if c == '"':
            return j + 1
        if c == "\\":
            if j + 1 >= n:
                raise Incomplete
            e = s[j + 1]
            if e == "u":
                hexes = s[j + 2:j + 6]
                if any(h not in _HEX for h in hexes):
                    raise Invalid(f"bad \\u escape at {j}")
                if len(hexes) < 4:
                    raise Incomplete
                j += 6
                continue
            if e not in _ESCAPES:
                raise Invalid(f"bad escape at {j}")
            j += 2
            continue
        if c < " ":
            raise Invalid(f"control character in a string at {j}")
        j += 1
    raise Incomplete


def value_end(s: str, i: int) -> int:
    """End of the JSON value starting at `s[i]` (no leading whitespace)."""
    if i >= len(s):
        raise Incomplete
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c == "{":
        return object_scan(s, i).end_or_raise()
    if c == "[":
        return _array_end(s, i)
    if c in _NUMBER_CHARS:
        j = i
        while j < len(s) and s[j] in _NUMBER_CHARS:
            j += 1
        if j == len(s):
            if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d*)?)?", s[i:j]):
                raise Invalid(f"bad number at {i}")
            raise Incomplete  # digits may follow
        if _NUMBER.fullmatch(s, i, j) is None:
            raise Invalid(f"bad number at {i}")
        return j
    for literal in ("true", "false", "null"):
        if s.startswith(literal, i):
            return i + len(literal)
        if literal.startswith(s[i:]):
            raise Incomplete
    raise Invalid(f"unexpected {c!r} at {i}")


def _array_end(s: str, i: int) -> int:
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "]":
        return j + 1
    while True:
        j = value_end(s, j)
        j = skip_ws(s, j)
        if j >= len(s):
            raise Incomplete
        if s[j] == "]":
            return j + 1
        if s[j] != ",":
            raise Invalid(f"expected ',' or ']' at {j}")
        j = skip_ws(s, j + 1)


@dataclass
class Member:
    """One `"key": value` of an object: the decoded key, where its value starts
    (None while only the key has arrived) and ends (None while it continues)."""

    key: str
    start: int | None = None
    end: int | None = None


@dataclass
class ObjectScan:
    """An object's members as far as the text goes; `end` is None while it continues."""

    members: list[Member]
    end: int | None

    def end_or_raise(self) -> int:
        if self.end is None:
            raise Incomplete
        return self.end

    def get(self, key: str) -> Member | None:
        return next((m for m in self.members if m.key == key), None)


def object_scan(s: str, i: int) -> ObjectScan:
    """The members of the object starting at `s[i] == '{'`, as far as `s` goes.
    Raises Invalid as soon as the text cannot be an object (duplicate keys included)."""
    members: list[Member] = []
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return ObjectScan(members, j + 1)
    while True:
        if j >= len(s):
            return ObjectScan(members, None)
        if s[j] != '"':
            raise Invalid(f"expected a key at {j}")
        try:
            k_end = string_end(s, j)
        except Incomplete:
            return ObjectScan(members, None)
        key = json.loads(s[j:k_end])
        if any(m.key == key for m in members):
            raise Invalid(f"duplicate key {key!r}")
        member = Member(key)
        members.append(member)
        j = skip_ws(s, k_end)
        if j >= len(s):
            return ObjectScan(members, None)
        if s[j] != ":":
            raise Invalid(f"expected ':' at {j}")
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return ObjectScan(members, None)
        member.start = j
        try:
            member.end = value_end(s, j)
        except Incomplete:
            return ObjectScan(members, None)
        j = skip_ws(s, member.end)
        if j >= len(s):
            return ObjectScan(members, None)
        if s[j] == "}":
            return ObjectScan(members, j + 1)
        if s[j] != ",":
            raise Invalid(f"expected ',' or '}}' at {j}")
        j = skip_ws(s, j + 1)
