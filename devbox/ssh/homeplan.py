"""What a home copy (devbox.ssh.homecopy) does, decided from two listings: pure, so the
rules are tested without SSH.

A listing maps a path relative to its root to an Entry, as SFTP's READDIR reports it
(lstat: a link is a link, never what it points to). The destination's listing holds only
the folders that are folders on both sides: below anything else nothing of it is read.

The rules, each for not losing work on the destination:
- nothing there is deleted, but for the partial files an interrupted copy left (the
  temporary names below, which no user picks);
- a regular file is sent when the destination has nothing there, or an older entry, or one
  of the same time but another size (rsync's quick check, in whole seconds as SFTP v3
  carries them); an entry newer there is kept and reported;
- a link is sent as a link (its target text), under the same newer-wins rule;
- a folder is made where the destination has none; where it has something else (a file, a
  link that may point anywhere) the folder's subtree is skipped: making it would delete
  what is there, and writing into a link would write wherever it points;
- a file or link where the destination has a folder is skipped (replacing a folder is
  deleting it);
- fifos, sockets and devices are skipped: they are not data.
"""

from __future__ import annotations

import enum
import posixpath
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from devbox.errors import UsageError

# A temporary file's name while its data is on the way; renamed over the real name after.
# Leading dot: hidden from `ls`; fixed length: fits any folder whatever the file's name.
TEMP_PREFIX = ".devbox-partial-"
_TEMP = re.compile(re.escape(TEMP_PREFIX) + "[0-9a-f]{16}")


class Kind(enum.StrEnum):
    FILE = "file"
    FOLDER = "folder"
    LINK = "symlink"
    FIFO = "fifo"
    SOCKET = "socket"
    DEVICE = "device"
    OTHER = "special file"


@dataclass(frozen=True)
class Entry:
    kind: Kind
    size: int = 0
    mtime: int = 0  # whole seconds
    mode: int = 0  # permission bits
    target: str = ""  # a link's target, as text
    error: str = ""  # a folder that could not be listed: why


Listing = Mapping[str, Entry]


@dataclass(frozen=True)
class Plan:
    folders: list[str]  # to make, each after its parent
    files: list[str]  # regular files to send
    links: list[str]  # symlinks to make (or replace)
    kept_newer: list[str]
    skipped: list[str]  # "path (why)"
    leftovers: list[str]  # an interrupted copy's temporary files on the destination
    unchanged: int


def temp_name() -> str:
    return TEMP_PREFIX + secrets.token_hex(8)


def is_temp(rel: str) -> bool:
    return _TEMP.fullmatch(posixpath.basename(rel)) is not None


def excludes(paths: Iterable[str]) -> frozenset[str]:
    """The user's exclude paths, normalised ("./a/b/" is "a/b"); UsageError for one that
    names no path below the root."""
    out = set()
    for path in paths:
        norm = posixpath.normpath(path)
        if posixpath.isabs(norm) or norm in (".", "..") or norm.startswith("../"):
            raise UsageError(f"cannot exclude {path!r}: give a path relative to the home")
        out.add(norm)
    return frozenset(out)


def excluded(rel: str, exclude: frozenset[str]) -> bool:
    """Whether `rel` is one of `exclude` or inside one of them."""
    while rel:
        if rel in exclude:
            return True
        rel = posixpath.dirname(rel)
    return False


def below(rel: str, folders: set[str]) -> bool:
    """Whether `rel` is inside one of `folders`."""
    parent = posixpath.dirname(rel)
    while parent:
        if parent in folders:
            return True
        parent = posixpath.dirname(parent)
    return False


def plan(src: Listing, dst: Listing) -> Plan:
    """What to do to bring `dst` up to `src` without losing anything of `dst`."""
    folders: list[str] = []
    files: list[str] = []
    links: list[str] = []
    kept: list[str] = []
    skipped: list[str] = []
    blocked: set[str] = set()  # source folders whose subtrees are not copied
    unchanged = 0
    # Sorted: a folder comes before what is in it ("a" < "a/b"), so it is made first.
    for rel in sorted(src):
        if below(rel, blocked):
            continue
        s, d = src[rel], dst.get(rel)
        if s.kind is Kind.FOLDER:
            why = _folder_blocked(s, d)
            if why:
                skipped.append(f"{rel} ({why})")
                blocked.add(rel)
            elif d is None:
                folders.append(rel)
            continue
        if s.kind not in (Kind.FILE, Kind.LINK):
            skipped.append(f"{rel} (a {s.kind})")
        elif is_temp(rel):
            skipped.append(f"{rel} (a partial file of an interrupted copy)")
        elif d is not None and d.kind is Kind.FOLDER:
            skipped.append(f"{rel} (the destination has a folder there)")
        elif d is not None and _same(s, d):
            unchanged += 1
        elif d is not None and d.mtime > s.mtime:
            kept.append(rel)
        else:
            (files if s.kind is Kind.FILE else links).append(rel)
    leftovers = sorted(
        rel for rel, d in dst.items() if is_temp(rel) and d.kind in (Kind.FILE, Kind.LINK)
    )
    return Plan(folders, files, links, kept, skipped, leftovers, unchanged)


def _folder_blocked(s: Entry, d: Entry | None) -> str:
    if s.error:
        return f"cannot list it: {s.error}"
    if d is None:
        return ""
    if d.kind is not Kind.FOLDER:
        # Never through a link (it may point out of the destination's tree), and a file
        # there would have to go for a folder to take its name.
        return f"the destination has a {d.kind} there"
    if d.error:
        return f"cannot list it on the destination: {d.error}"
    return ""


def _same(s: Entry, d: Entry) -> bool:
    if s.kind is Kind.LINK:
        return d.kind is Kind.LINK and d.target == s.target
    return d.kind is Kind.FILE and (d.size, d.mtime) == (s.size, s.mtime)
