"""Doctor check of what guards the bytes a consumer commits: checksums, and the debug canary."""

from __future__ import annotations

from ecshare.apps.ops.check import Check
from ecshare.apps.ops.ucx_checks import is_loopback
from ecshare.config import Config


def _tcp_allowed(config: Config) -> bool:
    """UCX may pick TCP: no transport list is set, or the list names tcp."""
    if config.ucx_tls is None:
        return True
    names = {t.strip().lstrip("^") for t in config.ucx_tls.split(",")}
    return config.ucx_tls.startswith("^") or "tcp" in names or "all" in names


def check_integrity(config: Config) -> list[Check]:
    checks = []
    hosts = [config.listen_host, config.advertise_host or config.listen_host]
    cross_host = not all(is_loopback(h) for h in hosts)
    if config.checksum != "none":
        checks.append(
            Check(
                name="checksum",
                status="ok",
                finding=f"{config.checksum}: consumers verify every item and refuse items "
                "without one",
            )
        )
    elif cross_host and _tcp_allowed(config):
        checks.append(
            Check(
                name="checksum",
                status="warn",
                finding="checksum is none and UCX may read between hosts over TCP, where only "
                "TCP's 16-bit checksum guards the bytes a consumer commits",
                fix="set checksum=xxh3_64 on every instance (ECSHARE_CHECKSUM=xxh3_64), or "
                "restrict UCX to RDMA and shared memory (ucx_tls, e.g. rc,sm,self)",
            )
        )
    else:
        checks.append(
            Check(
                name="checksum",
                status="ok",
                finding="none: reads stay on this host or on RDMA, which check their own bytes",
            )
        )
    if config.store_canary:
        checks.append(
            Check(
                name="store canary",
                status="warn",
                finding="store_canary is on: every block freed and allocated is filled or "
                "checked under the entry table's lock",
                fix="turn store_canary off outside tests and fault runs",
            )
        )
    return checks
