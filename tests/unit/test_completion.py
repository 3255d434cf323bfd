"""Shell completion is derived from the CLI's parser: every command and option completes,
box names and run ids where the parser marks them, and a TAB stays light. Driven through
the real bash completion function, as a user's shell runs it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devbox import cli, offers
from devbox.cli import completion

REPO = Path(__file__).resolve().parents[2]
BOXES = ["alpha", "beta"]
RUNS = ["q3rs", "p2zz", "k7mq"]  # newest first
SEP = "--next--"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A HOME with two local boxes and three runs remembered on alpha."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    for box in BOXES:
        folder = tmp_path / ".local/state/devbox/local/boxes" / box
        folder.mkdir(parents=True)
        (folder / "box.json").write_text("{}")
    offers.remember_runs("alpha", reversed(RUNS))
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _bash(env: dict[str, str], lines: list[str]) -> list[list[str]]:
    """What bash's devbox completion offers for each line (the cursor at its end)."""
    script = subprocess.run(
        [sys.executable, "-m", "devbox", "completion", "bash"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # `devbox` is this checkout, wherever the venv's entry point is.
    script = script.replace("$(devbox _complete", f"$({sys.executable} -m devbox _complete")
    calls = []
    for line in lines:
        words = line.split(" ")
        calls.append(
            f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; "
            f"COMPREPLY=(); _devbox; printf '%s\\n' \"${{COMPREPLY[@]}}\" {SEP}"
        )
    program = script + "\n" + "\n".join(calls)
    out = subprocess.run(
        ["bash", "-c", program], env=env, capture_output=True, text=True, check=True
    ).stdout
    answers = out.split(SEP + "\n")[:-1]
    assert len(answers) == len(lines), out
    return [a.split() for a in answers]


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)parser with the words that reach it, hidden commands left out."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if not cli.hidden(sub):
                    yield from _parsers(sub, (*path, name))


def _first_positional(parser: argparse.ArgumentParser) -> argparse.Action | None:
    return next((a for a in parser._actions if not a.option_strings), None)


def test_every_command_and_option_completes_in_bash(env: dict[str, str]) -> None:
    parsers = list(_parsers(cli.build_parser()))
    lines, expected = [], []
    for path, parser in parsers:
        options = [s for a in parser._actions for s in a.option_strings]
        lines.append(" ".join(("devbox", *path, "-")))
        expected.append(options)
        for name in (p[-1] for p, _ in parsers if len(p) == len(path) + 1 and p[:-1] == path):
            # Each command from its first letters, and each after a global option too.
            lines.append(" ".join(("devbox", *path, name[:2])))
            expected.append([name])
            lines.append(" ".join(("devbox", "--debug", *path, name)))
            expected.append([name])
    for line, offered, wanted in zip(lines, _bash(env, lines), expected, strict=True):
        missing = [w for w in wanted if w not in offered]
        assert not missing, f"{line!r}: {missing} not offered (got {offered})"
    # The first word offers every command but the agent's, in the parser's order.
    (first,) = _bash(env, ["devbox "])
    assert first == [p[0] for p, _ in parsers if len(p) == 1]
    assert "agent" not in first and {"probe", "explain", "pool", "completion"} <= set(first)


def test_box_names_and_run_ids_where_they_go(env: dict[str, str]) -> None:
    box_commands = [
        path[0]
        for path, parser in _parsers(cli.build_parser())
        if len(path) == 1
        and (p := _first_positional(parser)) is not None
        and cli.offers(p) == cli.BOX_NAME
    ]
    wanted = ["down", "ssh", "proxy", "keep", "stats", "probe", "runs", "logs", "attach"]
    wanted += ["kill", "sync", "explain", "move"]
    assert sorted(box_commands) == sorted(wanted)
    lines = [f"devbox {c} " for c in box_commands]
    lines += [f"devbox {c} alpha " for c in ("logs", "attach", "kill")]
    lines += [
        "devbox run --box ",
        "devbox run --gpus 1 --box = b",
        "devbox probe --count 3 --tensor weight -n ns ",  # values skipped, not taken for names
        "devbox keep --for 4h ",
        "devbox keep --for = 4h ",  # bash splits --for=4h at the `=`
        "devbox stats -c5 ",
        "devbox logs --fol alpha p",  # an abbreviated option, as argparse allows
        "devbox kill --backend=local beta ",
        "devbox up ",  # a new box's name: nothing to offer
        "devbox ssh alpha ",  # the box's own command follows
        "devbox ssh alpha -- ",
        "devbox probe alpha ",
    ]
    answers = dict(zip(lines, _bash(env, lines), strict=True))
    for command in box_commands:
        assert answers[f"devbox {command} "] == BOXES, command
    for command in ("logs", "attach", "kill"):
        assert answers[f"devbox {command} alpha "] == RUNS, command
    assert answers["devbox run --box "] == BOXES
    assert answers["devbox run --gpus 1 --box = b"] == ["beta"]
    assert answers["devbox probe --count 3 --tensor weight -n ns "] == BOXES
    assert answers["devbox keep --for 4h "] == BOXES
    assert answers["devbox keep --for = 4h "] == BOXES
    assert answers["devbox stats -c5 "] == BOXES
    assert answers["devbox logs --fol alpha p"] == ["p2zz"]
    assert answers["devbox kill --backend=local beta "] == []
    for line in ("devbox up ", "devbox ssh alpha ", "devbox ssh alpha -- ", "devbox probe alpha "):
        assert answers[line] == [], line


def test_choices_come_from_the_parser(env: dict[str, str]) -> None:
    lines = [
        "devbox completion ",
        "devbox probe alpha --tensor ",
        "devbox ls --backend k",
        "devbox ls --backend = k",  # bash: the value after the `=`, bare
        "devbox ls --backend=k",  # zsh: one word
        "devbox pool ",
        "devbox pool warm --s",
    ]
    assert _bash(env, lines) == [
        ["bash", "zsh"],
        ["activation", "gradient", "weight"],
        ["kubernetes"],
        ["kubernetes"],
        ["--backend=kubernetes"],
        ["warm", "ls"],
        ["--size"],
    ]


def test_every_option_value_is_skipped_before_a_box_name(env: dict[str, str]) -> None:
    """In process, for speed: after any option and its value, the box name still completes."""
    parser = cli.build_parser()
    for path, sub in _parsers(parser):
        first = _first_positional(sub)
        if first is None or cli.offers(first) != cli.BOX_NAME:
            continue
        for action in sub._actions:
            for option in action.option_strings:
                if action.nargs == 0:
                    words = ["devbox", *path, option, ""]
                else:
                    value = str(next(iter(action.choices))) if action.choices else "1"
                    words = ["devbox", *path, option, value, ""]
                assert completion.candidates(parser, words) == BOXES, words


def test_a_tab_loads_no_backend_nor_client() -> None:
    probe = (
        "import contextlib, io, json, sys\nfrom devbox.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['_complete', 'words', '3', 'devbox', 'logs', 'alpha', ''])\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out.splitlines()[-1])
    heavy = ("textual", "kubernetes", "asyncssh", "pynvml", "rich", "socket", "ssl")
    assert [m for m in loaded if m.split(".")[0] in heavy] == []
    ours = ("devbox.backends", "devbox.commands", "devbox.ssh", "devbox.runs", "devbox.config")
    assert [m for m in loaded if m.startswith(ours)] == []


def test_clusters_and_their_boxes_complete(env: dict[str, str]) -> None:
    """--cluster and move's --to offer the config's [clusters.NAME]; a box last seen in
    one of them is offered by name, as a local one is."""
    home = Path(env.get("HOME") or os.environ["HOME"])
    config = home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[clusters.onprem]\n[clusters.cloud]\n")
    (home / ".local/state/devbox/clusters.json").write_text(
        json.dumps({"boxes": {"gamma": "cloud"}, "failed": {}})
    )
    lines = ["devbox up --cluster ", "devbox move gamma --to o", "devbox ssh ", "devbox ls --cl"]
    answers = dict(zip(lines, _bash(env, lines), strict=True))
    assert answers["devbox up --cluster "] == ["cloud", "onprem"]
    assert answers["devbox move gamma --to o"] == ["onprem"]
    assert answers["devbox ssh "] == [*BOXES, "gamma"]
    assert answers["devbox ls --cl"] == ["--cluster"]
    # A broken config offers nothing rather than failing the TAB.
    config.write_text("[clusters.onprem\n")
    assert _bash(env, ["devbox up --cluster "]) == [[]]
