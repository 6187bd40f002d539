"""Direct reads: where producers said entries lie, and the checks that decide
whether bytes read there are kept.

A producer tells the sessions that agreed (capability `read.direct`) where each
entry it commits lies (`p.Located`); `Locations` remembers it, per session, and a
fetch of such an entry READs it there at once, with no request and no grant.
Nothing holds the producer's blocks meanwhile, so the bytes are kept only if
they are shown to be the entry's:
- up to `DIGEST_MAX` bytes by their xxh3-64 against the digest told (whatever
  `checksum` says);
- larger ones by the entry's tag, a word the producer's store holds for the
  entry while its blocks are its own and never again once they are freed
  (`ecshare.store.entries`, "Tags"), read back after the bytes have landed
  (into this side's landing, `ecshare.peer.landing`, or straight from the
  producer's memory on one host, `ecshare.peer.peek`). A tag found there means
  the blocks had not been freed when it was read, so the bytes read before it
  were the entry's; this needs no pass over the bytes.
A location that does not fit its region, or that nothing could check, is
dropped and counted, as a bad grant would be. A mismatch (the entry was evicted
and its blocks reused) or a failed READ falls back to a granted read.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ecshare import protocol as p
from ecshare.peer.link import PeerLink, PeerLinkState
from ecshare.peer.locator import DIGEST_MAX
from ecshare.peer.transfer import DirectRead, Transfer
from ecshare.store import Store

# Entries producers said where they lie, remembered at most (the oldest go first).
LOCATIONS_REMEMBERED = 16384
# A lone entry over this size, from a producer whose tags are read from its memory
# (`PeerLink.peek`), is checked by its tag rather than its digest: from here up the
# tag costs less than a pass over the bytes.
PEEK_OVER_DIGEST = 256 << 10


@dataclass(frozen=True)
class Located:
    """Where a producer said an entry lies, on which session."""

    endpoint: str
    session_id: str
    where: p.Location


class Locations:
    """mm_hash -> where its producer said it lies. Network thread only (or a caller
    lending its thread under the consumer's network lock)."""

    def __init__(self, *, tags: bool, count: Callable[[str], None]) -> None:
        """`tags`: this side can read tags back (its store has a landing)."""
        self._tags = tags
        self._count = count
        self._located: collections.OrderedDict[str, Located] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._located)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._located

    def __len__(self) -> int:
        return len(self._located)

    def heard(self, link: PeerLink, msg: p.Located) -> None:
        """Remember where a producer says entries lie."""
        if (
            not link.direct
            or link.state is not PeerLinkState.READY
            or msg.session_id != link.session_id
        ):
            self._count("locations_off_session")
            return
        region_size = link.region_size
        for where in msg.entries:
            tag_ok = where.tag_offset % 8 == 0 and where.tag_offset + 8 <= region_size
            tag_checkable = where.tag and self._tags
            if (
                sum(e.length for e in where.extents) != where.nbytes
                or any(e.length <= 0 or e.offset + e.length > region_size for e in where.extents)
                or (where.tag and not tag_ok)
                or (not tag_checkable and where.checksum is None)  # nothing to check it by
            ):
                self._count("bad_locations")
                continue
            self._located[where.mm_hash] = Located(link.endpoint, link.session_id, where)
            self._located.move_to_end(where.mm_hash)
            self._count("locations_heard")
        while len(self._located) > LOCATIONS_REMEMBERED:
            self._located.popitem(last=False)

    def where(self, t: Transfer, link: PeerLink) -> p.Location | None:
        """Where `t`'s entry lies at its current peer, if that peer said so on this
        session and no direct read of it was tried there yet."""
        if t.direct_tried or not link.direct:
            return None
        located = self._located.get(t.mm_hash)
        if (
            located is None
            or located.endpoint != link.endpoint
            or located.session_id != link.session_id
        ):
            return None
        if t.max_nbytes and located.where.nbytes > t.max_nbytes:
            return None  # the producer's TOO_LARGE says so, with its detail
        return located.where

    def readable(
        self, queued: Iterable[Transfer], links: dict[str, PeerLink], copies_only: bool
    ) -> bool:
        """One of `queued` can be read directly; `copies_only`: from a producer whose
        READs end inside the call."""
        for t in queued:
            link = links.get(t.peer or "")
            if (
                link is not None
                and (link.copies_in_call or not copies_only)
                and self.where(t, link) is not None
            ):
                return True
        return False

    def read_of(self, where: p.Location, link: PeerLink, *, by_tag: bool) -> DirectRead:
        """How a direct read of `where` is checked: by tag where the batch is too large
        for digests (`by_tag`), where there is no digest, or where the tag is read from
        the producer's memory and the entry is over `PEEK_OVER_DIGEST`; else by digest."""
        if (
            where.tag
            and self._tags
            and (
                by_tag
                or where.checksum is None
                or (link.peek is not None and where.nbytes > PEEK_OVER_DIGEST)
            )
        ):
            return DirectRead(tag=where.tag, tag_offset=where.tag_offset)
        return DirectRead()

    def forget(self, t: Transfer) -> None:
        """A direct read of `t` ended without usable bytes: forget where its entry was
        said to lie, unless a newer word came meanwhile."""
        located = self._located.get(t.mm_hash)
        if (
            located is not None
            and [(e.offset, e.length) for e in located.where.extents] == t.remote_extents
        ):
            del self._located[t.mm_hash]


def by_tag(batch: Iterable[p.Location]) -> bool:
    """A batch of direct reads too large to check by digests is checked by tags."""
    return sum(where.nbytes for where in batch) > DIGEST_MAX


def intact(store: Store, t: Transfer, landed: int) -> bool:
    """The bytes of a direct read are the entry's: its tag was still in place after
    them (`landed`: the word its tag READ brought back), or they have its digest."""
    direct = t.direct
    assert t.dest is not None and direct is not None
    if direct.tag:
        return landed == direct.tag
    return store.checksum(t.dest) == t.checksum


def peek_tags(
    link: PeerLink, batch: list[Transfer], count: Callable[[str], None]
) -> list[int] | None:
    """The tags of `batch` read straight from its producer's memory; None where they
    cannot be (and, where the read failed, never again on this session: the tags
    are READ over NIXL)."""
    if link.peek is None:
        return None
    words = link.peek.words([t.direct.tag_offset for t in batch if t.direct is not None])
    if words is None:
        link.drop_peek()  # the producer's memory is out of reach from here
        count("tag_peeks_failed")
        return None
    return words
