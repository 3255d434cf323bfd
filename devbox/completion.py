"""Shell completion for bash and zsh: `devbox completion bash|zsh` prints the script; the
script asks `devbox _complete boxes` and `devbox _complete runs BOX` for names.

Both answers come from files on the laptop, never from a box: a TAB must not wait for the
network. Box names are the local backend's boxes (box folders with a record) plus every
box a run was seen on; run ids are those `devbox run` started and `devbox runs` last
listed (a cache, kept in the state folder). This module imports nothing beyond the
standard library and devbox.paths, so a completion costs one bare Python start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from devbox import paths, private

# Options that take a value: the word after one is not a box or a run.
VALUE_OPTIONS = (
    "--box --gpus --sync --backend --context --namespace -n --for --rate --count -c --port "
    "--profile --timeout --size"
)
BOX_COMMANDS = "ssh down stats keep proxy runs sync"
RUN_COMMANDS = "logs attach kill"
KEEP_RUNS = 200  # per box, newest last


def _cache() -> Path:
    return paths.state_dir() / "completion.json"


def _load() -> dict[str, list[str]]:
    try:
        data = json.loads(_cache().read_text())
    except (OSError, ValueError):
        return {}
    runs = data.get("runs", {}) if isinstance(data, dict) else {}
    return {str(k): [str(i) for i in v] for k, v in runs.items() if isinstance(v, list)}


def remember_runs(box: str, ids: Iterable[str], *, replace: bool = False) -> None:
    """Best effort: completion is a convenience, never a reason for a command to fail."""
    ids = list(ids)
    with contextlib.suppress(OSError):
        runs = _load()
        known = [] if replace else runs.get(box, [])
        known = [i for i in known if i not in set(ids)] + list(ids)
        runs[box] = known[-KEEP_RUNS:]
        path = _cache()
        private.ensure_dir(path.parent)
        private.write_text(path, json.dumps({"runs": runs}))


def boxes() -> list[str]:
    names = set(_load())
    folder = paths.state_dir() / "local" / "boxes"
    with contextlib.suppress(OSError):
        # A box is a folder with a record: not the kept home of a released box, nor what a
        # claim interrupted by a crash left (store.py's layout).
        names.update(n for n in os.listdir(folder) if os.path.exists(folder / n / "box.json"))
    return sorted(names)


def runs(box: str) -> list[str]:
    return list(reversed(_load().get(box, [])))  # newest first


def complete(argv: list[str]) -> int:
    """`devbox _complete boxes` / `devbox _complete runs BOX`: one name per line."""
    if argv[:1] == ["boxes"]:
        found = boxes()
    elif argv[:1] == ["runs"] and len(argv) == 2:
        found = runs(argv[1])
    else:
        return 2
    if found:
        print("\n".join(found))
    return 0


_BASH = r"""# devbox completion for bash: eval "$(devbox completion bash)" in ~/.bashrc
_devbox() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local cmd="" box="" nargs=0 skip=0 i w
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${COMP_WORDS[i]}
        if ((skip)); then skip=0; continue; fi
        [[ $w == -- ]] && return 0
        if [[ " @VALUE@ " == *" $w "* ]]; then skip=1; continue; fi
        [[ $w == -* ]] && continue
        if [[ -z $cmd ]]; then cmd=$w; else nargs=$((nargs + 1)); ((nargs == 1)) && box=$w; fi
    done
    local words=""
    if [[ $prev == --box ]]; then
        words=$(@DEVBOX@ _complete boxes 2>/dev/null)
    elif [[ -z $cmd ]]; then
        words="@COMMANDS@"
    elif [[ " @BOX@ @RUN@ run " == *" $cmd "* && $cur == -* ]]; then
        return 0
    elif [[ " @BOX@ @RUN@ " == *" $cmd "* ]] && ((nargs == 0)); then
        words=$(@DEVBOX@ _complete boxes 2>/dev/null)
    elif [[ " @RUN@ " == *" $cmd "* ]] && ((nargs == 1)); then
        words=$(@DEVBOX@ _complete runs "$box" 2>/dev/null)
    elif [[ $cmd == completion ]]; then
        words="bash zsh"
    fi
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}
complete -o default -F _devbox devbox
"""

_ZSH = r"""#compdef devbox
# devbox completion for zsh: eval "$(devbox completion zsh)" in ~/.zshrc (after compinit)
_devbox() {
    local cmd="" box="" w
    local -i nargs=0 skip=0 i
    for ((i = 2; i < CURRENT; i++)); do
        w=${words[i]}
        if ((skip)); then skip=0; continue; fi
        [[ $w == -- ]] && return 0
        if [[ " @VALUE@ " == *" $w "* ]]; then skip=1; continue; fi
        [[ $w == -* ]] && continue
        if [[ -z $cmd ]]; then cmd=$w; else nargs+=1; ((nargs == 1)) && box=$w; fi
    done
    local -a found
    if [[ ${words[CURRENT-1]} == --box ]]; then
        found=(${(f)"$(@DEVBOX@ _complete boxes 2>/dev/null)"})
    elif [[ -z $cmd ]]; then
        found=(@COMMANDS@)
    elif [[ " @BOX@ @RUN@ " == *" $cmd "* ]] && ((nargs == 0)); then
        found=(${(f)"$(@DEVBOX@ _complete boxes 2>/dev/null)"})
    elif [[ " @RUN@ " == *" $cmd "* ]] && ((nargs == 1)); then
        found=(${(f)"$(@DEVBOX@ _complete runs "$box" 2>/dev/null)"})
    elif [[ $cmd == completion ]]; then
        found=(bash zsh)
    fi
    compadd -a found
}
compdef _devbox devbox
"""


def script(shell: str, *, commands: Iterable[str], devbox: str = "devbox") -> str:
    template = _BASH if shell == "bash" else _ZSH
    return (
        template.replace("@VALUE@", VALUE_OPTIONS)
        .replace("@COMMANDS@", " ".join(commands))
        .replace("@BOX@", BOX_COMMANDS)
        .replace("@RUN@", RUN_COMMANDS)
        .replace("@DEVBOX@", devbox)
    )
