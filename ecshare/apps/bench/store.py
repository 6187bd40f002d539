"""``ecshare bench store``: region put/get against a plain memcpy, and the entry table's cost.

Each copy figure is set beside ``np.copyto`` of the same bytes. That is the
most a put or a get can reach, so the ratio is what the store's bookkeeping
costs. Each sample moves a batch of entries between distinct source and
destination buffers, 64 MiB in all, twice the last-level cache. That is the
regime the store lives in: a region is GiBs, and every put lands on blocks
no recent put touched. A cache-hot batch makes memcpy look faster by about
1.5x, and then the store's fixed cost (~7 µs a put) shows more for 1 MiB
entries. The put, memcpy and get of each sample run back to back, so that
background load hits all three alike. Figures are medians after a warm-up.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ecshare.apps.bench.progress import BenchProgress
from ecshare.apps.bench.schema import ReportHeader, load_average, machine_info, utc_now
from ecshare.apps.bench.synthetic import format_size
from ecshare.store import Region, Store

__all__ = ["measure_store", "print_table"]

KiB = 1 << 10
MiB = 1 << 20
SIZES = (64 * KiB, 1 * MiB, 4 * MiB, 64 * MiB)
BLOCK_SIZE = 64 * KiB
# Each sample moves this many bytes, in entries of one size (2x a 32 MiB LLC).
BATCH_BYTES = 64 * MiB
LIVE_ENTRIES = 100_000
TARGET_COPY_RATIO = 0.8  # for entries of at least 1 MiB
TARGET_ALLOC_FREE_US = 20.0


class CopyResult(msgspec.Struct, frozen=True):
    size_bytes: int
    put_gbps: float
    get_gbps: float
    memcpy_gbps: float
    put_ratio: float
    get_ratio: float


class TableResult(msgspec.Struct, frozen=True):
    live_entries: int
    alloc_commit_free_us: float
    pin_unpin_us: float


class StoreParameters(msgspec.Struct, frozen=True):
    sizes: list[int]
    samples: int
    table_samples: int
    batch_bytes: int
    live_entries: int
    quick: bool


class StoreBenchResult(ReportHeader, tag_field="bench", tag="store"):
    parameters: StoreParameters
    block_size: int
    samples: int
    copies: list[CopyResult]
    table: TableResult
    meets_targets: bool


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bench_copies(store: Store, size: int, samples: int, bar: BenchProgress) -> CopyResult:
    batch = max(1, BATCH_BYTES // size)
    # Every buffer is written before timing starts, so that no page faults are timed.
    src = np.random.default_rng(size).integers(0, 256, batch * size, dtype=np.uint8)
    dst = np.ones(batch * size, dtype=np.uint8)
    out = np.ones(batch * size, dtype=np.uint8)
    srcs = [src[i * size : (i + 1) * size] for i in range(batch)]
    dsts = [dst[i * size : (i + 1) * size] for i in range(batch)]
    outs = [out[i * size : (i + 1) * size] for i in range(batch)]
    hashes = [f"bench-{size}-{i}" for i in range(batch)]

    def put_batch() -> None:
        for h, s in zip(hashes, srcs, strict=True):
            store.put(h, s)

    def memcpy_batch() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            np.copyto(d, s)

    def get_batch() -> None:
        for h, o in zip(hashes, outs, strict=True):
            store.read_into(h, o)

    times: list[tuple[float, float, float]] = []
    for i in range(samples + 1):
        for h in hashes:
            store.remove(h)
        sample = (_timed(put_batch), _timed(memcpy_batch), _timed(get_batch))
        bar.advance()
        if i:  # the first round is the warm-up
            times.append(sample)
    if not np.array_equal(out, src):
        raise RuntimeError(f"store bench: {size}-byte entries did not round-trip")
    for h in hashes:
        store.remove(h)
    put_s, memcpy_s, get_s = (float(np.median(col)) for col in zip(*times, strict=True))
    moved = batch * size / 1e9
    put, get, memcpy = moved / put_s, moved / get_s, moved / memcpy_s
    return CopyResult(size, put, get, memcpy, put / memcpy, get / memcpy)


def _median_seconds(fn: Callable[[], None], samples: int, bar: BenchProgress) -> float:
    """Median wall time of ``fn`` over ``samples`` runs, after one warm-up run."""
    fn()
    bar.advance()
    times = []
    for _ in range(samples):
        times.append(_timed(fn))
        bar.advance()
    return float(np.median(times))


def _bench_table(live: int, samples: int, bar: BenchProgress) -> TableResult:
    """Entry lifetime cost (allocate + commit + remove) with ``live`` entries resident."""
    rng = random.Random(7)
    block = 4 * KiB
    # Only the entries' bookkeeping is timed: the region is never touched.
    region = Region.create(8 * live * block, name="ecshare-bench-table", prefault=False)
    try:
        return _churn_table(Store(region, block), live, samples, bar, rng)
    finally:
        region.close()


def _churn_table(
    store: Store, live: int, samples: int, bar: BenchProgress, rng: random.Random
) -> TableResult:
    block = store.block_size
    resident: list[str] = []
    for i in range(live):
        h = f"live-{i}"
        store.commit(store.allocate(h, rng.randint(1, 8) * block - 100))
        resident.append(h)
    # Drop a random fifth and refill. The free space then comes in many runs of
    # mixed sizes, as it does in a cache that has been running for a while.
    rng.shuffle(resident)
    for h in resident[: live // 5]:
        store.remove(h)
    del resident[: live // 5]
    for i in range(live // 5):
        h = f"refill-{i}"
        store.commit(store.allocate(h, rng.randint(1, 8) * block))
        resident.append(h)
    queue = deque(resident)
    bar.advance()

    ops = 2000
    # Names and sizes are made up front, so that only the table is timed.
    names = iter([f"churn-{i}" for i in range(ops * (samples + 1))])
    sizes = iter([rng.randint(1, 16) * block for _ in range(ops * (samples + 1))])

    def churn() -> None:
        # Each op stores one new entry and drops the oldest resident one.
        for _ in range(ops):
            h = next(names)
            store.commit(store.allocate(h, next(sizes)))
            queue.append(h)
            store.remove(queue.popleft())

    def pins() -> None:
        for i in range(ops):
            h = queue[-1 - i]
            store.pin(h, "bench", h, 30.0)
            store.unpin("bench", h)

    churn_s = _median_seconds(churn, samples, bar)
    pin_s = _median_seconds(pins, samples, bar)
    store.check_invariants()
    return TableResult(live, churn_s / ops * 1e6, pin_s / ops * 1e6)


def print_table(result: StoreBenchResult) -> None:
    print(
        f"ecshare store bench: block {result.block_size // KiB} KiB, {result.samples} samples, "
        f"{BATCH_BYTES // MiB} MiB of distinct buffers per sample"
    )
    heads = ("put GB/s", "get GB/s", "memcpy", "put/mcpy", "get/mcpy")
    print(f"{'entry':>8} " + " ".join(f"{h:>9}" for h in heads))
    for c in result.copies:
        size = format_size(c.size_bytes)
        print(
            f"{size:>8} {c.put_gbps:9.2f} {c.get_gbps:9.2f} {c.memcpy_gbps:9.2f} "
            f"{c.put_ratio:8.2f}x {c.get_ratio:8.2f}x"
        )
    t = result.table
    print(
        f"entry table, {t.live_entries} live entries: allocate+commit+free "
        f"{t.alloc_commit_free_us:.2f} us/entry (target <= {TARGET_ALLOC_FREE_US:.0f}), "
        f"pin+unpin {t.pin_unpin_us:.2f} us"
    )
    verdict = "met" if result.meets_targets else "MISSED"
    print(
        f"targets (put/get >= {TARGET_COPY_RATIO}x memcpy from 1 MiB, "
        f"alloc+free <= {TARGET_ALLOC_FREE_US:.0f} us): {verdict}"
    )


def measure_store(
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    quiet: bool = False,
    samples: int | None = None,
) -> StoreBenchResult:
    """Run the bench over `sizes` (default `SIZES`); the caller prints it and writes its
    files (`ecshare.apps.bench.report.emit`).

    `samples`, when given, is the number of timed samples of every figure instead of
    the default (15 per size and 7 of each table figure; with `quick` 5 and 3).
    """
    load_start = load_average()
    sizes = sorted(set(sizes or SIZES))
    table_samples = samples or (3 if quick else 7)
    samples = samples or (5 if quick else 15)
    # The largest entry must fit in a region sized for one batch, whatever its size.
    region_size = max(BATCH_BYTES, *(-(-s // BLOCK_SIZE) * BLOCK_SIZE for s in sizes))
    region_size += 16 * MiB
    # One step per copy sample, one for filling the table, one per table sample.
    steps = len(sizes) * (samples + 1) + 1 + 2 * (table_samples + 1)
    with BenchProgress(steps, "store", quiet=quiet) as bar:
        with Region.create(region_size, name="ecshare-bench") as region:
            store = Store(region, BLOCK_SIZE)
            copies = []
            for size in sizes:
                bar.advance(0, step=f"{format_size(size)} entries")
                copies.append(_bench_copies(store, size, samples, bar))
            del store
        bar.advance(0, step=f"entry table, {LIVE_ENTRIES} live entries")
        table = _bench_table(LIVE_ENTRIES, table_samples, bar)
    meets = table.alloc_commit_free_us <= TARGET_ALLOC_FREE_US and all(
        min(c.put_ratio, c.get_ratio) >= TARGET_COPY_RATIO for c in copies if c.size_bytes >= MiB
    )
    result = StoreBenchResult(
        created_at=utc_now(),
        machine=machine_info(load_start),
        parameters=StoreParameters(
            sizes=sizes,
            samples=samples,
            table_samples=table_samples,
            batch_bytes=BATCH_BYTES,
            live_entries=LIVE_ENTRIES,
            quick=quick,
        ),
        block_size=BLOCK_SIZE,
        samples=samples,
        copies=copies,
        table=table,
        meets_targets=meets,
    )
    return result
