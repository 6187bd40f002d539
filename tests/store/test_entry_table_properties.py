"""Properties of the entry table: blocks, states, pins, leases and LRU eviction."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ecshare.store import (
    Entry,
    EntryExists,
    EntryMeta,
    EntryState,
    EntryTooLarge,
    IllegalTransition,
    InvalidMeta,
    NotFound,
    NotReady,
    PinConflict,
    StoreFull,
)
from ecshare.store.entries import EntryTable

BLOCK = 4096
HASHES = [f"h{i}" for i in range(5)]
OWNERS = ["o0", "o1", "o2"]
GRANTS = ["g0", "g1", "g2"]
LEASES = st.sampled_from([0.5, 1.0, 3.0, 10.0])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def blocks_of(entry: Entry) -> set[int]:
    return {b for r in entry.runs for b in range(r.start, r.end)}


class EntryTableMachine(RuleBasedStateMachine):
    """Drives the table at random and checks each step against a small model of the pins."""

    table: EntryTable
    clock: FakeClock

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Entry] = []  # every entry ever allocated
        self.pins: dict[tuple[str, str], tuple[Entry, float]] = {}  # model: key -> entry, expiry
        self.released: list[tuple[str, str]] = []  # pin releases, in order

    @initialize(
        capacity=st.integers(2, 24),
        sizes=st.lists(st.integers(1, 4 * BLOCK), max_size=len(HASHES)),
    )
    def setup(self, capacity: int, sizes: list[int]) -> None:
        self.clock = FakeClock()
        self.table = EntryTable(capacity, BLOCK, clock=self.clock)
        # Start with some READY entries: random rule choice alone seldom builds
        # a table full enough for pins and evictions to meet.
        for mm_hash, nbytes in zip(HASHES, sizes, strict=False):
            if -(-nbytes // BLOCK) <= self.table.stats().free_blocks:
                self.entries.append(self.table.allocate(mm_hash, nbytes))
                self.table.commit(mm_hash)

    # -- helpers -------------------------------------------------------------

    def live(self) -> list[Entry]:
        return [e for e in self.entries if e.state is not EntryState.FREED]

    def protected(self) -> list[Entry]:
        # ALLOCATED, QUARANTINED, EVICTING or pinned: never evicted.
        return [e for e in self.live() if e.state is not EntryState.READY or e.pins]

    def evictable(self) -> list[Entry]:
        return [e for e in self.live() if e.state is EntryState.READY and not e.pins]

    def pick_hash(self, data: st.DataObject, *, ready: bool = False) -> str:
        """Mostly a hash the table holds (READY if asked), sometimes any (for the error paths)."""
        wanted = (EntryState.READY,) if ready else (EntryState.READY, EntryState.ALLOCATED)
        held = sorted({e.mm_hash for e in self.live() if e.state in wanted})
        choices = st.sampled_from(HASHES)
        if held:
            choices = st.one_of(st.sampled_from(held), st.sampled_from(held), choices)
        return data.draw(choices, label="mm_hash")

    def pick_pin(self, data: st.DataObject) -> tuple[str, str]:
        """Mostly a pin the model holds, sometimes any (owner, grant)."""
        choices = st.tuples(st.sampled_from(OWNERS), st.sampled_from(GRANTS))
        if self.pins:
            choices = st.one_of(st.sampled_from(sorted(self.pins)), choices)
        return data.draw(choices, label="pin")

    def drop_expired_from_model(self, key: tuple[str, str]) -> None:
        entry_exp = self.pins.get(key)
        if entry_exp is not None and entry_exp[1] <= self.clock.now:
            del self.pins[key]  # the table releases it as dead when it sees it

    # -- rules ---------------------------------------------------------------

    @rule(
        mm_hash=st.sampled_from(HASHES),
        nbytes=st.integers(1, 8 * BLOCK),
        commit=st.booleans(),
    )
    def allocate(self, mm_hash: str, nbytes: int, commit: bool) -> None:
        need = -(-nbytes // BLOCK)
        protected = self.protected()
        evictable = sorted(self.evictable(), key=lambda e: e.last_used)
        free = self.table.stats().free_blocks
        exists = self.table.get(mm_hash) is not None
        if need > self.table.capacity_blocks:
            with pytest.raises(ValueError):
                self.table.allocate(mm_hash, nbytes)
            return
        if exists:
            with pytest.raises(EntryExists):
                self.table.allocate(mm_hash, nbytes)
            return
        if free + sum(e.nblocks for e in evictable) < need:
            with pytest.raises(StoreFull):
                self.table.allocate(mm_hash, nbytes)
            assert all(e.state is EntryState.READY for e in evictable)  # nothing evicted in vain
            return
        # Allocation succeeds whenever enough blocks are free or evictable.
        entry = self.table.allocate(mm_hash, nbytes)
        assert entry.state is EntryState.ALLOCATED and entry.nblocks == need
        self.entries.append(entry)
        assert all(e.state is not EntryState.FREED for e in protected), "evicted a protected entry"
        victims = [e for e in evictable if e.state is EntryState.FREED]
        survivors = [e for e in evictable if e.state is not EntryState.FREED]
        if victims and survivors:
            assert max(v.last_used for v in victims) <= min(s.last_used for s in survivors)
        if commit:  # most entries get written at once, so that there is something to pin
            self.table.commit(mm_hash)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        mm_hash = self.pick_hash(data)
        entry = self.table.get(mm_hash)
        if entry is None:
            with pytest.raises(NotFound):
                self.table.commit(mm_hash)
        elif entry.state is EntryState.READY:
            with pytest.raises(IllegalTransition):
                self.table.commit(mm_hash)
        else:
            assert self.table.commit(mm_hash) is entry
            assert entry.state is EntryState.READY

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        mm_hash = self.pick_hash(data)
        entry = self.table.get(mm_hash)
        if entry is None:
            with pytest.raises(NotFound):
                self.table.abort(mm_hash)
        elif entry.state is EntryState.READY:
            with pytest.raises(IllegalTransition):
                self.table.abort(mm_hash)
        else:
            self.table.abort(mm_hash)
            assert entry.state is EntryState.FREED

    @rule(data=st.data())
    def quarantine(self, data: st.DataObject) -> None:
        mm_hash = self.pick_hash(data)
        entry = self.table.get(mm_hash)
        if entry is None or entry.state is not EntryState.ALLOCATED:
            return  # the other paths are abort's, with the same guards
        blocks = blocks_of(entry)
        self.table.quarantine(mm_hash, expect=entry)
        assert entry.state is EntryState.QUARANTINED
        assert self.table.get(mm_hash) is None  # fetchable again, into other blocks
        assert self.table.stats().quarantined_blocks >= len(blocks)

    @rule(nbytes=st.integers(1, 8 * BLOCK))
    def reserve(self, nbytes: int) -> None:
        need = -(-nbytes // BLOCK)
        protected = self.protected()
        room = self.table.stats().free_blocks + sum(e.nblocks for e in self.evictable())
        if need > self.table.capacity_blocks:
            with pytest.raises(EntryTooLarge):
                self.table.reserve(nbytes)
            return
        if room < need:
            with pytest.raises(StoreFull):
                self.table.reserve(nbytes)
            return
        entry = self.table.reserve(nbytes)
        assert entry.state is EntryState.ALLOCATED and entry.mm_hash == ""
        assert self.table.get("") is None  # no key: never found, never a hit
        self.entries.append(entry)
        assert all(e.state is not EntryState.FREED for e in protected), "evicted a protected entry"

    @rule(
        data=st.data(),
        mm_hash=st.sampled_from(HASHES),
        nbytes=st.integers(0, 8 * BLOCK + 1),
        end=st.sampled_from(["adopt", "adopt", "abort", "quarantine"]),
    )
    def end_reservation(self, data: st.DataObject, mm_hash: str, nbytes: int, end: str) -> None:
        held = [e for e in self.live() if e.state is EntryState.ALLOCATED and not e.mm_hash]
        if not held:
            return
        entry = data.draw(st.sampled_from(held), label="reservation")
        if end == "abort":
            self.table.abort("", expect=entry)
            assert entry.state is EntryState.FREED
            return
        if end == "quarantine":
            self.table.quarantine("", expect=entry)
            assert entry.state is EntryState.QUARANTINED
            return
        meta = EntryMeta("uint8", (nbytes,))
        exists = self.table.get(mm_hash) is not None
        if not 0 < nbytes <= entry.nbytes:
            with pytest.raises(InvalidMeta):
                self.table.adopt(entry, mm_hash, nbytes, meta)
        elif exists:
            with pytest.raises(EntryExists):
                self.table.adopt(entry, mm_hash, nbytes, meta)
        else:
            assert self.table.adopt(entry, mm_hash, nbytes, meta) is entry
            assert entry.state is EntryState.READY and self.table.get(mm_hash) is entry
            assert entry.nblocks == -(-nbytes // BLOCK) and entry.nbytes == nbytes
            return
        assert entry.state is EntryState.FREED  # bad input: the blocks go back, no entry
        with pytest.raises(NotFound):  # and it is no reservation any more
            self.table.adopt(entry, mm_hash, 1, EntryMeta("uint8", (1,)))

    @rule(data=st.data())
    def end_quarantine(self, data: st.DataObject) -> None:
        held = [e for e in self.live() if e.state is EntryState.QUARANTINED]
        if not held:
            return
        entry = data.draw(st.sampled_from(held), label="quarantined")
        self.table.release_quarantined(entry)
        assert entry.state is EntryState.FREED
        with pytest.raises(IllegalTransition):
            self.table.release_quarantined(entry)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        mm_hash = self.pick_hash(data)
        entry = self.table.get(mm_hash)
        if entry is None:
            assert self.table.remove(mm_hash) is False
        elif entry.state is EntryState.ALLOCATED:
            with pytest.raises(NotReady):
                self.table.remove(mm_hash)
        else:
            pinned = entry.pins > 0
            assert self.table.remove(mm_hash) is True
            assert entry.state is (EntryState.EVICTING if pinned else EntryState.FREED)
            assert self.table.get(mm_hash) is None

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        mm_hash = self.pick_hash(data)
        entry = self.table.get(mm_hash)
        ready = entry is not None and entry.state is EntryState.READY
        assert self.table.touch(mm_hash) is ready

    @rule(data=st.data(), lease=LEASES)
    def pin(self, data: st.DataObject, lease: float) -> None:
        mm_hash = self.pick_hash(data, ready=True)
        key = owner, grant = self.pick_pin(data)
        self.drop_expired_from_model(key)
        held = self.pins.get(key)
        if held is not None:
            entry = held[0]
            pins_before, total_before = entry.pins, self.table.stats().pins
            if entry.mm_hash != mm_hash:
                with pytest.raises(PinConflict):
                    self.table.pin(mm_hash, owner, grant, lease)
                return
            # The duplicate renews the one pin; it never pins twice.
            pin = self.table.pin(mm_hash, owner, grant, lease)
            assert pin.expires_at == self.clock.now + lease
            assert entry.pins == pins_before and self.table.stats().pins == total_before
            self.pins[key] = (entry, pin.expires_at)
            return
        entry = self.table.get(mm_hash)
        if entry is None:
            with pytest.raises(NotFound):
                self.table.pin(mm_hash, owner, grant, lease)
        elif entry.state is not EntryState.READY:
            with pytest.raises(NotReady):
                self.table.pin(mm_hash, owner, grant, lease)
        else:
            # Expired pins the table has not reaped yet are already gone from the model.
            before = sum(1 for e, _ in self.pins.values() if e is entry)
            pin = self.table.pin(mm_hash, owner, grant, lease)
            assert entry.pins == before + 1
            self.pins[key] = (entry, pin.expires_at)

    @rule(data=st.data(), lease=LEASES)
    def renew(self, data: st.DataObject, lease: float) -> None:
        key = owner, grant = self.pick_pin(data)
        self.drop_expired_from_model(key)
        renewed = self.table.renew(owner, grant, lease)
        assert renewed is (key in self.pins)
        if renewed:
            self.pins[key] = (self.pins[key][0], self.clock.now + lease)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = owner, grant = self.pick_pin(data)
        expected = key in self.pins  # expired but not yet reaped still counts, once
        assert self.table.unpin(owner, grant) is expected
        if expected:
            self.pins.pop(key)
            self.released.append(key)

    @rule(owner=st.sampled_from(OWNERS))
    def unpin_owner(self, owner: str) -> None:
        keys = [k for k in self.pins if k[0] == owner]
        assert self.table.unpin_owner(owner) == len(keys)
        for key in keys:
            del self.pins[key]

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5, 7.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def reap(self) -> None:
        expired = {k for k, (_, exp) in self.pins.items() if exp <= self.clock.now}
        reaped = self.table.reap_expired()
        # Each expired lease frees its pin exactly once: no repeats, none missed.
        assert len(reaped) == len(set(reaped))
        assert set(reaped) == expired
        for key in reaped:
            del self.pins[key]
        assert self.table.reap_expired() == []

    @precondition(lambda self: self.entries)
    @rule(nbytes=st.integers(1, 8 * BLOCK))
    def evict_bytes(self, nbytes: int) -> None:
        protected = self.protected()
        self.table.evict_bytes(nbytes)
        assert all(e.state is not EntryState.FREED for e in protected)

    # -- invariants ----------------------------------------------------------

    @invariant()
    def block_never_in_two_entries(self) -> None:
        seen: set[int] = set()
        for entry in self.live():
            blocks = blocks_of(entry)
            assert not blocks & seen, f"{entry.mm_hash} shares blocks"
            seen |= blocks
        stats = self.table.stats()
        assert stats.used_blocks == len(seen)
        assert stats.free_blocks + stats.used_blocks == stats.total_blocks
        self.table.check_invariants()

    @invariant()
    def pins_match_the_model(self) -> None:
        stats = self.table.stats()
        assert stats.pins == len(self.pins)
        for entry in self.entries:
            held = sum(1 for e, _ in self.pins.values() if e is entry)
            assert entry.pins == held, f"{entry.mm_hash}: {entry.pins} pins, model {held}"
        assert self.table.next_expiry() == min((x for _, x in self.pins.values()), default=None)

    @invariant()
    def only_unpinned_entries_are_freed(self) -> None:
        for entry in self.entries:
            if entry.state is EntryState.FREED:
                assert entry.pins == 0
            if entry.state is EntryState.EVICTING:
                assert entry.pins > 0


def test_random_operations_keep_every_table_promise() -> None:
    run_state_machine_as_test(
        EntryTableMachine,
        settings=settings(max_examples=150, stateful_step_count=60, deadline=None),
    )


# -- one promise per test --------------------------------------------------------


def make_table(capacity: int = 16) -> tuple[EntryTable, FakeClock]:
    clock = FakeClock()
    return EntryTable(capacity, BLOCK, clock=clock), clock


def put(table: EntryTable, mm_hash: str, nblocks: int) -> Entry:
    table.allocate(mm_hash, nblocks * BLOCK)
    return table.commit(mm_hash)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4 * BLOCK), min_size=1, max_size=30),
    drops=st.lists(st.integers(0, 29), max_size=20),
)
def test_block_never_in_two_entries(sizes: list[int], drops: list[int]) -> None:
    table, _ = make_table(24)
    live: dict[str, Entry] = {}
    for i, nbytes in enumerate(sizes):
        if i in drops and f"e{i - 1}" in live:
            table.remove(f"e{i - 1}")
        table.allocate(f"e{i}", nbytes)
        live[f"e{i}"] = table.commit(f"e{i}")
    holders = [e for e in live.values() if e.state is not EntryState.FREED]
    for a, b in itertools.combinations(holders, 2):
        assert not blocks_of(a) & blocks_of(b)
    table.check_invariants()


def test_pinned_or_allocated_entry_never_evicted() -> None:
    table, _ = make_table(4)
    pinned = put(table, "pinned", 1)
    table.pin("pinned", "reader", "g", 10.0)
    writing = table.allocate("writing", BLOCK)
    old = put(table, "old", 1)
    put(table, "new", 1)
    table.touch("new")
    table.allocate("big", BLOCK)  # evicts only "old", the one unpinned READY LRU entry
    assert old.state is EntryState.FREED
    assert pinned.state is EntryState.READY and writing.state is EntryState.ALLOCATED
    with pytest.raises(StoreFull, match="need 2 blocks"):
        table.allocate("more", 2 * BLOCK)
    assert table.get("new") is not None  # a failing allocation evicts nothing
    assert table.evict_bytes(100 * BLOCK) == BLOCK  # only "new" is evictable
    assert pinned.state is EntryState.READY and writing.state is EntryState.ALLOCATED


def test_duplicate_pin_never_pins_twice() -> None:
    table, clock = make_table()
    entry = put(table, "a", 2)
    first = table.pin("a", "consumer", "grant-1", 5.0)
    clock.now += 1.0
    again = table.pin("a", "consumer", "grant-1", 5.0)
    assert entry.pins == 1 and table.stats().pins == 1
    assert again.expires_at == first.expires_at + 1.0  # the duplicate only renewed it
    put(table, "b", 1)
    with pytest.raises(PinConflict):  # one grant id cannot pin two entries
        table.pin("b", "consumer", "grant-1", 5.0)
    assert table.unpin("consumer", "grant-1") is True
    assert table.unpin("consumer", "grant-1") is False
    assert entry.pins == 0


def test_expired_lease_frees_its_pin_exactly_once() -> None:
    table, clock = make_table()
    entry = put(table, "a", 1)
    table.pin("a", "c", "g1", 2.0)
    table.pin("a", "c", "g2", 4.0)
    assert table.next_expiry() == clock.now + 2.0
    assert table.reap_expired() == []
    clock.now += 2.0
    assert table.renew("c", "g1", 10.0) is False  # too late: expired is expired
    assert table.reap_expired() == []  # ... and renew already released it, once
    assert table.unpin("c", "g1") is False
    assert entry.pins == 1
    clock.now += 2.0
    assert table.reap_expired() == [("c", "g2")]
    assert table.reap_expired() == []
    assert entry.pins == 0 and table.stats().reaped_pins == 2
    assert table.next_expiry() is None


def test_unpin_owner_releases_everything_a_dead_consumer_held() -> None:
    table, _ = make_table()
    a, b = put(table, "a", 1), put(table, "b", 1)
    for grant in ("g1", "g2"):
        table.pin("a", "dead", grant, 10.0)
    table.pin("b", "dead", "g3", 10.0)
    table.pin("b", "alive", "g1", 10.0)
    assert table.unpin_owner("dead") == 3
    assert table.unpin_owner("dead") == 0
    assert (a.pins, b.pins) == (0, 1)


def test_evicting_entry_freed_when_last_pin_released() -> None:
    table, _ = make_table(2)
    entry = put(table, "a", 2)
    table.pin("a", "c", "g1", 10.0)
    table.pin("a", "c", "g2", 10.0)
    assert table.remove("a") is True
    assert entry.state is EntryState.EVICTING
    with pytest.raises(NotFound):  # doomed entries take no new pins
        table.pin("a", "c", "g3", 10.0)
    with pytest.raises(StoreFull):  # its blocks are still held for the readers
        table.allocate("a", BLOCK)
    table.unpin("c", "g1")
    assert entry.state is EntryState.EVICTING
    table.unpin("c", "g2")
    assert entry.state is EntryState.FREED
    assert table.stats().free_blocks == 2
    table.check_invariants()


def test_state_errors_are_distinct_and_transitions_checked() -> None:
    table, _ = make_table()
    with pytest.raises(NotFound):
        table.pin("missing", "c", "g", 1.0)
    table.allocate("w", 10)
    with pytest.raises(NotReady):
        table.pin("w", "c", "g", 1.0)
    with pytest.raises(EntryExists):
        table.allocate("w", 10)
    table.commit("w")
    with pytest.raises(IllegalTransition):
        table.commit("w")
    with pytest.raises(IllegalTransition):
        table.abort("w")


def test_empty_and_oversized_entries_are_rejected() -> None:
    table, _ = make_table(4)
    with pytest.raises(InvalidMeta, match="at least one byte"):
        table.allocate("empty", 0)
    with pytest.raises(EntryTooLarge, match="capacity"):
        table.allocate("huge", 4 * BLOCK + 1)
    with pytest.raises(ValueError, match="power of two"):
        EntryTable(4, 3000)


def test_byte_extents_sum_to_nbytes() -> None:
    table, _ = make_table(8)
    for name in ("a", "b", "c", "d"):
        put(table, name, 2)
    table.remove("a")
    table.remove("c")
    entry = table.allocate("frag", 3 * BLOCK + 5, EntryMeta(dtype="uint8", shape=(3 * BLOCK + 5,)))
    assert len(entry.runs) == 2
    extents = entry.byte_extents(BLOCK)
    assert [off for off, _ in extents] == [r.start * BLOCK for r in entry.runs]
    assert sum(n for _, n in extents) == entry.nbytes
    assert list(entry.extents) == extents


def test_reaping_by_owner_prefix_leaves_other_owners_pins() -> None:
    table, clock = make_table()
    put(table, "a", 1)
    put(table, "b", 1)
    table.pin("a", "session:s1", "g1", lease_s=1.0)
    table.pin("b", "engine", "g1", lease_s=1.0)
    clock.now += 1.0  # both leases run out exactly now
    assert table.reap_expired(owner_prefix="session:") == [("session:s1", "g1")]
    assert table.pinned_entry("engine", "g1") is not None
    assert table.reap_expired() == [("engine", "g1")]
    table.check_invariants()
