"""What the real node changes on the host, and how `down` puts it back: kernel settings it
watches, its cgroup root, iptables rules (remembered before `up`, removed after), the bridge."""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
from pathlib import Path

from tests.cluster.realnode import (
    BRIDGE,
    CGROUP_ROOT,
    CHAIN,
    NODE_IP,
    SERVICE_IP,
    WATCHED_SYSCTLS,
    Paths,
    run,
)


def sysctls() -> dict[str, str]:
    out = {}
    for name in WATCHED_SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = Path("/proc/sys", name).read_text().strip()
    return out


def cgroup_dirs() -> list[Path]:
    """Our cgroup root in every mounted v1 hierarchy (and v2, where it is unified)."""
    base = Path("/sys/fs/cgroup")
    found = [base / CGROUP_ROOT] if (base / "cgroup.controllers").exists() else []
    for mount in base.iterdir() if base.is_dir() else []:
        if mount.is_dir() and not mount.is_symlink() and (mount / "cgroup.procs").exists():
            found.append(mount / CGROUP_ROOT)
    return found


TABLES = ("filter", "nat", "mangle", "raw")


def iptables_rules() -> dict[str, dict[str, list[str]]]:
    """`-S` of every table for IPv4 and IPv6 (missing tools or tables: empty)."""
    rules: dict[str, dict[str, list[str]]] = {}
    for tool in ("iptables", "ip6tables"):
        rules[tool] = {}
        for table in TABLES:
            if shutil.which(tool) is None:
                continue
            done = run(tool, "-w", "-t", table, "-S", check=False, quiet=True)
            rules[tool][table] = done.stdout.splitlines() if done.returncode == 0 else []
    return rules


def restore_iptables(before: dict[str, dict[str, list[str]]] | None) -> None:
    """Delete the rules and chains added since `before` (the kubelet's canaries and
    KUBE-FIREWALL, our DNAT). Without a record: every KUBE-* and our own chain."""
    now = iptables_rules()
    for tool, tables in now.items():
        for table, lines in tables.items():
            old = set(((before or {}).get(tool) or {}).get(table) or [])

            def added(line: str, old: set[str] = old) -> bool:
                if before is not None:
                    return line not in old
                words = line.split()
                return any(w.startswith(("KUBE-", CHAIN)) for w in words)

            for line in lines:
                if line.startswith("-A ") and added(line):
                    run(tool, "-w", "-t", table, "-D", *shlex.split(line)[1:], check=False)
            for line in lines:
                if line.startswith("-N ") and added(line):
                    chain = line.split()[1]
                    run(tool, "-w", "-t", table, "-F", chain, check=False)
            for line in lines:
                if line.startswith("-N ") and added(line):
                    run(tool, "-w", "-t", table, "-X", line.split()[1], check=False)


def bridge_owner() -> str | None:
    """The node folder that owns the bridge (kept in its alias), or None without one."""
    done = run("ip", "-d", "-j", "link", "show", BRIDGE, check=False, quiet=True)
    if done.returncode != 0:
        return None
    links = json.loads(done.stdout or "[]")
    return str(links[0].get("ifalias", "")) if links else ""


def network_up(paths: Paths, *, apiserver_port: int) -> None:
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "link", "set", BRIDGE, "alias", str(paths.root))
    run("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    # DNAT to 127.0.0.1 needs route_localnet: on this bridge only, and it goes with it.
    Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1")
    run("iptables", "-w", "-t", "nat", "-N", CHAIN)
    run("iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-i", BRIDGE, "-j", CHAIN)
    run(
        "iptables", "-w", "-t", "nat", "-A", CHAIN, "-d", f"{SERVICE_IP}/32", "-p", "tcp",
        "--dport", "443", "-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver_port}",
    )  # fmt: skip
    # Pods may reach the host only through that DNAT: not the kubelet, not whatever else
    # listens on the host's other addresses. (The API server reaches the kubelet from the
    # host itself, which does not come in through the bridge.)
    run("iptables", "-w", "-N", CHAIN)
    run("iptables", "-w", "-A", "INPUT", "-i", BRIDGE, "-j", CHAIN)
    run("iptables", "-w", "-A", CHAIN, "-m", "conntrack", "--ctstate", "DNAT", "-j", "RETURN")
    run("iptables", "-w", "-A", CHAIN, "-j", "DROP")
