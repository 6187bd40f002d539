"""Store: bytes in and out of the region, zero copy where possible, never from a reused block."""

from __future__ import annotations

import random
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash

from ecshare import ECShareError
from ecshare.errors import IllegalTransition
from ecshare.peer import transfer
from ecshare.store import (
    AllocatorError,
    Entry,
    EntryExists,
    EntryMeta,
    EntryState,
    InvalidMeta,
    NotFound,
    NotReady,
    Region,
    RegionError,
    Store,
    StoreError,
    StoreFull,
    entries,
)
from ecshare.transport import TransportError

BLOCK = 64 << 10


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def region() -> Iterator[Region]:
    with Region.create(64 * BLOCK, name="ecshare-test-store") as r:
        yield r


@pytest.fixture
def store(region: Region) -> Store:
    return Store(region, BLOCK, clock=FakeClock())


def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize(
    "nbytes", [1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 3, 40 * BLOCK]
)
def test_put_read_is_byte_exact(store: Store, nbytes: int) -> None:
    data = payload(nbytes, seed=nbytes)
    entry = store.put("item", data)
    assert entry.state is EntryState.READY and entry.nbytes == nbytes
    assert np.array_equal(store.read("item"), data)
    out = np.empty(nbytes, dtype=np.uint8)
    assert np.array_equal(store.read_into("item", out), data)
    assert b"".join(bytes(v) for v in store.views(entry)) == data.tobytes()


def fragment(store: Store) -> None:
    """Fill the store with 1-block entries and free every other one."""
    total = store.stats().total_blocks
    for i in range(total):
        store.put(f"filler-{i}", payload(BLOCK, seed=i))
    for i in range(0, total, 2):
        store.remove(f"filler-{i}")


def test_fragmented_entry_round_trips(store: Store) -> None:
    fragment(store)
    data = payload(7 * BLOCK + 11, seed=7)
    entry = store.put("fragmented", data, checksum=True)
    assert len(entry.runs) == 8  # no contiguous room: one run per free block
    assert sum(n for _, n in entry.byte_extents(BLOCK)) == data.nbytes
    got = store.read("fragmented")
    assert np.array_equal(got, data)
    assert not np.shares_memory(got, store.region.array)  # multi-run reads are copies
    assert store.checksum(entry) == xxhash.xxh3_64_intdigest(data.tobytes())
    assert entry.meta.checksum == store.checksum(entry)
    for i in range(1, store.stats().total_blocks, 2):  # the neighbours are untouched
        assert np.array_equal(store.read(f"filler-{i}"), payload(BLOCK, seed=i))


def test_read_is_zero_copy_when_contiguous(store: Store) -> None:
    data = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    store.put("contiguous", data)
    got = store.read("contiguous")
    assert np.shares_memory(got, store.region.array)
    assert got.dtype == np.float32 and got.shape == (3, 1000)
    assert np.array_equal(got, data)
    assert not got.flags.writeable  # committed entries are immutable


def test_write_then_commit(store: Store) -> None:
    data = payload(2 * BLOCK + 5)
    entry = store.allocate("staged", data.nbytes)
    with pytest.raises(NotReady):
        store.read("staged")
    store.write(entry, data[: data.nbytes])
    with pytest.raises(InvalidMeta):
        store.write(entry, data[:10])
    store.commit(entry)
    assert np.array_equal(store.read("staged"), data)
    with pytest.raises(StoreError):
        store.write(entry, data)  # READY entries are immutable


