"""What a TAB offers beyond the parser: box names and run ids, from files on the laptop only
(a TAB never waits for the network). `devbox run` and `devbox runs` remember run ids here;
devbox.cli.completion reads them. Kept below the commands so both sides can reach it."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from devbox import paths

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
    from devbox import private  # its tempfile costs a TAB, which only reads

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
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a hint file: never fails
        names.update(json.loads(paths.cluster_routes_file().read_text()).get("boxes", {}))
    folder = paths.state_dir() / "local" / "boxes"
    with contextlib.suppress(OSError):
        # A box is a folder with a record: not the kept home of a released box, nor what a
        # claim interrupted by a crash left (store.py's layout).
        names.update(n for n in os.listdir(folder) if os.path.exists(folder / n / "box.json"))
    return sorted(names)


def runs(box: str) -> list[str]:
    return list(reversed(_load().get(box, [])))  # newest first


def clusters() -> list[str]:
    """The [clusters.NAME] of the user's config, read without validating it (a TAB must
    never fail; `devbox` says what is wrong with the file)."""
    import tomllib

    with contextlib.suppress(OSError, ValueError, AttributeError):
        found = tomllib.loads(paths.config_file().read_text()).get("clusters", {})
        return sorted(str(n) for n in found) if isinstance(found, dict) else []
    return []
