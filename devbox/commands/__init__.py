"""What each `devbox` command does, given parsed arguments: one module per command family,
thin (arguments -> the session service or a backend -> printed text). The parser in
devbox.cli names each handler as "module:function"; only the one a command needs is imported.

What every family prints the same way lives here."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from devbox import units


def say(text: str) -> None:
    """One line to stderr in one write: print() writes the text and its newline apart, so
    `up`'s line and the ssh-config thread's warning could run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def print_table(rows: Sequence[Sequence[str]]) -> None:
    print("\n".join(units.table(rows)))
