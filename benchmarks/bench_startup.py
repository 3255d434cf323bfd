"""Claim latency on the local backend and CLI start-up cost.

- `devbox up NAME --no-attach` then `devbox ssh NAME -- true`: median wall time
  (target < 0.5 s), with `ssh host true` against OpenSSH's sshd as the peer.
- `devbox --help` against a bare `python -c pass` (target <= 3x).
    python benchmarks/bench_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import devbox_command, emit, sandbox, ssh_base, sshd, summary, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    devbox = devbox_command()
    with sandbox() as sb:
        sb.devbox("up", "warmup", "--no-attach")  # first use makes the user's key
        sb.devbox("down", "warmup", "--purge", "--yes")
        up, ssh_true, total = [], [], []
        for i in range(args.runs):
            name = f"b{i}"
            t_up = wall([*devbox, "up", name, "--no-attach"], sb.env)
            t_ssh = wall([*devbox, "ssh", name, "--", "true"], sb.env)
            up.append(t_up)
            ssh_true.append(t_ssh)
            total.append(t_up + t_ssh)
            sb.devbox("down", name, "--purge", "--yes")
        sb.devbox("up", "steady", "--no-attach")
        warm_ssh = [
            wall([*devbox, "ssh", "steady", "--", "true"], sb.env) for _ in range(args.runs)
        ]
        with sshd(sb.root, sb.key.with_name("id_ed25519.pub")) as peer:
            openssh = ssh_base(sb.key, peer.known_hosts, peer.port)
            openssh_true = [wall([*openssh, "true"], sb.env) for _ in range(args.runs)]
        help_ = [wall([*devbox, "--help"], sb.env) for _ in range(args.runs)]
        bare = [wall([sys.executable, "-c", "pass"], sb.env) for _ in range(args.runs)]
    emit(
        {
            "benchmark": "startup",
            "runs": args.runs,
            "up_no_attach_s": summary(up),
            "ssh_true_on_new_box_s": summary(ssh_true),
            "up_then_ssh_true_s": summary(total),
            "target_up_then_ssh_true_median_s": 0.5,
            "devbox_ssh_true_on_running_box_s": summary(warm_ssh),
            "peer_openssh_ssh_true_s": summary(openssh_true),
            "devbox_help_s": summary(help_),
            "python_pass_s": summary(bare),
            "help_over_python_pass": summary(help_)["median"] / summary(bare)["median"],
            "target_help_over_python_pass": 3.0,
        }
    )


if __name__ == "__main__":
    main()
