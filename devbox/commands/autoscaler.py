"""`devbox autoscaler` and `devbox explain`: settings, the backend's world, the loop, the
metrics endpoint, and signals; the deciding is in policy.py."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict
from http.server import ThreadingHTTPServer
from pathlib import Path

from devbox.autoscaler import config, policy
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.metrics import Metrics, serve
from devbox.autoscaler.world import Inspectable
from devbox.boxes import Box
from devbox.connect import backend_for
from devbox.errors import UsageError
from devbox.names import validate_name
from devbox.views.explain import render

log = logging.getLogger("devbox.autoscaler")


def load_settings(world: Inspectable, path: Path | None, *, cluster: str = "") -> config.Settings:
    """--config FILE, else the backend's own (ConfigMap, or the local file), else defaults;
    `cluster`'s own [clusters.NAME] table of that document over the rest."""
    if path is not None:
        try:
            return config.parse(path.read_text(), source=str(path), cluster=cluster)
        except OSError as exc:
            raise UsageError(f"cannot read autoscaler config {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"autoscaler config {path} is not UTF-8 text") from None
    found = world.settings_text()
    if found is None:
        return config.Settings()
    text, source = found
    return config.parse(text, source=source, cluster=cluster)


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One autoscaler per cluster (the user's [clusters], or the one), each with its own
    # settings, memory and metrics endpoint: a cluster that is down holds up no other.
    worlds = backend.autoscaler_worlds()
    scalers = []
    servers = []
    try:
        for cluster, world in worlds:
            settings = load_settings(world, args.config, cluster=cluster)
            metrics = Metrics()
            if settings.metrics_port and not args.once:
                servers.append(_serve(metrics, settings, cluster))
            scalers.append((cluster, world, Autoscaler(world, settings, metrics=metrics)))
            log.info(
                "autoscaler for the %s backend%s: idle_timeout %gs, warning %gs, grace %gs, "
                "signals %s, hung %s (hung_grace %gs), save_timeout %gs",
                backend.name,
                f", cluster {cluster}" if cluster else "",
                settings.idle_timeout,
                settings.warning,
                settings.grace,
                ",".join(settings.signals),
                settings.hung,
                settings.hung_grace,
                settings.save_timeout,
            )
        if args.once:
            return _once(scalers)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        threads = [
            threading.Thread(target=scaler.run, args=(stop,), name=f"autoscaler {cluster}")
            for cluster, _, scaler in scalers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for server in servers:
            server.shutdown()
        for _, world in worlds:
            world.close()
    return 0


def _serve(metrics: Metrics, settings: config.Settings, cluster: str) -> ThreadingHTTPServer:
    try:
        server = serve(metrics, address=settings.metrics_address, port=settings.metrics_port)
    except OSError as exc:
        raise UsageError(
            f"cannot serve metrics{f' of cluster {cluster}' if cluster else ''} on "
            f"{settings.metrics_address}:{settings.metrics_port}: {exc.strerror}"
        ) from None
    log.info("metrics on http://%s:%d/metrics", *server.server_address[:2])
    return server


def _once(scalers: list[tuple[str, Inspectable, Autoscaler]]) -> int:
    """One pass of each: a JSON line each (with its cluster where there are several)."""
    failed = False
    for cluster, _, scaler in scalers:
        result = scaler.reconcile()
        failed = failed or bool(result.failed)
        line = {
            "seconds": result.seconds,
            "actions": [type(a).__name__ for a in result.applied],
            "failed": [str(e) for _, e in result.failed],
            "verdicts": {v.box: v.status for v in result.decision.verdicts},
        }
        print(json.dumps({"cluster": cluster, **line} if cluster else line))
    return 1 if failed else 0


def explain(args: argparse.Namespace) -> int:
    if args.name is not None:
        validate_name(args.name)
    backend = backend_for(args)
    # The world of the box's cluster; a box released lately is known only to its cluster's
    # memory, so one gone from every cluster needs --cluster (or a single cluster).
    try:
        box: Box | None = backend.get(args.name)
    except UsageError:
        box = None
    world = backend.autoscaler_world(args.name if box else None)
    cluster = box.cluster if box else (getattr(args, "cluster", None) or "")
    settings = load_settings(world, args.config, cluster=cluster)
    state = world.load_state()
    facts = world.find(args.name)
    now = time.time()
    if facts is None:
        released = state.last_release(args.name)
        lines = world.history(None, released.key if released else args.name)
        if released is None and not lines:
            raise UsageError(f"no box named {args.name!r}, and none released lately")
        if args.json:
            print(json.dumps({"box": args.name, "released": released and asdict(released)}))
            return 0
        if released is not None:
            clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(released.at))
            print(f"box {args.name} was released at {clock} ({released.reason}): {released.why}")
        for line in lines:
            print(f"  {line}")
        return 0
    memory = policy.observe(state.memory, [facts], settings)
    (verdict,) = policy.decide([facts], memory=memory, now=now, settings=settings).verdicts
    if args.json:
        print(json.dumps(asdict(verdict)))
        return 0
    sys.stdout.write(render(verdict, facts, state, now=now))
    for line in world.history(facts, args.name):
        print(f"  {line}")
    return 0
