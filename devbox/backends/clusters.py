"""Several Kubernetes clusters as one backend: the user's `[clusters.NAME]` tables.

Each cluster is a KubernetesBackend of its own (its kubeconfig, context, namespace and
settings); this adds what spans them:
- a claim reads every cluster in parallel and goes where placement.py says: a ready warm
  pod anywhere first, else the most preferred cluster with room, failing over to the next
  when a new pod is not scheduled within `schedule_timeout` (that cluster is then tried
  last for `failure_memory` seconds);
- `list` asks every cluster at once and waits for each at most `cluster_wait`: a cluster that
  is down or slow is reported as such (`problems`) and never holds the others up;
- every other command finds a box's cluster by name: first where the box was last seen
  (a file of the user's), else by asking all of them. Names are unique across clusters
  (a claim checks), so `NAME.devbox` is unambiguous; a duplicate made while a cluster was
  unreachable is refused by name with both clusters named, never guessed.

The routing file only says where to ask first: the cluster's API server still decides
what the user may see and do.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from devbox import names, paths, private, saves
from devbox.backends import placement
from devbox.backends.kubernetes import KubernetesBackend, NotScheduled
from devbox.backends.kubernetes.rest import Unreachable
from devbox.boxes import Box, BoxSpec
from devbox.config import ClusterConfig, Config
from devbox.errors import DevboxError, UsageError
from devbox.profiles import Profile
from devbox.ssh import known_hosts

if TYPE_CHECKING:
    from devbox.autoscaler.world import Inspectable
    from devbox.backends.base import WarmPool

T = TypeVar("T")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Overview:
    """One cluster as `devbox clusters` shows it."""

    cluster: ClusterConfig
    problem: str = ""  # empty: reachable
    free: builtins.list[Any] | None = None  # capacity.NodeGpus; None: nodes unreadable
    warm: int = 0
    boxes: int = 0


class Clusters:
    name = "kubernetes"
    look_interval = KubernetesBackend.look_interval
    direct_ssh = False

    def __init__(
        self,
        *,
        config: Config,
        pinned: str | None = None,
        progress: Callable[[str], None] = _stderr,
    ) -> None:
        self.config = config
        self.progress = progress
        self.clusters = {c.name: c for c in config.clusters}
        if pinned is not None and pinned not in self.clusters:
            raise UsageError(
                f"no cluster {pinned!r} in your config: the clusters are {', '.join(self.clusters)}"
            )
        self.pinned = pinned
        self._members: dict[str, KubernetesBackend] = {}
        self._problems: builtins.list[str] = []
        self._silent: builtins.list[str] = []  # clusters the last list did not read
        # What `resolve` read, for the `claim` that follows it: (profile, per cluster), and
        # the name it drew.
        self._survey: tuple[str, dict[str, _Survey]] | None = None
        self._drawn = ""

    # --- members --------------------------------------------------------------------

    def member(self, cluster: str) -> KubernetesBackend:
        if cluster not in self._members:
            self._members[cluster] = KubernetesBackend(
                config=self.clusters[cluster].config, progress=self.progress
            )
        return self._members[cluster]

    def _scope(self) -> builtins.list[str]:
        """The clusters a command looks at: the pinned one, else all, most preferred first."""
        return [self.pinned] if self.pinned else builtins.list(self.clusters)

    def _stamp(self, cluster: str, box: Box) -> Box:
        return dataclasses.replace(box, cluster=cluster)

    # --- finding boxes --------------------------------------------------------------

    def list(self) -> builtins.list[Box]:
        found = _parallel(
            self._scope(), lambda c: self.member(c).list(), wait=self.config.cluster_wait
        )
        self._problems = []
        boxes: builtins.list[Box] = []
        answered: dict[str, builtins.list[str]] = {}
        for cluster, result in found.items():
            if isinstance(result, BaseException):
                down = isinstance(result, TimeoutError | Unreachable)
                self._problems.append(
                    f"cluster {cluster}{' is unreachable' if down else ''}: {_why(result)}"
                )
                continue
            boxes += [self._stamp(cluster, b) for b in result]
            answered[cluster] = [b.name for b in result]
        _routes.update(answered)
        # Not listed: the silent ones, and those --cluster left out.
        self._silent = [c for c in self.clusters if c not in answered]
        return sorted(boxes, key=lambda b: b.name)

    def problems(self) -> builtins.list[str]:
        return builtins.list(self._problems)

    def unlisted(self) -> builtins.list[builtins.list[str]]:
        return [["--cluster", c] for c in self._silent]

    def locate(self, name: str) -> str:
        """The cluster holding the user's box `name` (UsageError when none or several)."""
        return self._find(name)[0]

    def get(self, name: str) -> Box:
        return self._find(name)[1]

    def _find(self, name: str) -> tuple[str, Box]:
        names.validate_name(name)
        if self.pinned:
            return self.pinned, self._stamp(self.pinned, self.member(self.pinned).get(name))
        first = _routes.cluster_of(name)
        if first in self.clusters:
            with contextlib.suppress(DevboxError):
                return first, self._stamp(first, self.member(first).get(name))
        found = _parallel(
            builtins.list(self.clusters),
            lambda c: self.member(c).get(name),
            wait=self.config.cluster_wait,
        )
        holders = {c: r for c, r in found.items() if isinstance(r, Box)}
        if len(holders) == 1:
            ((cluster, box),) = holders.items()
            _routes.remember(name, cluster)
            return cluster, self._stamp(cluster, box)
        if holders:
            raise UsageError(
                f"box {name!r} is in clusters {', '.join(holders)}: name one with --cluster"
            )
        for result in found.values():  # another user's box of that name: that line
            if isinstance(result, UsageError) and "belongs to" in result.message:
                raise result
        _routes.forget(name)
        silent = [
            f"{c} ({_why(r)})"
            for c, r in found.items()
            if isinstance(r, BaseException) and not isinstance(r, UsageError)
        ]
        raise UsageError(
            f"no box named {name!r} in your clusters"
            + (f"; not answering: {', '.join(silent)}" if silent else "")
        )

    def keep(self, name: str, *, until: float) -> Box:
        cluster = self.locate(name)
        return self._stamp(cluster, self.member(cluster).keep(name, until=until))

    def release(
        self,
        name: str,
        *,
        purge: bool = False,
        confirm: Callable[[str], None] | None = None,
        save: saves.Ask | None = None,
    ) -> bool:
        cluster = self.locate(name)
        done = self.member(cluster).release(name, purge=purge, confirm=confirm, save=save)
        _routes.forget(name)
        return done

    # --- profiles and claims --------------------------------------------------------

    def profiles(self) -> builtins.list[Profile]:
        """Every profile some cluster offers; the most preferred cluster's of a name wins."""
        found = _parallel(
            self._scope(), lambda c: self.member(c).profiles(), wait=self.config.cluster_wait
        )
        out: dict[str, Profile] = {}
        for cluster, result in found.items():
            if isinstance(result, BaseException):
                self.progress(f"devbox: cluster {cluster}: {_why(result)}")
                continue
            for prof in result:
                if self.clusters[cluster].offers(prof.name) and prof.name not in out:
                    out[prof.name] = dataclasses.replace(
                        prof, source=f"cluster {cluster}: {prof.source}"
                    )
        return builtins.list(out.values())

    def resolve(self, profile: str, *, gpus: int | None = None) -> BoxSpec:
        """The spec of the most preferred cluster that offers `profile`. Each cluster's own
        catalog is read (and its warm pods of that shape: the claim that follows needs
        them), all at once; `claim` turns the spec into each cluster's own."""
        survey = self._read(profile, gpus)
        for cluster in self._scope():
            seen = survey[cluster]
            if seen.spec is not None:
                return seen.spec
        problems = [f"{c}: {s.unusable}" for c, s in survey.items()]
        raise UsageError(
            f"no cluster can make a box of profile {profile!r} ({'; '.join(problems)})"
        )

    def _read(self, profile: str, gpus: int | None) -> dict[str, _Survey]:
        # A name for a claim that names none, checked free in the other clusters' threads,
        # beside their other requests (the first cluster's path stays as with one cluster:
        # there, as ever, four random hex digits make a clash rare).
        drawn = names.generate_name()
        first = self._scope()[0]

        def survey(cluster: str) -> _Survey:
            member = self.member(cluster)
            taken = cluster != first and member.exists(drawn)
            if not self.clusters[cluster].offers(profile):
                return _Survey(unusable=f"does not offer profile {profile!r}", drawn_free=not taken)
            try:
                spec = member.resolve(profile, gpus=gpus)
            except UsageError as exc:
                return _Survey(unusable=exc.message, drawn_free=not taken)
            return _Survey(spec=spec, warm=member.ready_warm(spec), drawn_free=not taken)

        found = _parallel(self._scope(), survey, wait=self.config.start_timeout)
        out = {
            c: r if not isinstance(r, BaseException) else _Survey(unusable=_why(r))
            for c, r in found.items()
        }
        self._survey = (profile, out)
        self._drawn = drawn
        return out

    def _new_name(self, survey: dict[str, _Survey]) -> str:
        """A generated name no cluster has: the survey's, when every cluster answered that
        it is free (the usual case), else drawn again and asked of all."""
        if set(survey) == set(self.clusters) and all(s.drawn_free for s in survey.values()):
            return self._drawn
        for _ in range(5):
            name = names.generate_name()
            # One that does not answer cannot hold a name four random hex digits make rare.
            if not any(r is True for r in self._holding(name).values()):
                return name
        raise DevboxError("could not draw a box name that no cluster has: name the box")

    def claim(self, spec: BoxSpec, *, name: str | None = None) -> Box:
        # The survey `resolve` made for this very spec, else a new one.
        if self._survey and any(s.spec == spec for s in self._survey[1].values()):
            survey = self._survey[1]
        else:
            survey = self._read(spec.profile, spec.gpus)
        if name is None:
            name = self._new_name(survey)
        else:
            self._check_free(name)
        seen = [self._seen(c, survey[c]) for c in self._scope()]
        warm = placement.warm_choice(seen)
        if warm is not None:
            self.progress(f"cluster {warm.cluster}: {warm.reason}")
            return self._claim_in(warm.cluster, survey[warm.cluster], name, last=True)
        usable = [s.cluster for s in seen if not s.unusable]
        free = _parallel(
            usable, lambda c: self.member(c).free_gpus(), wait=self.config.cluster_wait
        )
        seen = [dataclasses.replace(s, free=_free_counts(free.get(s.cluster))) for s in seen]
        choices = placement.order(seen, gpus=spec.gpus, failed=_routes.failures(self.config))
        if not choices:
            raise DevboxError(
                "no cluster can take the box: "
                + "; ".join(f"{s.cluster}: {s.unusable}" for s in seen)
            )
        failures = []
        for i, choice in enumerate(choices):
            last = i == len(choices) - 1
            self.progress(f"trying cluster {choice.cluster} ({choice.reason})")
            try:
                return self._claim_in(choice.cluster, survey[choice.cluster], name, last=last)
            except UsageError:
                raise  # the user's mistake: the same in every cluster
            except DevboxError as exc:
                if isinstance(exc, NotScheduled):
                    _routes.failed(choice.cluster)
                failures.append(f"{choice.cluster}: {exc.message}")
                if last:
                    raise DevboxError(
                        "no cluster could start the box: " + "; ".join(failures)
                    ) from None
                self.progress(f"cluster {choice.cluster}: {exc.message}; trying the next")
        raise AssertionError("unreachable: the last choice returns or raises")

    def _seen(self, cluster: str, survey: _Survey) -> placement.Seen:
        return placement.Seen(
            cluster=cluster,
            preference=self.clusters[cluster].preference,
            unusable=survey.unusable,
            warm=len(survey.warm),
        )

    def _claim_in(self, cluster: str, survey: _Survey, name: str, *, last: bool) -> Box:
        assert survey.spec is not None  # placement never picks an unusable cluster
        box = self.member(cluster).claim(
            survey.spec,
            name=name,
            warm=survey.warm,
            schedule_within=None if last else self.config.schedule_timeout,
            name_checked=True,
        )
        _routes.remember(box.name, cluster)
        return self._stamp(cluster, box)

    def _check_free(self, name: str) -> None:
        """A name the user chose is free in every cluster that answers; one that does not
        answer is said (a duplicate made then is refused by name later, never guessed)."""
        for cluster, result in self._holding(name).items():
            if result is True:
                raise UsageError(f"a box named {name!r} already exists in cluster {cluster}")
            if isinstance(result, BaseException):
                self.progress(
                    f"devbox: could not check cluster {cluster} for a box named "
                    f"{name!r}: {_why(result)}"
                )

    def _holding(self, name: str) -> dict[str, bool | BaseException]:
        """Per cluster, all at once: whether any box there is called `name`."""
        return _parallel(
            builtins.list(self.clusters),
            lambda c: self.member(c).exists(name),
            wait=self.config.cluster_wait,
        )

    # --- moving ---------------------------------------------------------------------

    def move(self, name: str, *, to: str, copy: Callable[[Box, Box], T]) -> tuple[Box, T]:
        """Box `name` and its home to cluster `to`: a box of the same profile and GPUs is
        claimed there under the same name, `copy(old, new)` carries the home over, and
        only then is the old box released (its home stays in its cluster, so a move back
        sends only what changed). A failed copy releases the new box instead: the old
        one is left as it was."""
        if to not in self.clusters:
            raise UsageError(
                f"no cluster {to!r} in your config: the clusters are {', '.join(self.clusters)}"
            )
        source, old = self._find(name)
        if source == to:
            raise UsageError(f"box {name} is in cluster {to} already")
        if not self.clusters[to].offers(old.spec.profile):
            raise UsageError(f"cluster {to} does not offer profile {old.spec.profile!r}")
        target = self.member(to)
        if target.exists(name):
            raise UsageError(f"cluster {to} has a box named {name!r} already")
        spec = target.resolve(old.spec.profile, gpus=old.spec.gpus)
        self.progress(f"starting box {name} in cluster {to}")
        new = self._stamp(to, target.claim(spec, name=name, name_checked=True))
        try:
            known_hosts.pin_also(name, old.host_key)  # the claim pinned the new box's only
            result = copy(old, new)
        except BaseException:
            self.progress(
                f"releasing the new box in cluster {to}: box {name} stays in cluster {source}"
            )
            with contextlib.suppress(DevboxError):
                target.release(name)
            known_hosts.pin(name, old.host_key)
            raise
        self.member(source).release(name)  # unpins the name's keys: the new one goes back
        known_hosts.pin(name, new.host_key)
        _routes.remember(name, to)
        return new, result

    # --- connecting -----------------------------------------------------------------

    def _of(self, box: Box) -> KubernetesBackend:
        return self.member(box.cluster or self.locate(box.name))

    def open_socket(self, box: Box) -> socket.socket:
        return self._of(box).open_socket(box)

    def proxy_stdio(self, box: Box) -> bool:
        return self._of(box).proxy_stdio(box)

    def proxy_args(self, box: Box) -> builtins.list[str]:
        # The cluster, not its namespace: the config says where the cluster is, so an alias
        # keeps working whatever the user's current kubeconfig context.
        return ["--cluster", box.cluster or self.locate(box.name)]

    def sync_root(self, box: Box) -> str | None:
        return self._of(box).sync_root(box)

    # --- per cluster ----------------------------------------------------------------

    def warm_pool(self) -> WarmPool:
        return self.member(self._one("warm pools"))

    def autoscaler_world(self, box: str | None = None) -> Inspectable:
        where = self.locate(box) if box is not None else self._one("autoscalers")
        return self.member(where).autoscaler_world()

    def autoscaler_worlds(self) -> builtins.list[tuple[str, Inspectable]]:
        return [(c, self.member(c).autoscaler_world()) for c in self._scope()]

    def _one(self, what: str) -> str:
        if self.pinned:
            return self.pinned
        if len(self.clusters) == 1:
            return next(iter(self.clusters))
        raise UsageError(
            f"{what} are per cluster: name one with --cluster ({', '.join(self.clusters)})"
        )

    def overview(self) -> builtins.list[Overview]:
        """What devbox sees of each cluster, read at once: for `devbox clusters`."""

        def look(cluster: str) -> Overview:
            member = self.member(cluster)
            mine = member.list()
            return Overview(
                self.clusters[cluster],
                free=member.free_gpus(),
                warm=len(member.pool()),
                boxes=len(mine),
            )

        found = _parallel(self._scope(), look, wait=self.config.cluster_wait * 2)
        return [
            r if not isinstance(r, BaseException) else Overview(self.clusters[c], problem=_why(r))
            for c, r in found.items()
        ]


