""".gitignore rules for the SFTP sync (rsync reads them itself through a dir-merge filter).

Git's rules, as far as a working tree needs them: a `.gitignore` applies to its folder and
below; the last matching line wins; `!` re-includes; a trailing `/` matches folders only; a
pattern with a slash before its end is anchored to the `.gitignore`'s folder, one without
matches a name at any depth; `*` and `?` stay within one path part, `**` spans parts; a
folder that is excluded is not entered (git cannot re-include what is under it). `.git`
itself is never synced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    base: str  # the folder of its .gitignore, relative to the tree ("" at the top)
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _glob(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("/.*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append(f"[{'^' + body[1:] if body.startswith('!') else body}]")
            i = end + 1
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def parse(text: str, base: str) -> list[Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        body = _glob(line)
        regex = re.compile(f"^{body}$" if anchored else f"^(?:.*/)?{body}$")
        rules.append(Rule(base, regex, negate, dir_only))
    return rules


def ignored(rules: list[Rule], rel: str, *, is_dir: bool) -> bool:
    verdict = False
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.base:
            if not rel.startswith(rule.base + "/"):
                continue
            sub = rel[len(rule.base) + 1 :]
        else:
            sub = rel
        if rule.regex.match(sub):
            verdict = not rule.negate
    return verdict


def walk(root: Path) -> Iterator[str]:
    """Every file of the tree that git would not ignore, as a relative POSIX path.
    Symbolic links to folders are not followed; links to files are synced as files."""

    def visit(folder: Path, rel: str, rules: list[Rule]) -> Iterator[str]:
        here = folder / ".gitignore"
        if here.is_file():
            rules = rules + parse(here.read_text(errors="replace"), rel)
        with os.scandir(folder) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            if entry.name == ".git":
                continue
            path = f"{rel}/{entry.name}" if rel else entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if ignored(rules, path, is_dir=is_dir):
                continue
            if is_dir:
                yield from visit(Path(entry.path), path, rules)
            elif entry.is_file():
                yield path

    yield from visit(root, "", [])
