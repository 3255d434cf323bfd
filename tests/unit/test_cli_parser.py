"""A command's arguments parse the same whether the parser holds every command or, as
`devbox CMD` builds it, only CMD's; what names no command still gets the whole parser."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from devbox import cli

LINES = [
    ["up"],
    ["up", "b1", "--gpus", "2", "--no-attach", "--json", "--profile", "a100"],
    ["--debug", "ls", "--json"],
    ["down", "b1", "--purge", "--yes", "--backend", "local"],
    ["ssh", "b1", "--", "python", "-c", "print(1)"],
    ["ssh", "b1"],
    ["proxy", "b1", "--context", "lab", "-n", "ns"],
    ["ssh-config", "--inline"],
    ["keep", "--for", "30m"],
    ["stats", "b1", "--rate", "5", "--watch"],
    ["probe", "b1", "--histogram", "fc1", "--tensor", "gradient", "--bins", "12"],
    ["tui", "--rate", "2"],
    ["pool", "warm", "--size", "3", "--no-wait", "--backend", "kubernetes"],
    ["pool", "ls", "--json"],
    ["profiles", "--json"],
    ["run", "--box", "b1", "--sync", "src", "-d", "--", "python", "train.py"],
    ["runs", "b1", "--json"],
    ["logs", "b1", "ab12", "-f"],
    ["attach", "b1", "ab12"],
    ["kill", "b1", "ab12"],
    ["sync", "b1", "dir"],
    ["completion", "zsh"],
    ["autoscaler", "--once"],
    ["explain", "b1", "--json"],
    ["clusters", "--json"],
    ["move", "b1", "--to", "cloud"],
]


def test_every_command_is_in_the_lines_below() -> None:
    assert {line[0] if line[0] != "--debug" else line[1] for line in LINES} == {
        c.name for c in cli.COMMANDS
    }


@pytest.mark.parametrize("argv", LINES, ids=lambda argv: " ".join(argv))
def test_one_command_parses_as_all_of_them(argv: list[str]) -> None:
    only = cli.build_parser(only=cli.command_word(argv)).parse_args(argv)
    whole = cli.build_parser().parse_args(argv)
    assert only.command is not None
    assert vars(only) == vars(whole)


def test_the_lazy_parser_holds_only_the_command() -> None:
    parser = cli.build_parser(only="ssh")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["ssh"]


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["--debug", "ssh", "b"], "ssh"),
        (["--help", "ssh"], None),
        (["--version"], None),
        (["sssh", "b"], None),
        (["b", "ssh"], None),
        ([], None),
    ],
)
def test_thecommand_word(argv: list[str], word: str | None) -> None:
    assert cli.command_word(argv) == word


def _devbox(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devbox", *argv], capture_output=True, text=True, check=False
    )


def test_a_typo_names_the_commands_there_are() -> None:
    done = _devbox("sssh", "b")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "invalid choice: 'sssh'" in done.stderr and "'ssh'" in done.stderr


def test_a_command_missing_its_argument_is_one_line() -> None:
    done = _devbox("logs", "b1")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "the following arguments are required: run" in done.stderr
