"""Bulk throughput through the devbox agent vs OpenSSH's sshd, same OpenSSH client, loopback.

Prints JSON: MB/s per direction and path, and the ratio agent/sshd (target >= 0.7).
    python benchmarks/bench_throughput.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from harness import emit, sandbox, ssh_base, sshd


def _timed(argv: list[str], env: dict[str, str], *, stdin: int | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdin=stdin, stdout=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - start


def measure(
    base: list[str], mib: int, repeat: int, payload: str, env: dict[str, str]
) -> dict[str, float]:
    size = mib * 1024 * 1024
    up, down = [], []
    for _ in range(repeat):
        with open(payload, "rb") as f:
            up.append(_timed([*base, "cat > /dev/null"], env, stdin=f.fileno()))
        down.append(_timed([*base, f"head -c {size} /dev/zero"], env))
    return {"upload_MBps": mib / min(up), "download_MBps": mib / min(down)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with sandbox() as sb:
        box = sb.devbox("up", "bench", "--no-attach", "--json")
        record = json.loads(box.stdout)
        payload = str(sb.root / "payload")
        with open(payload, "wb") as f:
            f.write(os.urandom(args.mib * 1024 * 1024))
        known = sb.root / "home/.local/state/devbox/known_hosts"
        agent = ssh_base(sb.key, known, record["port"], alias="bench.devbox")
        sb.devbox("ssh-config", "--write")
        proxied = ["ssh", "-F", str(sb.root / "home/.config/devbox/ssh_config"), "bench.devbox"]
        with sshd(sb.root, sb.key.with_name("id_ed25519.pub")) as peer:
            openssh = ssh_base(sb.key, peer.known_hosts, peer.port)
            results = {
                "sshd": measure(openssh, args.mib, args.repeat, payload, sb.env),
                "agent_direct": measure(agent, args.mib, args.repeat, payload, sb.env),
                "agent_via_proxycommand": measure(proxied, args.mib, args.repeat, payload, sb.env),
            }
    ratios = {
        f"{path}_{d}_ratio": results[path][f"{d}_MBps"] / results["sshd"][f"{d}_MBps"]
        for path in ("agent_direct", "agent_via_proxycommand")
        for d in ("upload", "download")
    }
    emit(
        {
            "benchmark": "throughput",
            "mib": args.mib,
            "repeat": args.repeat,
            "results": results,
            "ratios_vs_sshd": ratios,
            "target_ratio": 0.7,
        }
    )


if __name__ == "__main__":
    main()
