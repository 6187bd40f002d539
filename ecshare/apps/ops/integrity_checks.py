"""Doctor check of what guards the bytes a consumer commits: checksums, and the debug canary."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from ecshare.apps.ops.check import Check
from ecshare.apps.ops.ucx_checks import is_loopback
from ecshare.config import Config


def _tcp_allowed(config: Config) -> bool:
    """UCX may pick TCP: no transport list is set, or the list names tcp."""
    if config.ucx_tls is None:
        return True
    names = {t.strip().lstrip("^") for t in config.ucx_tls.split(",")}
    return config.ucx_tls.startswith("^") or "tcp" in names or "all" in names


def _host_of(endpoint: str) -> str | None:
    try:
        return urlsplit(endpoint if "://" in endpoint else f"tcp://{endpoint}").hostname
    except ValueError:
        return None


def _is_consumer(config: Config) -> bool:
    return bool(
        config.client_secret_key_file
        or config.server_public_key_file
        or config.server_public_key
        or config.trusted_producers
    )


def check_integrity(config: Config, producers: Sequence[str] = ()) -> list[Check]:
    """What guards committed bytes. Reads cross hosts where this instance is reachable from
    another host (a producer read from there), or where a producer it reads from (its
    `trusted_producers`, or one named to doctor) is on another host."""
    checks = []
    remote = sorted(
        {
            host
            for host in map(_host_of, [*config.trusted_producers, *producers])
            if host is not None and not is_loopback(host)
        }
    )
    hosts = [config.listen_host, config.advertised_host]
    served_off_host = not all(is_loopback(h) for h in hosts)
    # A consumer told of no producer reads wherever its requests point.
    unknown = _is_consumer(config) and not config.trusted_producers and not producers
    tcp = _tcp_allowed(config)
    fix = (
        "set checksum=xxh3_64 on every instance (ECSHARE_CHECKSUM=xxh3_64), or "
        "restrict UCX to RDMA and shared memory (ucx_tls, e.g. rc,sm,self)"
    )
    if config.checksum != "none":
        checks.append(
            Check(
                name="checksum",
                status="ok",
                finding=f"{config.checksum}: consumers verify every item and refuse items "
                "without one",
            )
        )
    elif tcp and (remote or served_off_host):
        where = (
            f"it reads from producers on {', '.join(remote)}"
            if remote
            else f"it is reachable from other hosts ({config.advertised_host})"
        )
        checks.append(
            Check(
                name="checksum",
                status="warn",
                finding=f"checksum is none and UCX may move bytes between hosts over TCP "
                f"({where}), where only TCP's 16-bit checksum guards the bytes a consumer commits",
                fix=fix,
            )
        )
    elif tcp and unknown:
        checks.append(
            Check(
                name="checksum",
                status="warn",
                finding="checksum is none, and this consumer has no trusted_producers: it reads "
                "from wherever its requests' producers are, over TCP when one is on another host",
                fix="set trusted_producers (and name them to doctor with --producer), or " + fix,
            )
        )
    elif tcp:
        checks.append(
            Check(
                name="checksum",
                status="ok",
                finding="none: reads stay on this host, which copies the bytes within memory",
            )
        )
    else:
        checks.append(
            Check(
                name="checksum",
                status="ok",
                finding=f"none: UCX is limited to {config.ucx_tls}, with no TCP; RDMA and shared "
                "memory check their own bytes",
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