def test_failed_put_gives_blocks_back(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_copy(*_: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(store, "_copy_in", broken_copy)
    with pytest.raises(RuntimeError):
        store.put("broken", payload(3 * BLOCK))
    assert store.get("broken") is None and store.stats().used_blocks == 0
    monkeypatch.undo()
    with pytest.raises(InvalidMeta, match="meta"):
        store.put("bad", payload(100), EntryMeta(dtype="float32", shape=(100,)))
    with pytest.raises(InvalidMeta, match="meta"):
        store.allocate("bad", 100, EntryMeta(dtype="float32", shape=(100,)))
    assert store.stats().used_blocks == 0
    with pytest.raises(InvalidMeta, match="unknown dtype"):  # its size could not be checked
        store.allocate("bad", 100, EntryMeta(dtype="float3", shape=(25,)))
    # numpy's long double is 16 bytes here and 8 elsewhere: not in the one table.
    with pytest.raises(InvalidMeta, match="unknown dtype"):
        store.allocate("bad", 96, EntryMeta(dtype="float128", shape=(6,)))
    with pytest.raises(TypeError):
        store.put("objects", np.array([object()] * 4))
    with pytest.raises(InvalidMeta, match="at least one byte"):
        store.put("empty", b"")
    assert store.get("bad") is None and store.stats().entries == 0


def test_put_accepts_buffers_arrays_and_non_contiguous_views(store: Store) -> None:
    grid = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)
    cases: list[tuple[Any, bytes, str, tuple[int, ...]]] = [
        (b"hello bytes", b"hello bytes", "uint8", (11,)),
        (bytearray(b"\x00\x01" * 50), b"\x00\x01" * 50, "uint8", (100,)),
        (memoryview(grid)[::2], grid[::2].tobytes(), "int16", (32, 64)),
        (grid[:, ::3], np.ascontiguousarray(grid[:, ::3]).tobytes(), "int16", (64, 22)),
        (grid.T, np.ascontiguousarray(grid.T).tobytes(), "int16", (64, 64)),
        (grid.astype(">i2"), grid.tobytes(), "int16", (64, 64)),  # stored native-endian
    ]
    for i, (data, expected, dtype, shape) in enumerate(cases):
        entry = store.put(f"case-{i}", data)
        assert (entry.meta.dtype, entry.meta.shape) == (dtype, shape)
        assert store.read(f"case-{i}").tobytes() == expected


class FakeTensor:
    """The parts of torch.Tensor that Store uses, so that no test needs torch.

    For "bfloat16", ``array`` holds the raw bytes and ``shape`` the tensor's shape.
    """

    def __init__(self, array: np.ndarray, dtype: str = "", shape: tuple[int, ...] = ()) -> None:
        self._array = array
        self.dtype = f"torch.{dtype or array.dtype.name}"
        self.shape = shape or array.shape

    def detach(self) -> FakeTensor:
        return self

    def cpu(self) -> FakeTensor:
        return self

    def contiguous(self) -> FakeTensor:
        return FakeTensor(np.ascontiguousarray(self._array), self.dtype[6:], self.shape)

    def reshape(self, *shape: int) -> FakeTensor:
        assert shape == (-1,)
        return FakeTensor(self._array.reshape(-1), self.dtype[6:], (int(np.prod(self.shape)),))

    def view(self, dtype: object) -> FakeTensor:
        assert dtype == "fake_torch.uint8"
        return FakeTensor(self._array.view(np.uint8))

    def numpy(self) -> np.ndarray:
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self._array


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_torch")
    module.uint8 = "fake_torch.uint8"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_torch", module)
    monkeypatch.setattr(FakeTensor, "__module__", "fake_torch")


@pytest.mark.usefixtures("fake_torch")
def test_put_accepts_torch_like_tensors_including_bf16(store: Store) -> None:
    half = np.arange(40, dtype=np.float16).reshape(5, 8)
    store.put("fp16", FakeTensor(half.T))  # non-contiguous: made contiguous first
    got = store.read("fp16")
    assert got.dtype == np.float16 and np.array_equal(got, half.T)
    # bfloat16: numpy has no such dtype, so the bytes go in as uint8 and come
    # back as uint8, with the dtype and shape kept in meta.
    raw = payload(2 * 5 * 8).reshape(5, 16)  # 5 x 8 bf16 values
    entry = store.put("bf16", FakeTensor(raw, "bfloat16", (5, 8)))
    assert (entry.meta.dtype, entry.meta.shape) == ("bfloat16", (5, 8))
    got = store.read("bf16")
    assert got.dtype == np.uint8 and got.tobytes() == raw.tobytes()


def test_real_torch_tensors_if_installed(store: Store) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12 * 7, dtype=torch.bfloat16).reshape(12, 7).t()
    entry = store.put("torch-bf16", t)
    assert (entry.meta.dtype, entry.meta.shape) == ("bfloat16", (7, 12))
    expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert store.read("torch-bf16").tobytes() == expected
    f = torch.randn(3, 5, requires_grad=True)
    store.put("torch-f32", f)
    assert np.array_equal(store.read("torch-f32"), f.detach().numpy())