@dataclasses.dataclass(frozen=True)
class _Survey:
    """A cluster as a claim of one profile found it."""

    spec: BoxSpec | None = None
    warm: builtins.list[dict[str, Any]] = dataclasses.field(default_factory=builtins.list)
    unusable: str = ""
    drawn_free: bool = False  # no box there has the name the survey drew


def _free_counts(found: object) -> Sequence[int] | None:
    if found is None or isinstance(found, BaseException):
        return None
    return [n.free for n in found]  # type: ignore[attr-defined]


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc)
    if isinstance(exc, DevboxError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


def _parallel(
    clusters: Sequence[str], call: Callable[[str], T], *, wait: float | None = None
) -> dict[str, T | BaseException]:
    """`call(cluster)` for every cluster at once, in the given order: a result or the
    exception it raised, or a TimeoutError for one still running after `wait` seconds.

    The first cluster is asked on this thread (its kept-alive connection then serves the
    request that usually follows: a claim's PATCH); the others on daemon threads, which a
    cluster that never answers leaves behind without holding up the command's exit."""
    results: dict[str, T | BaseException] = {}

    def one(cluster: str) -> None:
        try:
            results[cluster] = call(cluster)
        except BaseException as exc:
            results[cluster] = exc

    threads = []
    for cluster in clusters[1:]:
        thread = threading.Thread(target=one, args=(cluster,), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = None if wait is None else time.monotonic() + wait
    if clusters:
        one(clusters[0])
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    out: dict[str, T | BaseException] = {}
    for cluster in clusters:
        out[cluster] = results.get(cluster, TimeoutError(f"no answer within {wait:g}s"))
    return out


class _Routes:
    """Where the user's boxes were last seen, and which clusters lately failed to
    schedule a pod: the file clusters.json in devbox's private state folder. Only ever
    a hint (see the module's docstring); a broken file is an empty one."""

    def _path(self) -> Path:
        return paths.cluster_routes_file()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._path().read_text())
        except (OSError, ValueError):
            return {"boxes": {}, "failed": {}}
        if not isinstance(data, dict):
            return {"boxes": {}, "failed": {}}
        return {
            "boxes": {str(k): str(v) for k, v in dict(data.get("boxes") or {}).items()},
            "failed": {
                str(k): float(v)
                for k, v in dict(data.get("failed") or {}).items()
                if isinstance(v, int | float)
            },
        }

    def _save(self, data: dict[str, dict[str, Any]]) -> None:
        with contextlib.suppress(OSError, DevboxError):  # a hint: never worth a failure
            private.ensure_dir(paths.state_dir())
            private.write_text(self._path(), json.dumps(data, sort_keys=True))

    def cluster_of(self, name: str) -> str | None:
        return self._load()["boxes"].get(name)

    def remember(self, name: str, cluster: str) -> None:
        data = self._load()
        if data["boxes"].get(name) != cluster:
            data["boxes"][name] = cluster
            self._save(data)

    def forget(self, name: str) -> None:
        data = self._load()
        if data["boxes"].pop(name, None) is not None:
            self._save(data)

    def update(self, answered: dict[str, builtins.list[str]]) -> None:
        """The full lists of the clusters that answered replace what was known of them."""
        data = self._load()
        boxes = {n: c for n, c in data["boxes"].items() if c not in answered}
        for cluster, listed in answered.items():
            boxes.update(dict.fromkeys(listed, cluster))
        if boxes != data["boxes"]:
            data["boxes"] = boxes
            self._save(data)

    def failed(self, cluster: str) -> None:
        data = self._load()
        data["failed"][cluster] = time.time()
        self._save(data)

    def failures(self, config: Config) -> dict[str, float]:
        """Clusters that failed within the failure memory, and how many seconds ago."""
        now = time.time()
        return {
            c: now - at
            for c, at in self._load()["failed"].items()
            if 0 <= now - at < config.failure_memory
        }


_routes = _Routes()
