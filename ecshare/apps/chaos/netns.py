"""Running a chaos run inside a network namespace whose loopback has `tc netem` loss and delay.

The fault proxy loses and delays whole chunks; netem works per packet, under
TCP, so retransmissions and reordering happen as on a lossy link. It needs
CAP_NET_ADMIN and the kernel's sch_netem module; `netem_unavailable` says
which is missing.

Only the control plane (TCP) crosses the namespace's loopback: NIXL between
processes of one host reads by cross-memory attach and never touches it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence


class NetemUnavailable(Exception):
    pass


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def _namespace(tag: str) -> str:
    return f"ecshare-chaos-{tag}-{os.getpid()}"


def _create(ns: str, netem: str) -> None:
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailable(f"iproute2's `{tool}` command is not installed")
    made = _run("ip", "netns", "add", ns)
    if made.returncode:
        raise NetemUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    for step in (
        ("ip", "-n", ns, "link", "set", "lo", "up"),
        ("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", *netem.split()),
    ):
        done = _run(*step)
        if done.returncode:
            _run("ip", "netns", "del", ns)
            raise NetemUnavailable(f"`{' '.join(step)}` failed: {done.stderr.strip()}")


def netem_unavailable(netem: str = "delay 1ms") -> str | None:
    """Why a netem namespace cannot be made here, or None when it can."""
    ns = _namespace("probe")
    try:
        _create(ns, netem)
    except NetemUnavailable as exc:
        return str(exc)
    _run("ip", "netns", "del", ns)
    return None


def run_in_netem_namespace(argv: Sequence[str], netem: str, timeout_s: float | None) -> int:
    """Run `ecshare chaos ARGV --netem-applied NETEM` in a fresh namespace; its exit code."""
    ns = _namespace("run")
    _create(ns, netem)
    try:
        cmd = [
            "ip", "netns", "exec", ns,
            sys.executable, "-m", "ecshare", "chaos", *argv, "--netem-applied", netem,
        ]  # fmt: skip
        return subprocess.run(cmd, timeout=timeout_s).returncode
    finally:
        _run("ip", "netns", "del", ns)
