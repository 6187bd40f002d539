"""The doctor's checks of the machine and the config; each returns findings, never raises.

A `Check` has a name, a status (ok / warn / fail), a one-line finding and, when
not ok, a fix an operator can act on. The checks that load native libraries
(UCX, the NIXL self-test) run in child processes; see doctor.py.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import resource
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from ecshare.bench.synthetic import format_size
from ecshare.config import Config
from ecshare.control.errors import ControlConfigError
from ecshare.ops.ucx import UcxProbe
from ecshare.ops.versions import SUPPORTED, Supported, installed

Status = Literal["ok", "warn", "fail"]
MiB = 1 << 20
GiB = 1 << 30
# /dev/shm below this breaks vLLM's worker processes (Docker's default is 64 MiB).
SHM_FAIL_BYTES = 64 * MiB
SHM_WARN_BYTES = 1 * GiB
# A region over this share of the memory the process can get leaves too little for the engine.
REGION_WARN_SHARE = 0.75
_CGROUP_UNLIMITED = 1 << 60
_KEY_FIX = "create a pair with `ecshare keys generate DIR --name NAME`, or correct the path"


class Check(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    status: Status
    finding: str
    fix: str = ""
    details: dict[str, Any] = {}


def guarded(name: str, check: Callable[[], list[Check]]) -> list[Check]:
    """Run a check; a bug in it becomes a failed check, not a traceback."""
    try:
        return check()
    except Exception as exc:
        return [
            Check(
                name=name,
                status="fail",
                finding=f"the check itself failed: {type(exc).__name__}: {exc}",
                fix="report this as an ecshare bug, with the output of `ecshare doctor --json`",
            )
        ]


# -- nixl and versions ---------------------------------------------------------------------------


def check_nixl() -> Check:
    try:
        import nixl._api as api
    except Exception as exc:  # ImportError, or a native library that fails to load
        spec = next(s for s in SUPPORTED if s.component == "nixl")
        return Check(
            name="nixl",
            status="fail",
            finding=f"nixl is not importable ({type(exc).__name__}: {exc}); no data plane",
            fix=f"run: {spec.install}",
        )
    version = _dist_version("nixl") or "unknown version"
    if not hasattr(api, "nixl_agent"):
        return Check(
            name="nixl",
            status="fail",
            finding=f"nixl {version} imports, but nixl._api has no nixl_agent",
            fix="reinstall: " + next(s.install for s in SUPPORTED if s.component == "nixl"),
        )
    return Check(name="nixl", status="ok", finding=f"nixl {version} imports (nixl._api)")


def check_versions() -> list[Check]:
    return [_check_version(spec) for spec in SUPPORTED]


def _check_version(spec: Supported) -> Check:
    name = f"version {spec.component}"
    found = installed(spec)
    if found.missing:
        return Check(
            name=name,
            status="warn",
            finding=f"{spec.component} is not installed; needed for {spec.needed_for}",
            fix=f"if you need it, run: {spec.install}",
        )
    shown = ", ".join(f"{d} {v}" for d, v in found.found.items())
    if found.outside:
        return Check(
            name=name,
            status="fail",
            finding=f"{shown} is outside the supported range {spec.specifier}",
            fix=f"run: {spec.install}",
            details={"installed": found.found, "supported": spec.specifier},
        )
    return Check(
        name=name,
        status="ok",
        finding=f"{shown} (supported: {spec.specifier})",
        details={"installed": found.found, "supported": spec.specifier},
    )


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- UCX -----------------------------------------------------------------------------------------


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
    hosts = [config.listen_host, config.advertise_host or config.listen_host]
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


# -- memory --------------------------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[key] = int(words[0]) * (1024 if len(words) > 1 else 1)
    return out


def _cgroup_headroom() -> tuple[int, int] | None:
    """(limit, limit - usage) of this process's memory cgroup, or None when unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= _CGROUP_UNLIMITED:
            return None
        return int(raw), max(0, int(raw) - usage)
    return None


