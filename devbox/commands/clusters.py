"""`devbox clusters` and `devbox move`: what devbox sees of each of the user's clusters,
and carrying a box with its home from one to another."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from devbox.commands import print_table, say
from devbox.connect import clusters_for, open_socket, refresh_ssh_config
from devbox.protocol import PROBE_POINTER_FILE
from devbox.units import size

if TYPE_CHECKING:
    from devbox.backends.kubernetes.capacity import NodeGpus
    from devbox.boxes import Box


def show(args: argparse.Namespace) -> int:
    clusters = clusters_for(args)
    seen = clusters.overview()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "cluster": o.cluster.name,
                        "context": o.cluster.config.context,
                        "namespace": o.cluster.config.namespace,
                        "preference": o.cluster.preference,
                        "profiles": list(o.cluster.profiles),
                        "reachable": not o.problem,
                        "problem": o.problem,
                        "free_gpus": None
                        if o.free is None
                        else {
                            n.node: {
                                "free": n.free,
                                "allocatable": n.allocatable,
                                "product": n.product,
                            }
                            for n in o.free
                        },
                        "warm": o.warm,
                        "boxes": o.boxes,
                    }
                    for o in seen
                ]
            )
        )
        return 1 if any(o.problem for o in seen) else 0
    rows = [
        (
            "CLUSTER",
            "PREF",
            "CONTEXT",
            "NAMESPACE",
            "STATE",
            "FREE GPUS",
            "WARM",
            "BOXES",
            "PROFILES",
        )
    ]
    for o in seen:
        c = o.cluster
        rows.append(
            (
                c.name,
                str(c.preference),
                c.config.context or "(current)",
                c.config.namespace or "(context's)",
                "unreachable" if o.problem else "ok",
                "-" if o.problem else _free(o.free),
                "-" if o.problem else str(o.warm),
                "-" if o.problem else str(o.boxes),
                ",".join(c.profiles) or "all",
            )
        )
    print_table(rows)
    for o in seen:
        if o.problem:
            say(f"devbox: error: cluster {o.cluster.name}: {o.problem}")
    return 1 if any(o.problem for o in seen) else 0


def _free(nodes: list[NodeGpus] | None) -> str:
    """Free GPUs by model: "12 A100-80GB, 3 ?" ("?": nodes that do not say)."""
    if nodes is None:
        return "unknown (nodes unreadable)"
    by: dict[str, int] = {}
    for n in nodes:
        kind = n.product.removeprefix("NVIDIA-") or "?"
        by[kind] = by.get(kind, 0) + n.free
    return ", ".join(f"{count} {kind}" for kind, count in sorted(by.items())) or "no GPU nodes"


def move(args: argparse.Namespace) -> int:
    from devbox.ssh.homecopy import Copied, copy_home

    clusters = clusters_for(args)

    def copy(old: Box, new: Box) -> Copied:
        say(f"copying the home of box {old.name} from cluster {old.cluster} to {new.cluster}")
        return copy_home(
            old,
            open_socket(clusters, old),
            new,
            open_socket(clusters, new),
            # The old box's own pointer to its probe socket: a path there, nothing here.
            exclude=[PROBE_POINTER_FILE],
            progress=say,
        )

    new, copied = clusters.move(args.name, to=args.to, copy=copy)
    refresh_ssh_config(clusters)
    if args.json:
        print(json.dumps({"box": new.to_json(), **asdict(copied)}))
        return 0
    say(
        f"box {new.name} is in cluster {new.cluster}: sent {len(copied.sent)} file(s), "
        f"{size(copied.sent_bytes)}"
        + (f"; kept {len(copied.kept_newer)} newer file(s) there" if copied.kept_newer else "")
        + (f"; skipped {len(copied.skipped)}" if copied.skipped else "")
    )
    for path in copied.kept_newer:
        say(f"  kept (newer in {new.cluster}): {path}")
    for path in copied.skipped:
        say(f"  skipped: {path}")
    return 0
