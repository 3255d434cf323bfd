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

from devbox import paths
from devbox.autoscaler import config, policy
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.metrics import Metrics, serve
from devbox.autoscaler.state import State
from devbox.autoscaler.world import Inspectable
from devbox.backends.base import Backend
from devbox.errors import UsageError
from devbox.statsview import age

log = logging.getLogger("devbox.autoscaler")


def local_settings_file() -> Path:
    return paths.config_dir() / "autoscaler.toml"


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


def run(args: argparse.Namespace, backend: Backend) -> int:
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


def explain(args: argparse.Namespace, backend: Backend) -> int:
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


def render(verdict: policy.Verdict, facts: policy.BoxFacts, state: State, *, now: float) -> str:
    box = facts.box
    out = [f"box {box.name} ({box.owner or 'warm pool'}): {verdict.status}: {verdict.why}"]
    for sig in verdict.signals:
        if sig.active_now:
            when = "active now"
        elif sig.last_active:
            when = f"last active {age(now - sig.last_active)} ago"
        else:
            when = "never active"
        out.append(f"  {sig.name:<8} {when:<24} {sig.detail}")
    beat = f"{age(now - facts.heartbeat_at)} ago" if facts.heartbeat_at else "never"
    kept = (
        f"until {time.strftime('%a %H:%M', time.localtime(box.keep_until))}"
        if box.keep_until > now
        else "no"
    )
    out.append(f"  heartbeat {beat}; kept: {kept}; claimed {age(now - box.created_at)} ago")
    note = box.autoscaler_note(now)
    if note:
        out.append(f"  {note}")
    return "\n".join(out) + "\n"
