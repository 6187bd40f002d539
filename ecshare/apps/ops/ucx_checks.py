"""Doctor check of the UCX transports NIXL will read through (probed in a child process)."""

from __future__ import annotations

import ipaddress
from typing import Any

from ecshare.apps.ops.check import Check
from ecshare.apps.ops.ucx import UcxProbe
from ecshare.apps.ops.versions import SUPPORTED
from ecshare.config import Config


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_ucx(config: Config, probe: UcxProbe | None, error: str, env: dict[str, str]) -> Check:
    selected = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "UCX defaults"
    if probe is None:
        return Check(
            name="ucx transports",
            status="fail",
            finding=f"could not ask UCX for its transports: {error}",
            fix="check the nixl install (see the nixl check) and UCX_TLS / UCX_NET_DEVICES",
        )
    if not probe.library:
        return Check(
            name="ucx transports",
            status="fail",
            finding="no UCX library found (neither in the nixl wheel nor on the system)",
            fix="run: " + next(s.install for s in SUPPORTED if s.component == "nixl"),
        )
    details: dict[str, Any] = {
        "ucx_version": probe.version,
        "library": probe.library,
        "selection": env,
        "resources": [f"{t}/{d}" for t, d in probe.resources],
    }
    if probe.error or not probe.resources:
        return Check(
            name="ucx transports",
            status="fail",
            finding=f"UCX {probe.version} found no usable transport with {selected}: "
            f"{probe.error or 'no resources'}" + (f" ({error})" if error else ""),
            fix="unset UCX_TLS / UCX_NET_DEVICES (ucx_tls, ucx_net_devices) or name "
            "transports and devices this host has",
            details=details,
        )
    tcp = probe.devices("tcp")
    shm = probe.shared_memory
    rdma = probe.rdma
    summary = (
        f"UCX {probe.version} ({selected}): tcp on {', '.join(tcp) or 'no device'}; "
        f"shared memory {', '.join(shm) or 'none'}; RDMA {', '.join(rdma) or 'none'}"
    )
    hosts = [config.listen_host, config.advertised_host]
    cross_host = not all(is_loopback(h) for h in hosts)
    if not tcp and not rdma and "cma" not in shm:
        return Check(
            name="ucx transports",
            status="fail",
            finding=summary + ": no transport NIXL can READ through",
            fix="allow tcp (UCX_TLS=tcp,cma,self or unset UCX_TLS)",
            details=details,
        )
    if "cma" not in shm:
        return Check(
            name="ucx transports",
            status="warn",
            finding=summary + ": no cma, so reads on this host go through TCP",
            fix="allow cma (add it to UCX_TLS / ucx_tls); cma needs processes that may ptrace "
            "each other (same user, kernel.yama.ptrace_scope <= 1)",
            details=details,
        )
    if cross_host and not rdma:
        return Check(
            name="ucx transports",
            status="warn",
            finding=summary + ": peers on other hosts will be read over TCP, not RDMA",
            fix="for RDMA between hosts install rdma-core and the NIC driver, check "
            "`ibv_devices`, and allow the device (ucx_net_devices, e.g. mlx5_0:1)",
            details=details,
        )
    return Check(name="ucx transports", status="ok", finding=summary, details=details)
