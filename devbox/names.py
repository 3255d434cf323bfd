"""Box names: DNS-1123 labels, so the same name works as a pod name and a host name."""

from __future__ import annotations

import re

from devbox.errors import UsageError

MAX_NAME_LENGTH = 63
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

_ADJECTIVES = (
    "amber",
    "bold",
    "brisk",
    "calm",
    "clever",
    "cosmic",
    "eager",
    "fuzzy",
    "gentle",
    "happy",
    "jolly",
    "keen",
    "lucid",
    "mellow",
    "nimble",
    "plucky",
    "quiet",
    "rapid",
    "sunny",
    "swift",
    "tidy",
    "vivid",
    "witty",
    "zesty",
)
_NOUNS = (
    "badger",
    "comet",
    "falcon",
    "gecko",
    "heron",
    "ibis",
    "koala",
    "lemur",
    "lynx",
    "marten",
    "newt",
    "otter",
    "panda",
    "quokka",
    "raven",
    "robin",
    "seal",
    "tapir",
    "tern",
    "vole",
    "walrus",
    "wombat",
    "yak",
    "zebra",
)


def validate_name(name: str) -> str:
    """Return `name` if it is a valid box name, else raise a UsageError saying why."""
    if not name:
        raise UsageError("box name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise UsageError(
            f"box name {name[:20]!r}... is {len(name)} characters; at most {MAX_NAME_LENGTH}"
        )
    if not _LABEL.match(name):
        raise UsageError(
            f"invalid box name {name!r}: use lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def generate_name() -> str:
    """A memorable name; callers re-draw on a collision (four hex digits make that rare)."""
    import secrets  # here: every command validates names, only `up` draws one

    return f"{secrets.choice(_ADJECTIVES)}-{secrets.choice(_NOUNS)}-{secrets.token_hex(2)}"
