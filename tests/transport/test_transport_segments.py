"""Pairing and merging extents into segments: pure functions, property-tested."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ecshare.transport import Segment, pair_segments
from ecshare.transport.nixl import merge_segments

Extents = list[tuple[int, int]]


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) ranges in order, joining each one that starts where the last ended."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@st.composite
def _extents(draw: st.DrawFn, total: int) -> Extents:
    """Extents of `total` bytes, scattered with gaps, listed in any order."""
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=12)))
    lengths = [b - a for a, b in itertools.pairwise([0, *cuts, total])]
    extents: Extents = []
    offset = draw(st.integers(0, 1 << 20))
    for n in lengths:
        extents.append((offset, n))
        offset += n + draw(st.integers(0, 4096))
    return draw(st.permutations(extents))


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[Extents, Extents]:
    total = draw(st.integers(0, 1 << 16))
    return draw(_extents(total)), draw(_extents(total))


@settings(max_examples=300)
@given(_pairs())
def test_pair_segments_maps_local_stream_onto_remote_stream(pair: tuple[Extents, Extents]) -> None:
    local, remote = pair
    segs = pair_segments(local, remote)
    total = sum(n for _, n in local)
    assert sum(s.length for s in segs) == total
    assert all(s.length > 0 for s in segs)
    if total:
        assert len(segs) <= len(local) + len(remote) - 1
    else:
        assert segs == []
    # Byte k of the local extents, read in list order, pairs with byte k of the remote
    # ones; so each segment lies inside one extent on each side.
    assert _coalesce([(s.local_offset, s.local_offset + s.length) for s in segs]) == _coalesce(
        [(o, o + n) for o, n in local]
    )
    assert _coalesce([(s.remote_offset, s.remote_offset + s.length) for s in segs]) == _coalesce(
        [(o, o + n) for o, n in remote]
    )


def test_pair_segments_contiguous_sides_give_one_segment() -> None:
    assert pair_segments([(100, 10), (110, 20)], [(0, 30)]) == [
        Segment(100, 0, 10),
        Segment(110, 10, 20),
    ]
    assert merge_segments(pair_segments([(100, 10), (110, 20)], [(0, 30)])) == [Segment(100, 0, 30)]


def test_pair_segments_rejects_unequal_totals_and_negative_lengths() -> None:
    with pytest.raises(ValueError):
        pair_segments([(0, 10)], [(0, 11)])
    # Equal totals, but the -5 would shift the next segment outside (100, 10).
    with pytest.raises(ValueError):
        pair_segments([(0, -5), (0, 15)], [(100, 10)])


@settings(max_examples=300)
@given(_pairs())
def test_merge_segments_keeps_every_byte_and_joins_all_neighbours(
    pair: tuple[Extents, Extents],
) -> None:
    segs = pair_segments(*pair)
    merged = merge_segments(segs)
    assert len(merged) <= len(segs)
    assert sum(s.length for s in merged) == sum(s.length for s in segs)

    def bytes_map(ss: list[Segment]) -> list[tuple[int, int, int]]:
        return _coalesce_pairs([(s.local_offset, s.remote_offset, s.length) for s in ss])

    assert bytes_map(merged) == bytes_map(segs)
    for a, b in itertools.pairwise(merged):
        assert not (
            a.local_offset + a.length == b.local_offset
            and a.remote_offset + a.length == b.remote_offset
        )


def _coalesce_pairs(items: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for lo, ro, n in items:
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((lo, ro, n))
    return out


def test_package_imports_without_nixl_and_names_the_fix() -> None:
    code = (
        "import sys\n"
        "sys.modules['nixl'] = None\n"  # makes `import nixl...` fail like a missing package
        "import ecshare, ecshare.transport\n"
        "from ecshare.transport import NixlTransport, TransportError\n"
        "try:\n"
        "    NixlTransport('x')\n"
        "except TransportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "pip install" in out.stdout
