"""The region is shared between real processes and leaves nothing behind when its owner dies."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import pytest

from ecshare.store import Region, RegionError, RegionHandle

REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO)}

ATTACH_CHILD = """
import sys, msgspec
from ecshare.store import Region, RegionHandle
handle = msgspec.json.decode(sys.argv[1], type=RegionHandle)
with Region.attach(handle) as region:
    assert region.size == handle.size and not region.is_owner
    print(bytes(region.view(4096, 16)).hex())
    region.array[8192 : 8192 + 16] = range(100, 116)
"""

OWNER_CHILD = """
import sys, time, msgspec
from ecshare.store import Region
region = Region.create(8 << 20, name=sys.argv[1])
region.array[:4] = [1, 2, 3, 4]
print(msgspec.json.encode(region.handle).decode(), flush=True)
time.sleep(120)
"""


def shm_entries() -> set[str]:
    # POSIX semaphores ("sem.*") that other test processes' multiprocessing
    # makes come and go here too. They are not shared-memory segments; nor are
    # torch's multiprocessing segments ("psm_*") of the vLLM instances that other
    # tests run meanwhile.
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith(("sem.", "psm_"))}


@contextmanager
def owner_process(name: str) -> Iterator[tuple[subprocess.Popen[str], RegionHandle]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER_CHILD, name],
        stdout=subprocess.PIPE,
        text=True,
        env=CHILD_ENV,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "owner process died before printing its handle"
        yield proc, msgspec.json.decode(line, type=RegionHandle)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_two_processes_see_the_same_bytes() -> None:
    with Region.create(1 << 20, name="ecshare-test") as region:
        region.array[4096 : 4096 + 16] = np.arange(16, dtype=np.uint8)
        child = subprocess.run(
            [sys.executable, "-c", ATTACH_CHILD, msgspec.json.encode(region.handle).decode()],
            capture_output=True,
            text=True,
            env=CHILD_ENV,
            timeout=60,
            check=False,
        )
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == bytes(range(16)).hex()
        assert bytes(region.view(8192, 16)) == bytes(range(100, 116))


def test_owner_sigkill_leaves_nothing_behind() -> None:
    name = f"ecshare-kill-{os.getpid()}"
    before = shm_entries()
    with owner_process(name) as (proc, handle):
        # While the owner lives, the region is anonymous memory, not a file.
        assert shm_entries() - before == set()
        link = os.readlink(f"/proc/{proc.pid}/fd/{handle.fd}")
        assert link == f"/memfd:{handle.name} (deleted)"
        assert handle.name.startswith(name)
        with Region.attach(handle) as seen:
            assert bytes(seen.view(0, 4)) == b"\x01\x02\x03\x04"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{proc.pid}")
    assert shm_entries() - before == set()
    with pytest.raises(RegionError, match="gone"):
        Region.attach(handle)


def test_attached_mapping_survives_owner_death() -> None:
    with owner_process(f"ecshare-survive-{os.getpid()}") as (proc, handle):
        region = Region.attach(handle)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    # Our mapping keeps the memory alive: still readable and writable, no SIGBUS.
    assert bytes(region.view(0, 4)) == b"\x01\x02\x03\x04"
    region.array[-1] = 9
    assert region.array[-1] == 9
    region.close()


def test_handle_travels_by_pickle_and_msgspec() -> None:
    with Region.create(4096) as region:
        handle = region.handle
        assert pickle.loads(pickle.dumps(handle)) == handle
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=RegionHandle) == handle
        assert (handle.pid, handle.size) == (os.getpid(), 4096)


def test_attach_rejects_bad_handles() -> None:
    with Region.create(64 << 10, name="ecshare-bad") as region:
        good = region.handle
        with pytest.raises(RegionError, match="size"):
            Region.attach(msgspec.structs.replace(good, size=128 << 10))
        with pytest.raises(RegionError, match="not this region"):
            Region.attach(msgspec.structs.replace(good, name="ecshare-other.0"))
        with pytest.raises(RegionError, match="bad size"):
            Region.attach(msgspec.structs.replace(good, size=1000))
        with pytest.raises(RegionError, match="gone"):
            Region.attach(msgspec.structs.replace(good, fd=good.fd + 1000))
        r, w = os.pipe()  # an fd that is open, but is not a region
        try:
            with pytest.raises(RegionError, match="not this region"):
                Region.attach(msgspec.structs.replace(good, fd=r))
        finally:
            os.close(r)
            os.close(w)


def test_close_is_idempotent_and_safe_with_views_outstanding() -> None:
    region = Region.create(1 << 20)
    handle = region.handle
    array = region.array
    view = region.view(0, 10)
    tail = array[-100:]
    array[:10] = 7
    region.close()
    region.close()
    assert region.closed
    # The views keep the mapping alive: still valid memory, no crash.
    assert bytes(view) == b"\x07" * 10
    tail[:] = 1
    assert int(tail.sum()) == 100
    with pytest.raises(RegionError, match="closed"):
        region.view(0, 1)
    with pytest.raises(RegionError, match="closed"):
        _ = region.array
    with pytest.raises(RegionError):  # the owner closed the memfd: no new attachments
        Region.attach(handle)


def test_region_geometry() -> None:
    with Region.create(10_000, prefault=False) as region:
        assert region.size == 12288  # whole pages
        assert region.is_owner
        assert region.address == region.array.ctypes.data
        assert region.array.dtype == np.uint8 and region.array.flags.writeable
        assert len(region.view(100, 200)) == 200
        with pytest.raises(ValueError):
            region.view(12000, 1000)
    with pytest.raises(ValueError):
        Region.create(0)
    with pytest.raises(ValueError):
        Region.create(4096, name="a/b")


def mapping_of(region: Region) -> dict[str, str]:
    """This process's /proc/self/smaps fields of the mapping that starts at the region."""
    start = f"{region.address:x}-"
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                inside = line.startswith(start)
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    assert fields, f"no mapping at {region.address:#x} in /proc/self/smaps"
    return fields


