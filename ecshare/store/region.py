"""The region: one instance's CPU shared memory, which dies with its owner.

Why memfd and not /dev/shm (``shm_open``): a memfd has no name in any file
system, so an owner killed with SIGKILL leaves nothing behind. The kernel gives
the memory back once the last fd and the last mapping are gone. Nobody has to
unlink anything, and no cleanup code has to run. A memfd is also not held to
the size of a container's /dev/shm mount, which is often only 64 MiB.

Other processes of the same instance (vLLM worker processes) attach through
``/proc/<owner_pid>/fd/<fd>``. The kernel lets the same user open that path for
as long as the owner process lives and keeps the fd open. That is exactly the
lifetime we want for new attachments. Mappings that already exist stay valid
after the owner dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import weakref
from types import TracebackType

import msgspec
import numpy as np
import numpy.typing as npt

from ecshare.errors import ECShareError

__all__ = ["Region", "RegionError", "RegionHandle"]

PAGE_SIZE = mmap.PAGESIZE
# The kernel allows memfd names up to 249 bytes. We add a random suffix, so we
# keep the caller's part short.
_MAX_NAME = 200


class RegionError(ECShareError):
    """The region cannot be created, attached or used (owner gone, bad handle, closed)."""


class RegionHandle(msgspec.Struct, frozen=True):
    """Everything another process of this instance needs to attach to a region.

    Only local worker processes receive it. It names a pid and an fd, so it is
    no use to anyone on another host. ``name`` is the full memfd name, the
    caller's name plus a random suffix. ``attach`` checks it, so that a stale
    handle can never map some other file after the pid has been reused.
    """

    pid: int
    fd: int
    size: int
    name: str


# Linux's madvise values (5.14+) that Python's mmap module does not name.
_MADV_POPULATE_WRITE = 23


def _map(fd: int, size: int, prefault: bool, hugepages: bool) -> mmap.mmap:
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        if hugepages:
            _advise_hugepages(mm)
        if prefault:
            _populate(mm)
    except BaseException:
        mm.close()
        raise
    return mm


def _advise_hugepages(mm: mmap.mmap) -> None:
    # 2 MiB pages where the host lets shared memory have them
    # (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise, within_size or
    # always): a cross-memory-attach copy then pins the other process's memory
    # 2 MiB at a time, not 4 KiB. Elsewhere the advice changes nothing, and a kernel without
    # transparent huge pages refuses it, which is not an error.
    with contextlib.suppress(OSError):
        mm.madvise(mmap.MADV_HUGEPAGE)


def _populate(mm: mmap.mmap) -> None:
    # Fault every page in now, after the huge-page advice (MAP_POPULATE would
    # fault them in 4 KiB pages before it). The first put into a fresh block,
    # and the first push WRITEd into it, then run at copy speed, without a page
    # fault every page. For the owner this also allocates the memory up front,
    # so a region too large for the machine fails here, not later with SIGBUS
    # in the middle of a copy. Write faults change no byte.
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14
            raise RegionError(f"cannot fault in the region's {len(mm)} bytes: {exc}") from exc
    else:
        return
    view = np.frombuffer(mm, dtype=np.uint8)
    # One read per page; a read fault gives a shared mapping its page, writable.
    int(view[::PAGE_SIZE].sum())
    del view


class Region:
    """A shared-memory mapping, either created by its owner or attached from a handle.

    Closing, and the rule about views: ``close()`` is idempotent and never makes
    memory you still hold invalid. ``array``, ``view()`` and anything sliced from
    them keep the mapping alive. If any of them still exist at ``close()``, the
    unmap is put off until the last one is dropped. Nothing crashes, but the
    memory is not given back until then. After ``close()`` the region gives
    out no new views. The owner's ``close()`` also closes the memfd, so no new
    process can attach. Processes already attached keep their mappings.
    """

    def __init__(self, mm: mmap.mmap, handle: RegionHandle, *, owner_fd: int | None) -> None:
        # Private: use Region.create() or Region.attach().
        self._mmap: mmap.mmap | None = mm
        self._mem: memoryview | None = memoryview(mm)
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(mm, dtype=np.uint8)
        self._address = int(self._array.ctypes.data)
        self._handle = handle
        self._is_owner = owner_fd is not None
        # If the owner never calls close(), the memfd is still closed when the
        # Region is garbage-collected.
        self._fd_closer = None if owner_fd is None else weakref.finalize(self, os.close, owner_fd)

    @classmethod
    def create(
        cls,
        size_bytes: int,
        *,
        name: str = "ecshare",
        prefault: bool = True,
        hugepages: bool = True,
    ) -> Region:
        """Create a region of at least ``size_bytes`` (rounded up to a whole page).

        ``prefault``: every page is in memory before this returns. ``hugepages``: the
        region asks for 2 MiB pages, which the host grants only where its shared
        memory may have them (`_advise_hugepages`)."""
        if size_bytes <= 0:
            raise ValueError(f"region size must be positive, got {size_bytes}")
        if not name or len(name) > _MAX_NAME or "/" in name or not name.isprintable():
            raise ValueError(f"region name must be 1..{_MAX_NAME} printable chars without '/'")
        size = -(-size_bytes // PAGE_SIZE) * PAGE_SIZE
        unique = f"{name}.{secrets.token_hex(6)}"
        fd = os.memfd_create(unique, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Seal the size. A process that truncated the memfd would make every
            # other mapping fault with SIGBUS on the pages past the new end.
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            mm = _map(fd, size, prefault, hugepages)
        except BaseException:
            os.close(fd)
            raise
        handle = RegionHandle(pid=os.getpid(), fd=fd, size=size, name=unique)
        return cls(mm, handle, owner_fd=fd)

    @classmethod
    def attach(
        cls, handle: RegionHandle, *, prefault: bool = True, hugepages: bool = True
    ) -> Region:
        """Map the region described by ``handle``, which another process created."""
        if handle.size <= 0 or handle.size % PAGE_SIZE:
            raise RegionError(f"region {handle.name!r}: bad size {handle.size}")
        path = f"/proc/{handle.pid}/fd/{handle.fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RegionError(
                f"region {handle.name!r}: owner process {handle.pid} is gone "
                f"or has closed the region ({path} does not exist)"
            ) from None
        except PermissionError as exc:
            raise RegionError(
                f"region {handle.name!r}: may not open {path} "
                "(owner runs as another user or is not dumpable)"
            ) from exc
        try:
            # We check the fd we actually opened, not the path. Between the
            # handle being sent and now, the owner may have died and its pid
            # been reused by a process that has some other file at that fd.
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target != f"/memfd:{handle.name} (deleted)":
                raise RegionError(
                    f"region {handle.name!r}: {path} is {target!r}, not this region "
                    f"(owner process {handle.pid} gone and its pid reused?)"
                )
            actual = os.fstat(fd).st_size
            if actual != handle.size:
                raise RegionError(
                    f"region {handle.name!r}: size is {actual} bytes, handle says {handle.size}"
                )
            mm = _map(fd, handle.size, prefault, hugepages)
        finally:
            # The mapping keeps the memory alive. Only the owner's fd has to stay
            # open, so that more processes can attach.
            os.close(fd)
        return cls(mm, handle, owner_fd=None)

    @property
    def handle(self) -> RegionHandle:
        return self._handle

    @property
    def size(self) -> int:
        return self._handle.size

    @property
    def address(self) -> int:
        """Base virtual address of the mapping in this process (for NIXL registration)."""
        return self._address

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole region as a writable uint8 array (zero copy)."""
        if self._array is None:
            raise RegionError(f"region {self._handle.name!r} is closed")
        return self._array

    def hugepage_bytes(self) -> int:
        """How much of this process's mapping of the region is on 2 MiB pages now
        (``ShmemPmdMapped`` in /proc/self/smaps); 0 where none, or smaps unreadable."""
        if self._mmap is None:
            raise RegionError(f"region {self._handle.name!r} is closed")
        start = f"{self._address:x}-"
        inside = False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    if line.startswith(start):
                        inside = True
                    elif inside and line.startswith("ShmemPmdMapped:"):
                        return int(line.split()[1]) * 1024
                    elif inside and not line.split(maxsplit=1)[0].endswith(":"):
                        break  # the next mapping's header: ours said nothing of it
        except OSError:
            pass
        return 0

    def view(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` as a writable memoryview (zero copy)."""
        if self._mem is None:
            raise RegionError(f"region {self._handle.name!r} is closed")
        if offset < 0 or length < 0 or offset + length > self._handle.size:
            raise ValueError(
                f"view [{offset}, {offset + length}) outside region of {self._handle.size} bytes"
            )
        return self._mem[offset : offset + length]

    def close(self) -> None:
        """Give up this process's use of the region. Idempotent. See the class doc for views."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        mem, self._mem = self._mem, None
        self._array = None
        if mem is not None:
            # If something was built on this memoryview, that thing holds the mapping.
            with contextlib.suppress(BufferError):
                mem.release()
        # If views are still out, mmap.close() refuses. Then dropping our
        # reference leaves the unmap to the mmap object's deallocation, after
        # the last view has gone.
        with contextlib.suppress(BufferError):
            mm.close()
        if self._fd_closer is not None:
            self._fd_closer()  # runs at most once, even with the GC finalizer

    def __enter__(self) -> Region:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._is_owner else "attached"
        state = "closed" if self.closed else f"at {self._address:#x}"
        return f"Region({self._handle.name!r}, {self.size} bytes, {role}, {state})"