def test_eviction_picks_lru_unpinned_ready(region: Region) -> None:
    clock = FakeClock()
    store = Store(region, 16 * BLOCK, clock=clock)  # 4 blocks
    for name in ("a", "b", "c", "d"):
        clock.now += 1
        store.put(name, payload(16 * BLOCK))
    clock.now += 1
    store.read("a")  # a is now the most recently used
    store.pin("b", "reader", "g1", 30.0)  # b is pinned
    store.put("e", payload(16 * BLOCK))
    assert store.get("c") is None  # the least recently used unpinned READY entry
    assert all(store.get(n) is not None for n in ("a", "b", "d", "e"))
    assert store.stats().evictions == 1


def test_evicting_entry_freed_when_last_pin_released(store: Store) -> None:
    entry = store.put("a", payload(3 * BLOCK))
    store.pin("a", "consumer", "g1", 30.0)
    store.pin("a", "consumer", "g2", 30.0)
    assert store.remove("a")
    assert entry.state is EntryState.EVICTING and store.stats().evicting == 1
    with pytest.raises(NotFound):
        store.read("a")
    store.unpin("consumer", "g1")
    assert entry.state is EntryState.EVICTING
    store.unpin("consumer", "g2")
    assert entry.state is EntryState.FREED
    assert store.stats().used_blocks == 0


def test_block_not_reused_while_grant_readable(region: Region) -> None:
    store = Store(region, BLOCK, clock=FakeClock())
    total = store.stats().total_blocks
    data = payload(4 * BLOCK, seed=1)
    entry = store.put("granted", data)
    store.pin("granted", "peer", "grant-1", 30.0)
    held = {b for r in entry.runs for b in range(r.start, r.end)}
    store.remove("granted")  # doomed, but a grant on it may still be read
    # Churn through twice the region: LRU eviction recycles every other block.
    others = [store.put(f"other-{i}", payload(BLOCK, seed=100 + i)) for i in range(2 * total)]
    assert store.stats().evictions == total + 4
    for other in others:
        assert not held & {b for r in other.runs for b in range(r.start, r.end)}
    readable = b"".join(bytes(v) for v in store.views(entry))
    assert readable == data.tobytes()  # the grant still reads the right bytes
    store.unpin("peer", "grant-1")
    store.put("after", payload(4 * BLOCK))  # now the blocks can be reused


