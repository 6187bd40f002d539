"""Reading a producer's tag words straight from its memory, where it runs on this host.

A direct read (a `p.Location` told unasked, no grant) keeps its bytes only if
the entry's tag is still in place after them: the word at `tag_offset` of the
producer's region holds the tag while the entry's blocks are its own and never
again once they were freed. Over NIXL that check is a second READ, of 8 bytes:
about 80 us after an idle gap on a 2-vCPU host, nearly all of it NIXL's and
UCX's work per transfer, and more than the digest of a MiB.

A producer on this host is read through its ``/proc/<pid>/mem`` instead: one
``pread`` (the kernel copies from the producer's pages, as UCX's cross-memory
attach does for the bytes), about 3 us warm and 30 us after an idle gap here,
against 80 to 120 us for a NIXL READ or a `process_vm_readv` made through
ctypes. The same order holds: the word is read after the bytes' READ has ended,
on the thread that saw it end. The descriptor is opened once per session and
names that process for as long as it is open, so a PID used again later is
never read.

Only where the producer's handshake says it shares this host's kernel and PID
namespace (`host_identity`, so that its PID names it here) and a first read of
its region succeeds (the permission cross-memory attach needs as well: same
user, or CAP_SYS_PTRACE, and Yama's ptrace scope). Anything else, or a read
that fails later (the producer gone), leaves the check to the NIXL READ.
The producer is as trusted as its data plane: UCX takes the PID it reads from
out of the same authenticated handshake.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence

from ecshare import protocol as p

__all__ = ["Peek", "host_identity"]

_WORD = 8
# Tags within this span of each other come back in one read.
_SPAN_MAX = 4096


@functools.cache
def host_identity() -> str:
    """This host's kernel (its boot ID) and this process's PID namespace; "" where
    either is unknown. Two processes with the same non-empty identity share memory
    by PID."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot and ns else ""


class Peek:
    """Reads 8-byte words of one producer's region from its memory; `close` when its
    session ends (a reader dropped unclosed closes when collected)."""

    __slots__ = ("__weakref__", "_base", "_close", "_fd", "_size")

    def __init__(self, fd: int, base: int, size: int) -> None:
        self._fd = fd
        self._base = base
        self._size = size
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, dp: p.DataPlaneInfo) -> Peek | None:
        """A reader of the region `dp` announced, if its producer runs on this host and
        its memory can be read from here; None otherwise."""
        if (
            dp.pid <= 0
            or not dp.host
            or dp.host != host_identity()
            or dp.region_address <= 0
            or dp.region_size < _WORD
        ):
            return None
        try:
            fd = os.open(f"/proc/{dp.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        peek = cls(fd, dp.region_address, dp.region_size)
        if peek.words([0]) is None:
            peek.close()
            return None
        return peek

    def close(self) -> None:
        """Idempotent."""
        self._close()

    def words(self, offsets: Sequence[int]) -> list[int] | None:
        """The 8-byte little-endian words at `offsets` of the region now, as the store
        writes tags (`Store.word`), in the order asked: one read per span of them
        within `_SPAN_MAX`. None if any cannot be read (an offset outside the region
        or unaligned, the producer gone, no permission, closed)."""
        if not offsets or not self._close.alive:
            return None
        for offset in offsets:
            if offset < 0 or offset % _WORD or offset + _WORD > self._size:
                return None
        if len(offsets) == 1:  # a lone fetch's: the least code, which runs cold
            try:
                raw = os.pread(self._fd, _WORD, self._base + offsets[0])
            except OSError:
                return None
            return [int.from_bytes(raw, "little")] if len(raw) == _WORD else None
        order = sorted(set(offsets))
        got: dict[int, int] = {}
        i = 0
        try:
            while i < len(order):
                start, j = order[i], i
                while j + 1 < len(order) and order[j + 1] + _WORD - start <= _SPAN_MAX:
                    j += 1
                span = order[j] + _WORD - start
                raw = os.pread(self._fd, span, self._base + start)
                if len(raw) != span:
                    return None
                for offset in order[i : j + 1]:
                    at = offset - start
                    got[offset] = int.from_bytes(raw[at : at + _WORD], "little")
                i = j + 1
        except OSError:
            return None
        return [got[offset] for offset in offsets]
