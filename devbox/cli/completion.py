"""Shell completion for bash and zsh, derived from the CLI's parser: `devbox completion
bash|zsh` prints the script; on a TAB the script asks `devbox _complete words CWORD WORD...`,
which walks `devbox.cli.build_parser()` over the words typed so far. Commands, options, which
options take a value, their choices and where box names and run ids go are the parser's
(devbox.cli marks the arguments that take a box name or a run id), so a new command or option
completes with no second edit.

Names come from files on the laptop, never from a box: a TAB must not wait for the network.
Box names are the local backend's boxes (box folders with a record) plus every box a run
was seen on; run ids are those `devbox run` started and `devbox runs` last listed (a cache
in the state folder: devbox.offers). A TAB costs one Python start-up, the light CLI module
and its parser (no backend, no client library).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

from devbox import cli, offers


def complete(argv: list[str]) -> int:
    """`devbox _complete words CWORD WORD...` (what a TAB offers for WORD number CWORD of the
    line, the program's name being number 0), `_complete boxes`, `_complete runs BOX`: one
    answer per line."""
    if argv[:1] == ["boxes"] and len(argv) == 1:
        found = offers.boxes()
    elif argv[:1] == ["runs"] and len(argv) == 2:
        found = offers.runs(argv[1])
    elif argv[:1] == ["words"] and len(argv) >= 3 and argv[1].isdigit():
        cword = int(argv[1])
        words = argv[2:][: cword + 1]
        found = candidates(cli.build_parser(), words + [""] * (cword + 1 - len(words)))
    else:
        return 2
    if found:
        print("\n".join(found))
    return 0


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """The commands a TAB offers first, in the parser's order."""
    return _values(_subcommands(parser), box=None)


def candidates(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[str]:
    """What a TAB offers for the last of `words`: the line up to the cursor, split as the
    shell does (bash splits `--for=4h` into `--for`, `=`, `4h`; zsh does not)."""
    *before, current = words[1:]
    forced = None  # bash's `--option = VALUE`: VALUE is the option's, offered bare
    if len(before) >= 2 and before[-1] == "=" and before[-2].startswith("--"):
        forced, before = before[-2], before[:-2]
    if current == "=":
        return []
    walk = _Walk(parser)
    for word in _joined(before):
        if not walk.step(word):
            return []  # past `--`, or a command's own words (`ssh BOX CMD`): not ours
    if forced is not None:
        action = walk.option(forced)
        return _matching(_values(action, box=walk.box), current)
    if current.startswith("--") and "=" in current:
        name, _, value = current.partition("=")
        action = walk.option(name)
        found = _values(action, box=walk.box)
        return [f"{name}={v}" for v in _matching(found, value)]
    if current.startswith("-"):
        options = [s for a in walk.parser._actions for s in a.option_strings]
        return _matching(options, current)
    if walk.left:
        return _matching(_values(walk.pending, box=walk.box), current)
    positional = walk.positional()
    if positional is None or positional.nargs == argparse.REMAINDER:
        return []
    return _matching(_values(positional, box=walk.box), current)


class _Walk:
    """Where the words typed so far leave argparse: which (sub)parser, which positional is
    next, whether an option still waits for its value, and the box named last."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.done = 0  # positionals filled
        self.pending: argparse.Action | None = None
        self.left = 0  # values `pending` still takes
        self.box: str | None = None

    def positional(self) -> argparse.Action | None:
        found = [a for a in self.parser._actions if not a.option_strings]
        return found[self.done] if self.done < len(found) else None

    def option(self, word: str) -> argparse.Action | None:
        """The option `word` names, abbreviated as argparse allows (`--fol` for `--follow`)."""
        table = self.parser._option_string_actions
        if word in table:
            return table[word]
        if not word.startswith("--"):
            return None
        found = {a for s, a in table.items() if s.startswith(word)}
        return found.pop() if len(found) == 1 else None

    def step(self, word: str) -> bool:
        """Take one word; False where what follows is no longer devbox's grammar."""
        if self.left:
            self.left -= 1
            self._value(self.pending, word)
            return True
        if word == "--":
            return False
        if word.startswith("-") and word != "-":
            name, equals, value = word.partition("=") if word.startswith("--") else (word, "", "")
            action = self.option(name)
            if action is None and len(word) > 2 and not word.startswith("--"):
                action, equals, value = self.option(word[:2]), "=", word[2:]  # `-c5`
            if action is not None and action.nargs != 0:
                if equals:
                    self._value(action, value)
                else:
                    self.pending = action
                    self.left = action.nargs if isinstance(action.nargs, int) else 1
            return True
        positional = self.positional()
        if positional is None:
            return True  # one word too many: argparse will say so, a TAB offers nothing new
        if isinstance(positional, argparse._SubParsersAction):
            chosen = positional.choices.get(word)
            if not isinstance(chosen, argparse.ArgumentParser):
                return False
            self.parser, self.done = chosen, 0
            return True
        if positional.nargs == argparse.REMAINDER:
            return False
        self._value(positional, word)
        if positional.nargs not in ("*", "+"):
            self.done += 1
        return True

    def _value(self, action: argparse.Action | None, word: str) -> None:
        if action is not None and cli.offers(action) == cli.BOX_NAME:
            self.box = word


def _subcommands(parser: argparse.ArgumentParser) -> argparse.Action | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _values(action: argparse.Action | None, *, box: str | None) -> list[str]:
    """What may stand for `action`'s value."""
    if action is None:
        return []
    if isinstance(action, argparse._SubParsersAction):
        return [n for n, p in action.choices.items() if not cli.hidden(p)]
    if action.choices is not None:
        return [str(c) for c in action.choices]
    what = cli.offers(action)
    if what == cli.BOX_NAME:
        return offers.boxes()
    if what == cli.RUN_ID:
        return offers.runs(box) if box else []
    if what == cli.CLUSTER:
        return offers.clusters()
    return []  # free text, a number or a path: the shell's own completion (files)


def _matching(found: Iterable[str], prefix: str) -> list[str]:
    return [f for f in found if f.startswith(prefix)]


def _joined(words: Sequence[str]) -> list[str]:
    """bash's `--for`, `=`, `4h` as the one word `--for=4h` it was typed as."""
    out: list[str] = []
    i = 0
    while i < len(words):
        if words[i] == "=" and out and out[-1].startswith("--") and i + 1 < len(words):
            out[-1] += "=" + words[i + 1]
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


# The commands are written into the script when it is made: the commonest TAB, the first
# word, starts no Python. Every later word asks `devbox _complete words`.
_BASH = r"""# devbox completion for bash: eval "$(devbox completion bash)" in ~/.bashrc
_devbox() {
    local cur=${COMP_WORDS[COMP_CWORD]}
    if ((COMP_CWORD == 1)) && [[ $cur != -* ]]; then
        COMPREPLY=($(compgen -W "@COMMANDS@" -- "$cur"))
    else
        local IFS=$'\n'
        COMPREPLY=($(@DEVBOX@ _complete words "$COMP_CWORD" "${COMP_WORDS[@]}" 2>/dev/null))
    fi
}
complete -o default -F _devbox devbox
"""

_ZSH = r"""#compdef devbox
# devbox completion for zsh: eval "$(devbox completion zsh)" in ~/.zshrc (after compinit)
_devbox() {
    local -a found
    if ((CURRENT == 2)) && [[ $PREFIX != -* ]]; then
        found=(@COMMANDS@)
    else
        found=(${(f)"$(@DEVBOX@ _complete words $((CURRENT - 1)) "${words[@]}" 2>/dev/null)"})
    fi
    compadd -a found
}
compdef _devbox devbox
"""


def script(shell: str, *, commands: Iterable[str] | None = None, devbox: str = "devbox") -> str:
    """The completion script for `shell`; `commands` (default: the parser's) are those the
    first word offers."""
    names = command_names(cli.build_parser()) if commands is None else list(commands)
    template = _BASH if shell == "bash" else _ZSH
    return template.replace("@COMMANDS@", " ".join(names)).replace("@DEVBOX@", devbox)


def command(args: argparse.Namespace) -> int:
    """`devbox completion bash|zsh`."""
    sys.stdout.write(script(args.shell))
    return 0