def test_concurrent_puts_reads_pins_and_removes_keep_invariants(store: Store) -> None:
    errors: list[BaseException] = []
    hashes = [f"h{i}" for i in range(12)]

    def stamped(mm_hash: str, version: int) -> np.ndarray:
        # Self-describing content: a torn or misplaced read cannot pass for whole.
        n = (1 + hashes.index(mm_hash) % 4) * BLOCK + version % 97
        data = np.full(n, version % 251, dtype=np.uint8)
        data[:8] = np.frombuffer(version.to_bytes(8, "little"), dtype=np.uint8)
        return data

    def check(got: np.ndarray) -> None:
        version = int.from_bytes(got[:8].tobytes(), "little")
        assert got.nbytes == (got.nbytes // BLOCK) * BLOCK + version % 97
        assert (got[8:] == version % 251).all()

    def pinned_read(seed: int, step: int, h: str) -> None:
        owner, grant = f"t{seed}", f"g{step}"
        store.pin(h, owner, grant, 5.0)
        try:
            entry = store.pinned_entry(owner, grant)
            assert entry is not None
            check(np.frombuffer(b"".join(bytes(v) for v in store.views(entry)), np.uint8))
        finally:
            assert store.unpin(owner, grant)

    def unpinned_read(h: str) -> None:
        entry = store.get(h)
        if entry is None:
            return
        out = np.empty(entry.nbytes, dtype=np.uint8)
        try:
            store.read_into(h, out)  # optimistic: raises NotFound if evicted mid-copy
        except ValueError:
            return  # replaced by an entry of another size since get()
        check(out)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(400):
                h = rng.choice(hashes)
                op = rng.random()
                try:
                    if op < 0.35:
                        store.put(h, stamped(h, seed * 100_000 + step))
                    elif op < 0.6:
                        unpinned_read(h)
                    elif op < 0.85:
                        pinned_read(seed, step, h)
                    else:
                        store.remove(h)
                except (NotFound, NotReady, StoreFull, EntryExists):
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    store.check_invariants()
    stats = store.stats()
    assert stats.pins == 0 and stats.free_blocks + stats.used_blocks == stats.total_blocks


def test_quarantined_blocks_are_never_reused_until_released(region: Region) -> None:
    store = Store(region, BLOCK, clock=FakeClock(), canary=True)
    entry = store.allocate("q", 10 * BLOCK)
    store.quarantine(entry)
    assert store.get("q") is None
    stats = store.stats()
    assert (stats.quarantined, stats.quarantined_blocks) == (1, 10)
    # Only the other 54 blocks are free or evictable: quarantined ones are neither.
    with pytest.raises(StoreFull):
        store.put("too-big", payload(55 * BLOCK))
    store.put("other", payload(54 * BLOCK))
    store.put("more", payload(1))  # evicts "other", never the quarantined blocks
    assert store.get("other") is None and entry.state is EntryState.QUARANTINED
    # The same item can be stored again elsewhere meanwhile.
    store.put("q", payload(BLOCK, seed=1))
    store.release_quarantined(entry)
    assert entry.state is EntryState.FREED
    assert store.stats().quarantined_blocks == 0
    store.check_invariants()


def test_canary_counts_a_write_into_freed_blocks(region: Region) -> None:
    store = Store(region, BLOCK, clock=FakeClock(), canary=True)
    entry = store.put("a", payload(3 * BLOCK))
    ((off, _n),) = entry.extents
    store.remove("a")  # blocks back, filled with the pattern
    region.array[off + 100 : off + 108] = 7  # a late write into freed memory
    store.put("b", payload(64 * BLOCK, seed=2))  # takes every block, "a"'s among them
    assert store.stats().canary_violations == 1
    # Blocks that were left alone pass, and the fresh region passes too.
    store.remove("b")
    store.put("c", payload(64 * BLOCK, seed=3))
    assert store.stats().canary_violations == 1


def test_canary_off_by_default_leaves_the_region_alone(region: Region) -> None:
    store = Store(region, BLOCK, clock=FakeClock())
    assert not store.canary
    assert not region.array.any()
    entry = store.put("a", payload(BLOCK))
    store.remove("a")
    ((off, n),) = entry.extents
    assert np.array_equal(region.array[off : off + n], payload(BLOCK))
    assert store.stats().canary_violations == 0


def test_every_store_error_is_an_ecshare_error_and_illegal_transition_is_one_class() -> None:
    for error in (StoreError, RegionError, AllocatorError, TransportError, transfer.FetchFailed):
        assert issubclass(error, ECShareError)
    assert entries.IllegalTransition is transfer.IllegalTransition is IllegalTransition
    assert issubclass(IllegalTransition, ECShareError)


def test_commit_watchers_see_each_entry_that_turns_ready_and_nothing_else(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[str, EntryState]] = []

    def broken(entry: Entry) -> None:
        raise RuntimeError("a watcher that fails")

    stop = store.watch_commits(lambda e: seen.append((e.mm_hash, e.state)))
    stop_broken = store.watch_commits(broken)
    store.put("put", payload(10))
    written = store.allocate("written", 5)
    store.write(written, payload(5))
    store.commit(written)
    store.abort(store.allocate("aborted", 5))  # never READY: not seen
    stop_broken()
    stop()
    store.put("after", payload(3))

    assert seen == [("put", EntryState.READY), ("written", EntryState.READY)]
    # A failing watcher is logged; the commit stands all the same.
    assert "commit watcher failed" in caplog.text
    written_now = store.get("written")
    assert written_now is not None and written_now.state is EntryState.READY


def test_removal_watchers_hear_each_ready_entry_leave_before_its_key_is_stored_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[str, str]] = []

    def broken(entry: Entry) -> None:
        raise RuntimeError("a watcher that fails")

    stop = store.watch_removals(lambda e: seen.append(("gone", e.mm_hash)))
    stop_broken = store.watch_removals(broken)
    store.watch_commits(lambda e: seen.append(("ready", e.mm_hash)))
    store.put("removed", payload(10))
    store.put("pinned", payload(10))
    store.pin("pinned", "reader", "g1", lease_s=60.0)
    assert store.remove("removed")
    assert store.remove("pinned")  # doomed while pinned: out of the index at once
    store.put("pinned", payload(10))  # the same key, a new entry
    store.abort(store.allocate("aborted", 5))  # never READY: never heard of
    # LRU eviction: filling the region evicts the oldest unpinned READY entry.
    store.put("big", payload((store.stats().total_blocks - 1) * BLOCK))
    stop_broken()
    stop()
    store.remove("big")

    assert seen == [
        ("ready", "removed"),
        ("ready", "pinned"),
        ("gone", "removed"),
        ("gone", "pinned"),
        ("ready", "pinned"),
        ("gone", "pinned"),
        ("ready", "big"),
    ]
    # A failing watcher is logged; the removal stands all the same.
    assert "removal watcher failed" in caplog.text


