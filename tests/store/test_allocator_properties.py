"""Properties of the block allocator, checked against a block-by-block model."""

from __future__ import annotations

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

from ecshare.store import AllocatorError, BlockAllocator, Run


def model_free_runs(owner: list[int | None]) -> list[Run]:
    """Maximal runs of free blocks: what a fully coalescing allocator must hold."""
    runs: list[Run] = []
    start = None
    for b, who in enumerate([*owner, -1]):
        if who is None and start is None:
            start = b
        elif who is not None and start is not None:
            runs.append(Run(start, b - start))
            start = None
    return runs


def fewest_runs(free: list[Run], n: int) -> int:
    got = 0
    for k, count in enumerate(sorted((r.count for r in free), reverse=True), start=1):
        got += count
        if got >= n:
            return k
    raise AssertionError("not enough free blocks")


class AllocatorMachine(RuleBasedStateMachine):
    alloc: BlockAllocator
    owner: list[int | None]

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[Run]] = {}
        self.freed: list[list[Run]] = []
        self.next_id = 0

    @initialize(total=st.integers(1, 96))
    def setup(self, total: int) -> None:
        self.alloc = BlockAllocator(total)
        self.owner = [None] * total

    @rule(n=st.integers(1, 48))
    def allocate(self, n: int) -> None:
        free_before = model_free_runs(self.owner)
        runs = self.alloc.allocate(n)
        if n > sum(r.count for r in free_before):
            assert runs is None
            return
        # Fragmentation never makes an allocation fail.
        assert runs is not None, f"{n} blocks free in {free_before} but allocate returned None"
        assert sum(r.count for r in runs) == n
        for run in runs:
            for b in range(run.start, run.end):
                assert self.owner[b] is None, f"block {b} handed out twice"
                self.owner[b] = self.next_id
        fitting = [r for r in free_before if r.count >= n]
        if fitting:
            best = min(fitting, key=lambda r: (r.count, r.start))
            assert runs == [Run(best.start, n)], f"best fit in {free_before} is {best}, got {runs}"
        else:
            assert len(runs) == fewest_runs(free_before, n)
        self.live[self.next_id] = runs
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        runs = self.live.pop(key)
        self.alloc.free(runs)
        for run in runs:
            for b in range(run.start, run.end):
                self.owner[b] = None
        self.freed.append(runs)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        runs = data.draw(st.sampled_from(self.freed))
        if all(self.owner[b] is not None for r in runs for b in range(r.start, r.end)):
            return  # all reused since: a stale owner the allocator cannot tell apart
        before = self.alloc.free_runs()
        with pytest.raises(AllocatorError):
            self.alloc.free(runs)
        assert self.alloc.free_runs() == before

    @rule(start=st.integers(-3, 100), count=st.integers(-2, 100))
    def out_of_range_free_is_refused(self, start: int, count: int) -> None:
        total = self.alloc.total_blocks
        if count > 0 and start >= 0 and start + count <= total:
            return
        with pytest.raises(AllocatorError):
            self.alloc.free([Run(start, count)])

    @invariant()
    def free_plus_used_is_total(self) -> None:
        a = self.alloc
        assert a.free_blocks + a.used_blocks == a.total_blocks
        assert a.used_blocks == sum(1 for who in self.owner if who is not None)

    @invariant()
    def free_space_is_fully_coalesced(self) -> None:
        expected = model_free_runs(self.owner)
        assert self.alloc.free_runs() == expected
        assert self.alloc.largest_free_run == max((r.count for r in expected), default=0)
        self.alloc.check_invariants()


def test_random_operations_keep_every_allocator_promise() -> None:
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None),
    )


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=40),
    keep=st.data(),
)
def test_allocation_succeeds_whenever_enough_free_blocks_exist(
    sizes: list[int], keep: st.DataObject
) -> None:
    alloc = BlockAllocator(sum(sizes))
    held = [alloc.allocate(n) for n in sizes]
    # Free a random subset, which leaves the free space in many pieces.
    for runs in held:
        if runs is not None and keep.draw(st.booleans()):
            alloc.free(runs)
    free = alloc.free_blocks
    if free == 0:
        return
    pieces = alloc.free_runs()
    runs = alloc.allocate(free)
    assert runs is not None
    assert len(runs) == len(pieces)  # all of it: one run per free piece, no fewer possible
    assert alloc.free_blocks == 0
    assert alloc.allocate(1) is None


def test_prefers_one_best_fit_run_lowest_start_on_ties() -> None:
    alloc = BlockAllocator(20)
    a, b, c, d, e = (alloc.allocate(n) for n in (3, 1, 2, 1, 13))
    assert a and b and c and d and e
    alloc.free(a)  # free run (0, 3)
    alloc.free(c)  # free run (4, 2)
    assert alloc.allocate(2) == [Run(4, 2)]  # the 2-run fits better than the 3-run
    alloc.free([Run(4, 2)])
    alloc.free(e)  # free run (7, 13)
    assert alloc.allocate(3) == [Run(0, 3)]


def test_fragmented_allocation_takes_largest_runs_first() -> None:
    alloc = BlockAllocator(12)
    held = [alloc.allocate(1) for _ in range(12)]
    for i in (0, 1, 2, 4, 5, 7, 9, 10, 11):  # free runs of 3, 2, 1, 3
        runs = held[i]
        assert runs is not None
        alloc.free(runs)
    # The largest run whole (lowest start on ties), then the best fit for the rest.
    assert alloc.allocate(5) == [Run(0, 3), Run(4, 2)]


def test_double_free_is_refused_and_changes_nothing() -> None:
    alloc = BlockAllocator(8)
    runs = alloc.allocate(3)
    assert runs is not None
    alloc.free(runs)
    before = alloc.free_runs()
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free(runs)
    with pytest.raises(AllocatorError, match="same free"):
        alloc.free([Run(0, 2), Run(1, 2)])
    assert alloc.free_runs() == before


def test_freeing_everything_coalesces_into_one_run() -> None:
    alloc = BlockAllocator(64)
    held = [alloc.allocate(n) for n in (5, 1, 9, 3, 7, 2, 30, 7)]
    for runs in reversed(held[::2]):
        assert runs is not None
        alloc.free(runs)
    for runs in held[1::2]:
        assert runs is not None
        alloc.free(runs)
    assert alloc.free_runs() == [Run(0, 64)]
    assert alloc.largest_free_run == 64
