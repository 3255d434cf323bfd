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
from pathlib import Path

from devbox.autoscaler import config, policy
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.metrics import Metrics, serve
from devbox.autoscaler.world import Inspectable
from devbox.connect import backend_for
from devbox.errors import UsageError
from devbox.names import validate_name
from devbox.views.explain import render

log = logging.getLogger("devbox.autoscaler")


def load_settings(world: Inspectable, path: Path | None) -> config.Settings:
    """--config FILE, else the backend's own (ConfigMap, or the local file), else defaults."""
    if path is not None:
        try:
            return config.parse(path.read_text(), source=str(path))
        except OSError as exc:
            raise UsageError(f"cannot read autoscaler config {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"autoscaler config {path} is not UTF-8 text") from None
    found = world.settings_text()
    if found is None:
        return config.Settings()
    text, source = found
    return config.parse(text, source=source)


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    world = backend.autoscaler_world()
    settings = load_settings(world, args.config)
    metrics = Metrics()
    server = None
    if settings.metrics_port and not args.once:
        try:
            server = serve(metrics, address=settings.metrics_address, port=settings.metrics_port)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {settings.metrics_address}:{settings.metrics_port}: "
                f"{exc.strerror}"
            ) from None
        log.info("metrics on http://%s:%d/metrics", *server.server_address[:2])
    scaler = Autoscaler(world, settings, metrics=metrics)
    log.info(
        "autoscaler for the %s backend: idle_timeout %gs, warning %gs, grace %gs, signals %s",
        backend.name,
        settings.idle_timeout,
        settings.warning,
        settings.grace,
        ",".join(settings.signals),
    )
    if args.once:
        result = scaler.reconcile()
        print(
            json.dumps(
                {
                    "seconds": result.seconds,
                    "actions": [type(a).__name__ for a in result.applied],
                    "failed": [str(e) for _, e in result.failed],
                    "verdicts": {v.box: v.status for v in result.decision.verdicts},
                }
            )
        )
        return 1 if result.failed else 0
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        scaler.run(stop)
    finally:
        if server is not None:
            server.shutdown()
        world.close()
    return 0


def explain(args: argparse.Namespace) -> int:
    if args.name is not None:
        validate_name(args.name)
    backend = backend_for(args)
    world = backend.autoscaler_world()
    settings = load_settings(world, args.config)
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
