"""`devbox` command line: argument parsing only. Work happens in devbox.commands.

Everything heavy is imported inside the command that needs it, so `devbox --help`
and `devbox proxy` (run on every ssh connection) start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from devbox import __version__
from devbox.errors import EXIT_USAGE, DevboxError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, as every devbox error; `--help` has the usage.
        self.exit(EXIT_USAGE, f"devbox: error: {message} (see `{self.prog} --help`)\n")


def _number(
    what: str, cast: Callable[[str], float], *, low: float, high: float, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: `cast(text)` within [low, high] ((low, high] with low_open), or a
    one-line error naming `what` and the allowed range."""
    whole = cast is int

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            kind = "a whole number" if whole else "a number"
            raise argparse.ArgumentTypeError(f"{what} must be {kind}, not {text!r}") from None
        # Written so that NaN fails too: every comparison with it is false.
        if not ((value > low if low_open else value >= low) and value <= high):
            above = f"above {low:g}" if low_open else f"at least {low:g}"
            limit = "" if high == float("inf") else f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"{what} must be {above}{limit} (got {text})")
        return value

    return parse


_gpu_count = _number("GPU count", int, low=0, high=float("inf"))
_port = _number("port", int, low=0, high=65535)
_seconds = _number("timeout (seconds)", float, low=0, high=86400, low_open=True)
_count = _number("count", int, low=1, high=float("inf"))


def _rate(text: str) -> float:
    from devbox.protocol import MAX_RATE  # not at import: `devbox --help` stays light

    return _number("rate (per second)", float, low=0, high=MAX_RATE, low_open=True)(text)


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = text[:-1], text[-1:]
    try:
        value = float(number) * units[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"duration must be a number and a unit (30m, 4h, 1d), not {text!r}"
        ) from None
    if not 0 < value <= 30 * 86400:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"duration must be above 0 and at most 30d (got {text})")
    return value


_bins = _number("bins", int, low=1, high=1000)
_pid = _number("pid", int, low=1, high=float("inf"))

# What a TAB offers for an argument's value, marked where the argument is defined so the
# grammar is written once (devbox.cli.completion reads the marks): your boxes' names, or the run
# ids of the box named before it. Choices and subcommands need no mark.
BOX_NAME = "box name"
RUN_ID = "run id"
CLUSTER = "cluster"
_OFFERS = "devbox_offers"
_HIDDEN = "devbox_hidden"


def _offer(parser: argparse.ArgumentParser, **offers: str) -> None:
    """Mark `parser`'s arguments, by dest, with what a TAB offers for their values."""
    marked = {a.dest for a in parser._actions if a.dest in offers}
    if marked != set(offers):
        raise ValueError(f"no such argument to mark: {sorted(set(offers) - marked)}")
    for action in parser._actions:
        if action.dest in offers:
            setattr(action, _OFFERS, offers[action.dest])


def offers(action: argparse.Action) -> str | None:
    """BOX_NAME, RUN_ID or None: what a TAB offers for `action`'s value."""
    value = getattr(action, _OFFERS, None)
    return value if isinstance(value, str) else None


def hidden(parser: argparse.ArgumentParser) -> bool:
    """Is this a command for devbox's own use, which a TAB does not offer?"""
    return getattr(parser, _HIDDEN, False) is True


class _Command:
    """One command: its name, its handler as "module:function" (main imports only that
    module), what adds its arguments, and add_parser's keywords (help, usage, ...). A plain
    class: a dataclass would import `dataclasses` and `inspect` into every command."""

    __slots__ = ("arguments", "backend_flags", "handler", "name", "options")

    def __init__(
        self,
        name: str,
        handler: str,
        arguments: Callable[[argparse.ArgumentParser, _Parser], None],
        *,
        backend_flags: bool = True,
        **options: Any,
    ) -> None:
        self.name = name
        self.handler = handler
        self.arguments = arguments
        self.backend_flags = backend_flags
        self.options = options


