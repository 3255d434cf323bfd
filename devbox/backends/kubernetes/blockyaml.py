"""The YAML that kubectl, kind, kwokctl and client-go write for a kubeconfig, read without
PyYAML: block mappings and sequences of plain or quoted strings, true and false, null,
empty {} and []. Importing PyYAML costs 12-25 ms of every command; this reads the common
file in well under a millisecond.

What this reads, it reads as yaml.safe_load does (tests/k8s/test_blockyaml.py holds the two
to each other). Anything else raises Unsupported, and the caller hands the text to PyYAML:
flow collections with content, anchors, tags, block scalars, escapes, comments after a
value, and any plain scalar that PyYAML might read as other than a string (a number, a
date, yes/no/on/off).
"""

from __future__ import annotations

import re
from typing import Any


class Unsupported(Exception):
    """Not in the subset read here: read it with PyYAML."""


_KEY = re.compile(r"([A-Za-z_/][A-Za-z0-9_./-]*):(?: +(.*))?")
# A plain scalar PyYAML reads as a string for certain: it starts with a letter, / or _
# (not a digit, sign or dot: no number or date; not an indicator), never has ": " or " #"
# or ends with ":", and has no character outside this set.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:@=+~,%()-]*(?: [A-Za-z0-9_./:@=+~,%()-]+)*")
_NULL = {"null", "Null", "NULL", "~"}
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
# YAML 1.1 booleans (PyYAML's resolver), left to PyYAML.
_OTHER_BOOL = {"yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"}


def load(text: str) -> Any:
    lines: list[tuple[int, str]] = []
    for raw in text.split("\n"):
        line = raw.rstrip("\r")
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        if "\t" in line or stripped.startswith(("---", "...", "%")):
            raise Unsupported("tab, document marker or directive")
        lines.append((len(line) - len(stripped), stripped.rstrip(" ")))
    if not lines:
        return None
    value, at = _block(lines, 0, lines[0][0])
    if at != len(lines):
        raise Unsupported(f"line {at}: not in the block structure")
    return value


def _is_item(content: str) -> bool:
    return content == "-" or content.startswith("- ")


def _block(lines: list[tuple[int, str]], at: int, indent: int) -> tuple[Any, int]:
    if _is_item(lines[at][1]):
        return _sequence(lines, at, indent)
    if _KEY.fullmatch(lines[at][1]) is None:
        raise Unsupported(f"line {at}: neither a key nor an item")
    return _mapping(lines, at, indent)


def _mapping(lines: list[tuple[int, str]], at: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while at < len(lines) and lines[at][0] == indent and not _is_item(lines[at][1]):
        match = _KEY.fullmatch(lines[at][1])
        if match is None:
            raise Unsupported(f"line {at}: not a key")
        key, rest = match.group(1), match.group(2)
        if key in _NULL or key in _BOOL or key in _OTHER_BOOL or key.endswith(":"):
            raise Unsupported(f"line {at}: a key PyYAML reads as other than a string")
        at += 1
        if rest is not None:
            out[key] = _scalar(rest)
            continue
        nested = at < len(lines) and (
            lines[at][0] > indent or (lines[at][0] == indent and _is_item(lines[at][1]))
        )
        if nested:
            out[key], at = _block(lines, at, lines[at][0])
        else:
            out[key] = None
    if at < len(lines) and lines[at][0] > indent:
        raise Unsupported(f"line {at}: indented under a scalar")
    return out, at


def _sequence(lines: list[tuple[int, str]], at: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while at < len(lines) and lines[at][0] == indent and _is_item(lines[at][1]):
        rest = lines[at][1][1:]
        inner = rest.lstrip(" ")
        if not inner:
            at += 1
            if at < len(lines) and lines[at][0] > indent:
                value, at = _block(lines, at, lines[at][0])
                out.append(value)
            else:
                out.append(None)
            continue
        if _KEY.fullmatch(inner) is not None:
            # "- key: value": a mapping whose keys line up with this first one.
            column = indent + 1 + len(rest) - len(inner)
            lines[at] = (column, inner)
            value, at = _mapping(lines, at, column)
            out.append(value)
            continue
        if inner.startswith(("- ", "-")) and _is_item(inner):
            raise Unsupported(f"line {at}: a sequence in a sequence on one line")
        out.append(_scalar(inner))
        at += 1
    if at < len(lines) and lines[at][0] > indent:
        raise Unsupported(f"line {at}: indented under an item")
    return out, at


def _scalar(text: str) -> Any:
    if text in ("{}", "[]"):
        return {} if text == "{}" else []
    if text.startswith("'"):
        inner = text[1:-1]
        if len(text) < 2 or not text.endswith("'") or "'" in inner.replace("''", ""):
            raise Unsupported("single-quoted scalar")
        return inner.replace("''", "'")
    if text.startswith('"'):
        inner = text[1:-1]
        if len(text) < 2 or not text.endswith('"') or '"' in inner or "\\" in inner:
            raise Unsupported("double-quoted scalar")
        return inner
    if text in _BOOL:
        return _BOOL[text]
    if text in _NULL:
        return None
    if text in _OTHER_BOOL or _PLAIN.fullmatch(text) is None or text.endswith(":"):
        raise Unsupported(f"plain scalar {text[:20]!r}")
    if ": " in text or " #" in text:
        raise Unsupported("plain scalar with ': ' or ' #'")
    return text
