"""What the scheduler side tells workers, and what workers report back.

These travel inside vLLM's scheduler output and model runner output, so they
are plain picklable values: region-relative extents, never pointers.

Every planned copy carries a grant id of its own, and the workers report by
that id, never by mm_hash alone: with async scheduling the plan of step N+1 is
built before the report of step N arrives, and the same mm_hash can be loaded
(or saved again, after an abandoned save) in both. A report releases exactly
the pin, or commits exactly the entry, that its own plan named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ecshare.protocol import ParamsError, TransferParam, decode_item
from ecshare.store import RegionHandle

__all__ = ["TransferParam", "decode_param"]


@dataclass(frozen=True)
class SaveOp:
    """Copy the encoder output of `mm_hash` into these region extents; report as `grant`.

    The output is either encoded in this step (`save_caches`) or already in the
    engine's encoder cache when the step starts (`start_save_caches`: an item the
    engine did not encode again, whose region entry had been evicted).
    """

    grant: str
    mm_hash: str
    extents: tuple[tuple[int, int], ...]
    nbytes: int


@dataclass(frozen=True)
class LoadOp:
    """Build the encoder cache entry of `mm_hash` from these region extents; report as `grant`.

    `grant` names the pin that keeps the extents' blocks from reuse until the
    workers report this very copy done.
    """

    grant: str
    mm_hash: str
    extents: tuple[tuple[int, int], ...]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ReportRoute:
    """Where workers send their reports when vLLM would drop them (see `reports`)."""

    address: str
    token: bytes


@dataclass
class StepPlan:
    """One step's work for the workers (the connector metadata's payload)."""

    region: RegionHandle | None
    saves: dict[str, SaveOp] = field(default_factory=dict)
    loads: list[LoadOp] = field(default_factory=list)
    report_to: ReportRoute | None = None


@dataclass
class StepReport:
    """One step's results from the workers, merged across workers, keyed by grant id."""

    saved: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # dtype, shape
    save_failed: dict[str, str] = field(default_factory=dict)  # grant -> why
    loaded: set[str] = field(default_factory=set)
    load_failed: dict[str, str] = field(default_factory=dict)  # grant -> why
    counters: dict[str, float] = field(default_factory=dict)

    def merge(self, other: StepReport) -> StepReport:
        counters = dict(self.counters)
        for key, value in other.counters.items():
            counters[key] = counters.get(key, 0) + value
        # With tensor parallelism every rank loads: a grant is loaded only if no rank failed it.
        load_failed = {**self.load_failed, **other.load_failed}
        return StepReport(
            saved={**self.saved, **other.saved},
            save_failed={**self.save_failed, **other.save_failed},
            loaded=(self.loaded | other.loaded) - load_failed.keys(),
            load_failed=load_failed,
            counters=counters,
        )

    def empty(self) -> bool:
        return not (self.saved or self.save_failed or self.loaded or self.load_failed)


def decode_param(raw: object) -> TransferParam | None:
    """One item's params from a request; None when absent or malformed (then encode locally)."""
    try:
        return decode_item(raw)
    except ParamsError:
        return None
