"""What every bench result file shares: the schema version, when and where it ran.

Each bench's result (`StoreBenchResult`, `FetchBenchResult`, `ProxyBenchResult`) is a
`msgspec.Struct` that extends `ReportHeader` and is tagged by its ``bench`` field, so one
strict decode (`ecshare.apps.bench.report.decode_report`) reads any result file and names what
is wrong with a bad one. `SCHEMA_VERSION` changes only when a field changes meaning or
goes away; new fields keep it, and readers ignore fields they do not know. A reader refuses
a file whose version is newer than its own.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec

__all__ = [
    "SCHEMA_VERSION",
    "Machine",
    "ReportHeader",
    "load_average",
    "machine_info",
    "utc_now",
]

SCHEMA_VERSION = 1


class Machine(msgspec.Struct, frozen=True, kw_only=True):
    """The host a bench ran on, so that two result files can be judged comparable."""

    hostname: str
    platform: str
    cpu_model: str
    cpus: int
    memory_bytes: int
    python: str
    numpy: str
    nixl: str
    ecshare: str
    git_commit: str  # of the ecshare checkout, "unknown" outside one
    ucx_tls: str
    ucx_net_devices: str
    load_average_1m: tuple[float, float]  # at the start and at the end of the run


class ReportHeader(msgspec.Struct, kw_only=True):
    """Fields every result file carries; each bench's result struct extends it."""

    schema_version: int = SCHEMA_VERSION
    created_at: str  # ISO 8601, UTC
    machine: Machine


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def machine_info(load_at_start: float) -> Machine:
    import numpy as np

    return Machine(
        hostname=socket.gethostname(),
        platform=platform.platform(),
        cpu_model=_cpu_model(),
        cpus=os.cpu_count() or 0,
        memory_bytes=_memory_bytes(),
        python=platform.python_version(),
        numpy=np.__version__,
        nixl=_version("nixl"),
        ecshare=_version("ecshare"),
        git_commit=_git_commit(),
        ucx_tls=os.environ.get("UCX_TLS", ""),
        ucx_net_devices=os.environ.get("UCX_NET_DEVICES", ""),
        load_average_1m=(load_at_start, load_average()),
    )


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _git_commit() -> str:
    checkout = Path(__file__).resolve().parents[3]
    if not (checkout / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