def test_tags_mark_an_entrys_blocks_while_they_are_its_own(region: Region) -> None:
    store = Store(region, BLOCK, tags=True)
    capacity = store.stats().total_blocks
    # The tags lie past the blocks, a word each, in the same region.
    assert capacity * BLOCK + 8 * capacity <= region.size
    first = store.put("first", payload(3 * BLOCK))
    offset = store.tag_offset(first)
    assert offset is not None and offset >= capacity * BLOCK
    assert first.tag and store.word(offset) == first.tag
    store.remove("first")
    assert store.word(offset) == 0  # freed: before the blocks can go to anyone else
    again = store.put("again", payload(3 * BLOCK))
    assert again.runs == first.runs  # the same blocks...
    assert store.word(offset) == again.tag != first.tag  # ...under a tag never seen before
    # A store without tags has none to tell.
    assert Store(region, BLOCK).tag_offset(again) is None


def test_verify_finds_bytes_changed_since_commit_and_drops_that_entry_only(store: Store) -> None:
    """The digest recorded at commit is held in the entry's meta, out of the region's
    reach: a change to the region's bytes (here written straight into its memory, as a
    peer's NIXL WRITE would) is found, counted, and the entry is never loaded again."""
    unchecked = store.put("plain", payload(3 * BLOCK, seed=1))
    checked = store.put("checked", payload(3 * BLOCK + 5, seed=2), checksum=True)
    assert store.verify(unchecked) and store.verify(checked)
    store.pin("checked", "engine", "g1", 30.0)
    for entry in (unchecked, checked):
        off, _ = entry.extents[0]
        store.region.array[off + 100] ^= 0xFF

    assert store.verify(unchecked)  # no digest recorded: nothing to find it by
    assert not store.verify(checked)
    assert store.stats().foreign_writes == 1
    assert store.get("checked") is None and checked.state is EntryState.EVICTING
    again = store.put("checked", payload(BLOCK, seed=3), checksum=True)
    assert not store.verify(checked)  # still changed, and not the entry under the name now
    assert store.get("checked") is again and store.verify(again)
    assert store.stats().foreign_writes == 2
    store.unpin("engine", "g1")
    assert checked.state is EntryState.FREED and not store.verify(checked)
    assert store.stats().foreign_writes == 2  # a freed entry's blocks are not its own
    store.check_invariants()