def resident_kib(region: Region) -> int:
    return int(mapping_of(region)["Rss"].split()[0])


def test_prefault_puts_every_page_in_memory_for_owner_and_attacher() -> None:
    size = 8 << 20
    with Region.create(size) as owner:
        assert resident_kib(owner) == size >> 10
        with Region.attach(owner.handle) as attached:
            assert resident_kib(attached) == size >> 10
            assert not attached.array.any()  # faulting in wrote nothing


def test_without_prefault_pages_come_in_as_touched() -> None:
    with Region.create(8 << 20, prefault=False) as region:
        assert resident_kib(region) == 0
        region.array[: 1 << 20] = 1
        assert resident_kib(region) >= 1 << 10


def test_hugepage_advice_is_on_the_mapping_only_when_asked() -> None:
    # The advice shows as VmFlags "hg" whatever the host's shmem_enabled; whether the
    # host then grants 2 MiB pages is its setting, which this test does not change.
    with Region.create(4 << 20) as advised, Region.create(4 << 20, hugepages=False) as plain:
        assert "hg" in mapping_of(advised)["VmFlags"].split()
        assert "hg" not in mapping_of(plain)["VmFlags"].split()
        with Region.attach(advised.handle) as attached:
            assert "hg" in mapping_of(attached)["VmFlags"].split()


def test_hugepage_bytes_reads_back_what_the_host_granted() -> None:
    # 2 MiB pages need the advice and a host whose shared memory may have them; this
    # test reads the host's setting and holds the region to it either way.
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        setting = f.read().split("[")[1].split("]")[0]
    size = 8 << 20
    with Region.create(size) as advised, Region.create(size, hugepages=False) as plain:
        assert plain.hugepage_bytes() == 0
        granted = advised.hugepage_bytes()
        if setting in ("never", "deny"):
            assert granted == 0
        else:  # advise, within_size, always, force: the whole aligned region
            assert granted == int(mapping_of(advised)["ShmemPmdMapped"].split()[0]) << 10
            assert granted >= size - (2 << 20)
    with pytest.raises(RegionError, match="closed"):
        advised.hugepage_bytes()