def _up(up: argparse.ArgumentParser, backend: _Parser) -> None:
    up.add_argument("name", nargs="?", help="box name (default: a generated one)")
    up.add_argument("--gpus", type=_gpu_count, help="GPUs for the box (default: the profile's)")
    up.add_argument("--port", type=_port, default=0, help="local backend: the agent's port")
    up.add_argument("--no-attach", action="store_true", help="do not attach the session")
    up.add_argument("--json", action="store_true", help="print the box record as JSON")
    up.add_argument(
        "--profile", default="default", help="the box's profile (`devbox profiles`; default)"
    )
    up.add_argument("--timeout", type=_seconds, help="seconds to wait for the box to start")


def _clusters(clusters: argparse.ArgumentParser, backend: _Parser) -> None:
    clusters.add_argument("--json", action="store_true", help="one JSON array, a cluster each")


def _move(move: argparse.ArgumentParser, backend: _Parser) -> None:
    move.add_argument("name")
    move.add_argument("--to", required=True, metavar="CLUSTER", help="the cluster to move to")
    _offer(move, name=BOX_NAME, to=CLUSTER)
    move.add_argument("--timeout", type=_seconds, help="seconds to wait for the new box")
    move.add_argument("--json", action="store_true", help="what was copied, as JSON")


def _ls(ls: argparse.ArgumentParser, backend: _Parser) -> None:
    ls.add_argument("--json", action="store_true", help="one JSON array of box records")


def _down(down: argparse.ArgumentParser, backend: _Parser) -> None:
    down.add_argument("name")
    _offer(down, name=BOX_NAME)
    down.add_argument(
        "--purge",
        action="store_true",
        help="also delete the box's home folder (asks first); of a released box: its kept home",
    )
    down.add_argument(
        "--yes", "-y", action="store_true", help="with --purge: delete without asking"
    )
    down.add_argument(
        "--now",
        action="store_true",
        help="do not ask the box's probed processes to save first (probe.on_release; "
        "they get save_timeout otherwise)",
    )


