"""Doctor checks of this machine's memory: room for the region, RLIMIT_MEMLOCK, /dev/shm,
and whether the region can have 2 MiB pages."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from ecshare.apps.bench.synthetic import format_size
from ecshare.apps.ops.check import Check
from ecshare.apps.ops.ucx import UcxProbe
from ecshare.config import Config

MiB = 1 << 20
GiB = 1 << 30
# /dev/shm below this breaks vLLM's worker processes (Docker's default is 64 MiB).
SHM_FAIL_BYTES = 64 * MiB
SHM_WARN_BYTES = 1 * GiB
# A region over this share of the memory the process can get leaves too little for the engine.
REGION_WARN_SHARE = 0.75
_CGROUP_UNLIMITED = 1 << 60
THP_SHMEM_PATH = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# shmem_enabled settings under which a mapping that asks (MADV_HUGEPAGE) gets 2 MiB pages.
_THP_GRANTED = frozenset({"always", "within_size", "advise", "force"})


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


def check_hugepages(config: Config, path: str = THP_SHMEM_PATH) -> Check:
    """Whether the host grants the region (a memfd: shared memory) the 2 MiB pages it asks
    for: with 4 KiB pages a cma copy into it pins every page, about twice the copy time."""
    if not config.region_hugepages:
        return Check(
            name="hugepages",
            status="ok",
            finding="region_hugepages is off: the region uses 4 KiB pages",
        )
    try:
        words = Path(path).read_text().split()
    except OSError:
        words = []
    chosen = next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), None)
    details = {"path": path, "setting": chosen}
    if chosen in _THP_GRANTED:
        return Check(
            name="hugepages",
            status="ok",
            finding=f"shared memory may have 2 MiB pages ({path}: {chosen}): the region gets them",
            details=details,
        )
    seen = f"{path}: {chosen}" if chosen else f"{path} unreadable (no transparent huge pages)"
    return Check(
        name="hugepages",
        status="warn",
        finding=f"the host gives shared memory no 2 MiB pages ({seen}): copies into the "
        "region pin it 4 KiB at a time, about twice the time of a large push or read over cma",
        fix=f"as root: echo advise > {THP_SHMEM_PATH} (only mappings that ask, such as the "
        "region, are affected; set it at every boot), or --no-region-hugepages to silence this",
        details=details,
    )