def check_memory(config: Config) -> Check:
    region = config.region_bytes
    available = _meminfo().get("MemAvailable")
    if available is None:
        return Check(
            name="memory",
            status="warn",
            finding="cannot read MemAvailable from /proc/meminfo; region size unchecked",
            fix="check by hand that region_bytes fits in free memory",
        )
    budget, limits = available, [f"MemAvailable {format_size(available)}"]
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        limit, headroom = cgroup
        limits.append(f"cgroup limit {format_size(limit)} with {format_size(headroom)} left")
        budget = min(budget, headroom)
    details = {"region_bytes": region, "budget_bytes": budget, "mem_available": available}
    # The region is a memfd: it is backed by RAM (shmem), up front when prefaulted.
    where = f"region_bytes {format_size(region)} (a memfd in RAM"
    where += ", committed at start-up)" if config.prefault else ", committed as it fills)"
    measured = "; ".join(limits)
    if region > budget:
        suggest = max(MiB, int(budget * 0.5) // config.block_bytes * config.block_bytes)
        return Check(
            name="memory",
            status="fail",
            finding=f"{where} is more than this process can get ({measured})",
            fix=f"lower region_bytes, e.g. --region-bytes {suggest} (ECSHARE_REGION_BYTES), or "
            "free memory / raise the container's memory limit",
            details=details,
        )
    if region > REGION_WARN_SHARE * budget:
        return Check(
            name="memory",
            status="warn",
            finding=f"{where} takes over {REGION_WARN_SHARE:.0%} of what is left ({measured}), "
            "leaving little for the engine",
            fix="lower region_bytes, or give the host or container more memory",
            details=details,
        )
    return Check(name="memory", status="ok", finding=f"{where} fits: {measured}", details=details)


def check_memlock(config: Config, probe: UcxProbe | None) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    shown = "unlimited" if unlimited else format_size(soft)
    rdma = probe.rdma if probe is not None else []
    if not rdma:
        return Check(
            name="memlock",
            status="ok",
            finding=f"RLIMIT_MEMLOCK {shown}; no RDMA transport, and tcp/cma pin no pages",
        )
    if unlimited or soft >= config.region_bytes:
        return Check(
            name="memlock",
            status="ok",
            finding=f"RLIMIT_MEMLOCK {shown} covers the region for RDMA registration",
        )
    return Check(
        name="memlock",
        status="warn",
        finding=f"RLIMIT_MEMLOCK {shown} is below region_bytes {format_size(config.region_bytes)}:"
        " RDMA registration of the region may fail or fall back",
        fix="run: ulimit -l unlimited (systemd: LimitMEMLOCK=infinity; Docker: "
        "--ulimit memlock=-1)",
    )


def check_shm(config: Config, path: str) -> Check:
    note = f"the region ({format_size(config.region_bytes)}) is a memfd and does not use it"
    mount_fix = (
        f"enlarge it: mount -o remount,size=2g {path} (Docker: --shm-size=2g or --ipc=host; "
        "Kubernetes: an emptyDir with medium: Memory)"
    )
    if not os.path.isdir(path):
        return Check(
            name="shared memory",
            status="warn",
            finding=f"{path} does not exist; vLLM's worker processes and UCX's posix "
            f"transport use it ({note})",
            fix=f"mount one: mount -t tmpfs -o size=2g tmpfs {path}",
        )
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    details = {"path": path, "free_bytes": free, "total_bytes": total}
    finding = f"{path}: {format_size(free)} free of {format_size(total)}; {note}"
    if not os.access(path, os.W_OK):
        return Check(
            name="shared memory",
            status="fail",
            finding=f"{path} is not writable by this user; " + note,
            fix=f"run: chmod 1777 {path}",
            details=details,
        )
    if free < SHM_FAIL_BYTES:
        return Check(
            name="shared memory",
            status="fail",
            finding=finding + f"; under {format_size(SHM_FAIL_BYTES)}, vLLM's workers fail",
            fix=mount_fix,
            details=details,
        )
    if free < SHM_WARN_BYTES:
        return Check(
            name="shared memory",
            status="warn",
            finding=finding + f"; under {format_size(SHM_WARN_BYTES)} is tight for vLLM",
            fix=mount_fix,
            details=details,
        )
    return Check(name="shared memory", status="ok", finding=finding, details=details)


# -- ports ---------------------------------------------------------------------------------------


def check_ports(config: Config, producers: list[str], timeout_s: float) -> list[Check]:
    out = [_check_bind("listen port", config.listen_host, config.listen_port, "listen_port")]
    if config.metrics_port is not None:
        out.append(_check_bind("metrics port", "0.0.0.0", config.metrics_port, "metrics_port"))
    out += [_check_reach(address, timeout_s) for address in producers]
    return out


def _check_bind(name: str, host: str, port: int, key: str) -> Check:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if port == 0:
        return Check(name=name, status="ok", finding=f"{key} 0: a free port on {host} is picked")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As libzmq binds: a port in TIME_WAIT is free, one that someone listens on is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
            sock.listen(1)
    except OSError as exc:
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


# -- keys ----------------------------------------------------------------------------------------


@contextmanager
def _key_warnings() -> Iterator[list[str]]:
    """Collect what keys.py warns about (group-readable secrets) while loading."""
    caught: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    logger = logging.getLogger("ecshare.control.keys")
    handler = _Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)


def check_keys(config: Config) -> list[Check]:
    """Load the configured keys the way a producer and a consumer would, with their messages."""
    if config.insecure:
        return [
            Check(
                name="keys",
                status="warn",
                finding="insecure=true: the control plane has no authentication or encryption",
                fix="only for loopback tests: generate keys (`ecshare keys generate`) and "
                "drop insecure",
            )
        ]
    out: list[Check] = []
    if config.server_secret_key_file:
        out.append(_load_keys("keys (producer)", lambda: _producer(config)))
    if config.client_secret_key_file or config.server_public_key_file or config.server_public_key:
        out.append(_load_keys("keys (consumer)", lambda: _consumer(config)))
    if not out:
        out.append(
            Check(
                name="keys",
                status="warn",
                finding="no CURVE keys configured, so neither a producer nor a consumer can start",
                fix="`ecshare keys generate DIR --name producer` (and --name consumer); then set "
                "server_secret_key_file + authorized_keys_file on producers, "
                "client_secret_key_file + server_public_key_file on consumers",
            )
        )
    return out


def _producer(config: Config) -> str:
    from ecshare.peer.node import producer_admins, producer_keys

    keys, authorized = producer_keys(config)
    admins = producer_admins(config, keys)
    return (
        f"server key {config.server_secret_key_file} readable and private; "
        f"{len(authorized)} authorized client key(s), {len(admins)} admin key(s)"
    )


def _consumer(config: Config) -> str:
    from ecshare.peer.node import consumer_keys

    consumer_keys(config)
    return f"client key {config.client_secret_key_file} readable and private; producer key loaded"


def _load_keys(name: str, load: Callable[[], str]) -> Check:
    with _key_warnings() as warnings:
        try:
            finding = load()
        except ControlConfigError as exc:
            text = str(exc)
            finding, _, fix = text.partition(" Fix it with: ")
            return Check(
                name=name,
                status="fail",
                finding=finding,
                fix=f"run: {fix}" if fix else _KEY_FIX,
            )
    if warnings:
        finding, _, fix = warnings[0].partition("; consider: ")
        return Check(name=name, status="warn", finding=finding, fix=f"run: {fix}" if fix else "")
    return Check(name=name, status="ok", finding=finding)