def _ssh(ssh: argparse.ArgumentParser, backend: _Parser) -> None:
    ssh.add_argument("name")
    _offer(ssh, name=BOX_NAME)
    ssh.add_argument("cmd", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _name_only(parser: argparse.ArgumentParser, backend: _Parser) -> None:
    parser.add_argument("name")
    _offer(parser, name=BOX_NAME)


def _ssh_config(cfg: argparse.ArgumentParser, backend: _Parser) -> None:
    how = cfg.add_mutually_exclusive_group()
    how.add_argument(
        "--write",
        action="store_true",
        help="write it to a devbox file and Include that from ~/.ssh/config",
    )
    how.add_argument(
        "--inline",
        action="store_true",
        help="print complete blocks (HostName, ProxyCommand, User, IdentityFile, "
        "UserKnownHostsFile, ...) for paramiko, Fabric and other clients without Include; "
        "paramiko: SSHConfig.from_path(FILE).lookup('NAME.devbox'), load_host_keys() its "
        "userknownhostsfile, connect with sock=ProxyCommand(its proxycommand)",
    )


def _keep(keep: argparse.ArgumentParser, backend: _Parser) -> None:
    keep.add_argument("name", nargs="?", help="the box (default: the box this runs in)")
    keep.add_argument(
        "--for", dest="duration", type=_duration, default=4 * 3600.0, help="30m, 4h, 1d (4h)"
    )
    keep.add_argument("--off", action="store_true", help="end the hold now")
    _offer(keep, name=BOX_NAME)


def _stats(stats: argparse.ArgumentParser, backend: _Parser) -> None:
    stats.add_argument("name")
    _offer(stats, name=BOX_NAME)
    stats.add_argument("--json", action="store_true", help="JSON: one sample per line")
    stats.add_argument("--watch", "-w", action="store_true", help="keep streaming (ctrl-c ends)")
    stats.add_argument("--rate", type=_rate, default=1.0, help="samples per second (default 1)")
    stats.add_argument("--count", "-c", type=_count, help="stop after COUNT samples")
    stats.add_argument(
        "--history", action="store_true", help="with --json: the last 10 minutes first"
    )


def _probe(probe: argparse.ArgumentParser, backend: _Parser) -> None:
    probe.add_argument("name")
    _offer(probe, name=BOX_NAME)
    probe.add_argument("--json", action="store_true", help="JSON: one frame body per line")
    probe.add_argument("--watch", "-w", action="store_true", help="keep streaming (ctrl-c ends)")
    probe.add_argument("--count", "-c", type=_count, help="stop after COUNT reports")
    probe.add_argument("--pid", type=_pid, help="the training process (default: the newest)")
    ask = probe.add_mutually_exclusive_group()
    ask.add_argument("--histogram", metavar="LAYER", help="a histogram of LAYER's --tensor")
    ask.add_argument("--summary", metavar="LAYER", help="shape, mean, std, min, max, norm")
    ask.add_argument("--save", metavar="LAYER", help="save the tensor to a file in the box")
    ask.add_argument(
        "--stacks",
        action="store_true",
        help="every thread's Python stack, of each probed process (a hung one too)",
    )
    probe.add_argument(
        "--tensor",
        choices=("activation", "gradient", "weight"),  # protocol.PROBE_TENSORS (kept light)
        default="activation",
        help="which tensor of LAYER (default: activation, its output)",
    )
    probe.add_argument("--bins", type=_bins, help="histogram bins (default 30)")
    probe.add_argument(
        "--timeout", type=_seconds, default=30.0, help="seconds to wait for a step (default 30)"
    )


def _tui(tui: argparse.ArgumentParser, backend: _Parser) -> None:
    tui.add_argument(
        "--rate", type=_rate, default=1.0, help="telemetry samples per second per box (default 1)"
    )


def _pool(pool: argparse.ArgumentParser, backend: _Parser) -> None:
    pool_sub = pool.add_subparsers(
        dest="pool_command", metavar="ACTION", parser_class=_Parser, required=True
    )
    warm = pool_sub.add_parser("warm", parents=[backend], help="top the pool up to --size pods")
    warm.add_argument("--profile", default="default", help="the pods' profile (default)")
    warm.add_argument("--gpus", type=_gpu_count, help="GPUs per warm pod (default: the profile's)")
    warm.add_argument("--size", type=_gpu_count, default=1, help="unclaimed pods to keep")
    warm.add_argument("--no-wait", action="store_true", help="do not wait for them to start")
    warm.add_argument("--timeout", type=_seconds, help="seconds to wait for them to start")
    warm.add_argument("--json", action="store_true", help="the pool as a JSON array")
    pls = pool_sub.add_parser("ls", parents=[backend], help="list the warm pods")
    pls.add_argument("--json", action="store_true")


def _profiles(profiles: argparse.ArgumentParser, backend: _Parser) -> None:
    profiles.add_argument("--json", action="store_true", help="one JSON array of profiles")


def _run(run: argparse.ArgumentParser, backend: _Parser) -> None:
    run.add_argument("--box", help="the box to run in (default: claim a new one)")
    run.add_argument("--gpus", type=_gpu_count, help="claim a new box with N GPUs for it")
    run.add_argument("--sync", metavar="DIR", help="folder synced into the box (default: .)")
    run.add_argument("--no-sync", action="store_true", help="sync nothing; run in the home")
    run.add_argument(
        "--detach", "-d", action="store_true", help="print the run id and return at once"
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _offer(run, box=BOX_NAME)


def _runs(runs: argparse.ArgumentParser, backend: _Parser) -> None:
    runs.add_argument("name", nargs="?", help="box name (default: every running box)")
    _offer(runs, name=BOX_NAME)
    runs.add_argument("--json", action="store_true", help="one JSON array of run records")


def _logs(logs: argparse.ArgumentParser, backend: _Parser) -> None:
    _box_and_run(logs, backend)
    logs.add_argument("--follow", "-f", action="store_true", help="until the run ends")


def _box_and_run(parser: argparse.ArgumentParser, backend: _Parser) -> None:
    parser.add_argument("name")
    parser.add_argument("run")
    _offer(parser, name=BOX_NAME, run=RUN_ID)


def _sync(sync: argparse.ArgumentParser, backend: _Parser) -> None:
    sync.add_argument("name")
    sync.add_argument("dir", nargs="?", default=".", help="the folder (default: .)")
    _offer(sync, name=BOX_NAME)


def _completion(comp: argparse.ArgumentParser, backend: _Parser) -> None:
    comp.add_argument("shell", choices=("bash", "zsh"))


def _autoscaler(scaler: argparse.ArgumentParser, backend: _Parser) -> None:
    scaler.add_argument(
        "--config",
        type=Path,
        help="settings file (default: the ConfigMap devbox-autoscaler on kubernetes, "
        "~/.config/devbox/autoscaler.toml locally)",
    )
    scaler.add_argument("--once", action="store_true", help="one reconcile pass, then exit")


def _explain(explain: argparse.ArgumentParser, backend: _Parser) -> None:
    explain.add_argument("name")
    _offer(explain, name=BOX_NAME)
    explain.add_argument("--config", type=Path, help="settings file, as for `devbox autoscaler`")
    explain.add_argument("--json", action="store_true", help="the verdict as JSON")


def _nothing(parser: argparse.ArgumentParser, backend: _Parser) -> None:
    pass


# The one table of commands, in `devbox --help`'s order: for dispatch, for completion
# (devbox.cli.completion walks the parser built from it) and for the help.
COMMANDS: tuple[_Command, ...] = (
    _Command("up", "devbox.commands.boxes:up", _up, help="claim a box and attach its session"),
    _Command(
        "clusters",
        "devbox.commands.clusters:show",
        _clusters,
        help="what devbox sees of each of your clusters",
    ),
    _Command(
        "move",
        "devbox.commands.clusters:move",
        _move,
        help="carry a box and its home to another cluster",
    ),
    _Command("ls", "devbox.commands.boxes:ls", _ls, help="list your boxes"),
    _Command("down", "devbox.commands.boxes:down", _down, help="release a box (its home is kept)"),
    _Command(
        "ssh",
        "devbox.commands.ssh:ssh",
        _ssh,
        help="open the box's session, or run CMD",
        usage="devbox ssh NAME [-- CMD ...]",
    ),
    _Command(
        "proxy",
        "devbox.commands.ssh:proxy",
        _name_only,
        help="bridge stdin/stdout to a box (ssh ProxyCommand)",
    ),
    _Command(
        "ssh-config",
        "devbox.commands.ssh:ssh_config",
        _ssh_config,
        help="OpenSSH config for your boxes",
        description="Print a `Host NAME.devbox` block per box (and pin each box's host key). "
        "--write keeps them in a devbox file that ~/.ssh/config Includes, for OpenSSH, "
        "VS Code and every ssh-based tool; --inline prints self-contained blocks for "
        "clients that do not follow Include or Match (paramiko, Fabric): save them to a "
        "file and point the client at it.",
    ),
    _Command(
        "keep",
        "devbox.commands.boxes:keep",
        _keep,
        help="hold a box against idle release for a while",
    ),
    _Command(
        "stats",
        "devbox.commands.stats:stats",
        _stats,
        help="live GPU, host and process telemetry of a box",
    ),
    _Command(
        "probe",
        "devbox.commands.probe:run",
        _probe,
        help="live per-layer statistics of a model training in a box (devbox.probe)",
    ),
    _Command("tui", "devbox.commands.tui:run", _tui, help="full-screen dashboard of your boxes"),
    _Command(
        "pool",
        "devbox.commands.boxes:pool",
        _pool,
        backend_flags=False,
        help="kubernetes: the warm pool of unclaimed boxes",
    ),
    _Command(
        "profiles",
        "devbox.commands.boxes:profiles",
        _profiles,
        help="the box profiles you may claim, and their source",
    ),
    # `devbox run` and what looks after runs.
    _Command(
        "run",
        "devbox.commands.runs:run",
        _run,
        help="run CMD in a box, detached, with a record (ctrl-c detaches)",
        usage="devbox run [--box NAME | --gpus N] [--sync DIR | --no-sync] [--detach] -- CMD ...",
    ),
    _Command("runs", "devbox.commands.runs:runs", _runs, help="list the runs of a box (or all)"),
    _Command("logs", "devbox.commands.runs:logs", _logs, help="print or follow a run's output"),
    _Command("attach", "devbox.commands.runs:attach", _box_and_run, help="join a run's window"),
    _Command(
        "kill",
        "devbox.commands.runs:kill",
        _box_and_run,
        help="stop a run (SIGTERM, then SIGKILL)",
    ),
    _Command(
        "sync",
        "devbox.commands.runs:sync_",
        _sync,
        help="sync a folder into a box, as `devbox run` does",
    ),
    _Command(
        "completion",
        "devbox.cli.completion:command",
        _completion,
        backend_flags=False,
        help='shell completion: eval "$(devbox completion bash)"',
    ),
    _Command(
        "autoscaler",
        "devbox.commands.autoscaler:run",
        _autoscaler,
        help="release idle boxes (warning first), keep warm pools",
    ),
    _Command(
        "explain",
        "devbox.commands.autoscaler:explain",
        _explain,
        help="why the autoscaler keeps a box, or released it",
    ),
)
_NAMES = frozenset(command.name for command in COMMANDS)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only` (a command's name), a parser with that one command:
    making all 25 command parsers is a tenth of `devbox ssh`'s own start-up, and a command
    needs only its own (benchmarks/bench_startup.py)."""
    parser = _Parser(prog="devbox", description="A personal GPU box in one command.")
    parser.add_argument("--version", action="version", version=f"devbox {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    backend = _Parser(add_help=False)
    backend.add_argument("--context", help="kubernetes: kubeconfig context (default: current)")
    backend.add_argument("--namespace", "-n", help="kubernetes: namespace (default: context's)")
    backend.add_argument(
        "--backend",
        choices=("local", "kubernetes"),
        help="where boxes live (default: $DEVBOX_BACKEND, the config, local)",
    )
    backend.add_argument(
        "--cluster", help="kubernetes: one of your config's [clusters.NAME] (default: all)"
    )
    _offer(backend, cluster=CLUSTER)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        if only is not None and command.name != only:
            continue
        parents = [backend] if command.backend_flags else []
        made: argparse.ArgumentParser = sub.add_parser(
            command.name, parents=parents, **command.options
        )
        made.set_defaults(handler=command.handler)
        command.arguments(made, backend)
    if only is None:
        agent = sub.add_parser(
            "agent", help="run a box's agent (used by the backends)", add_help=False
        )
        setattr(agent, _HIDDEN, True)
    return parser


def command_word(argv: list[str]) -> str | None:
    """The command `argv` names, when it names one before anything else but flags (the
    top-level parser's flags take no values); None for --help, a typo, or nothing."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in _NAMES else None
        if word in ("-h", "--help", "--version", "--"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:
        # The agent parses its own flags; keep its start-up free of the CLI's.
        from agent.main import main as agent_main

        return agent_main(argv[1:])
    if argv[:1] == ["_complete"]:
        # On every TAB: the parser and a cache file, never a backend (devbox.cli.completion).
        from devbox.cli.completion import complete

        return complete(argv[1:])
    args = build_parser(only=command_word(argv)).parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return EXIT_USAGE
    debug = args.debug or bool(os.environ.get("DEVBOX_DEBUG"))
    try:
        module, _, function = args.handler.partition(":")
        handler = getattr(importlib.import_module(module), function)
        return _flushed(handler(args))
    except DevboxError as exc:
        if debug:
            raise
        print(f"devbox: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as exc:
        if _stdout_closed():
            return _quiet_after_closed_stdout()
        if debug:
            raise
        print(f"devbox: error: {_os_error(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # the system said no: what failed, in one line
        if debug:
            raise
        print(f"devbox: error: {_os_error(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: still one line, the traceback behind --debug
        if debug:
            raise
        print(
            f"devbox: error: unexpected {type(exc).__name__}: {exc} (rerun with --debug)",
            file=sys.stderr,
        )
        return 1


def _flushed(status: int) -> int:
    """`status`, once what the command printed is out: a reader that went away (`| head`)
    is then met here, inside main's handlers, not by the interpreter's exit."""
    sys.stdout.flush()
    return status


def _stdout_closed() -> bool:
    """Is stdout a pipe whose reader has gone? (A BrokenPipeError may come from another
    pipe, which is a failure to report.) Linux and the BSDs report POLLERR for it."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_after_closed_stdout() -> int:
    """End as `yes | head` does: the shell's 128 + SIGPIPE, no message. What is still
    buffered for stdout goes nowhere, so the interpreter's exit does not fail on it."""
    import signal

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 128 + signal.SIGPIPE


def _os_error(exc: OSError) -> str:
    """An OSError as one line that names what failed: "Permission denied: /path"."""
    what = exc.strerror or str(exc) or type(exc).__name__
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    return f"{what}: {' -> '.join(names)}" if names else what
