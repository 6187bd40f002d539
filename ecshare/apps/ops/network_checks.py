"""Doctor checks of the network: the ports to bind are free, the producers named are reachable."""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

from ecshare.apps.ops.check import Check
from ecshare.config import Config


def check_ports(config: Config, producers: list[str], timeout_s: float) -> list[Check]:
    out = [_check_bind("listen port", config.listen_host, config.listen_port, "listen_port")]
    if config.metrics_port is not None:
        out.append(_check_bind("metrics port", "0.0.0.0", config.metrics_port, "metrics_port"))
    out += [_check_reach(address, timeout_s) for address in producers]
    return out


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now, or None if it could. Bound as
    libzmq and aiohttp bind: a port in TIME_WAIT is free, one that someone listens on is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
            sock.listen(1)
    except OSError as exc:
        return exc
    return None


def _check_bind(name: str, host: str, port: int, key: str) -> Check:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if port == 0:
        return Check(name=name, status="ok", finding=f"{key} 0: a free port on {host} is picked")
    exc = bind_error(host, port)
    if exc is not None:
        if exc.errno == errno.EADDRINUSE:
            return Check(
                name=name,
                status="fail",
                finding=f"{where} is already in use",
                fix=f"stop what holds it (see: ss -ltnp 'sport = :{port}'), or set another "
                f"{key} (0 picks a free one)",
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return Check(
                name=name,
                status="fail",
                finding=f"{host} is not an address of this host",
                fix="set listen_host to one of this host's addresses (see: ip -brief address)",
            )
        return Check(
            name=name,
            status="fail",
            finding=f"cannot bind {where}: {exc.strerror or exc}",
            fix=f"choose another {key}" + (" (ports < 1024 need root)" if port < 1024 else ""),
        )
    return Check(name=name, status="ok", finding=f"{where} is free")


def _check_reach(address: str, timeout_s: float) -> Check:
    name = f"producer {address}"
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if parts.scheme != "tcp" or not host or not port:
        return Check(
            name=name,
            status="fail",
            finding=f"{address!r} is not a producer address",
            fix="write it as tcp://HOST:PORT",
        )
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return Check(
            name=name,
            status="fail",
            finding=f"cannot reach {host}:{port}: {why}",
            fix="check that the producer runs (its ready line names its address), the "
            "address, and any firewall between the hosts",
        )
    return Check(name=name, status="ok", finding=f"{host}:{port} accepts TCP connections")
