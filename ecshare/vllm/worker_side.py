"""The worker half of the connector: copies between the engine's encoder cache and the region.

It attaches to the region the scheduler side owns (by its handle, carried in
the step's metadata), and only ever touches the extents the scheduler planned.
It uses plain torch operations that work on CPU and GPU alike: a device tensor
goes through a pinned host staging buffer where CUDA exists, and no
engine-specific kernels are used.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from ecshare.store import Region, RegionHandle
from ecshare.vllm.ops import LoadOp, ReportRoute, SaveOp, StepPlan, StepReport
from ecshare.vllm.reports import ReportOutbox

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


class WorkerSide:
    def __init__(self, device: torch.device | str, *, writer: bool = True) -> None:
        self._device = torch.device(device)
        # With tensor parallelism every rank holds the same encoder output; one
        # writer is enough, and the others only load.
        self._writer = writer
        self._region: Region | None = None
        self._plan: StepPlan | None = None
        self._report = StepReport()
        self._outbox: ReportOutbox | None = None
        self._saves_done: set[str] = set()  # grants of this step's plan already copied
        self.reports_sent = 0  # on the side channel (see `reports`)

    # -- per step ----------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan
        if plan.region is not None:
            self._attach(plan.region)

    def clear(self) -> None:
        self._plan = None
        self._saves_done = set()

    def take_report(self) -> StepReport | None:
        report, self._report = self._report, StepReport()
        return None if report.empty() and not report.counters else report

    def finish_step(self) -> StepReport | None:
        """The step's report for vLLM's worker metadata, or None when there is none
        or the plan asked for it on the side channel (see `reports`)."""
        self._report_unsaved()
        report = self.take_report()
        route = self._plan.report_to if self._plan is not None else None
        if report is None or route is None:
            return report
        self._outbox_for(route).send(report)
        self.reports_sent += 1
        return None

    def _outbox_for(self, route: ReportRoute) -> ReportOutbox:
        if self._outbox is None or self._outbox.route != route:
            if self._outbox is not None:
                self._outbox.close()
            self._outbox = ReportOutbox(route)
        return self._outbox

    def _attach(self, handle: RegionHandle) -> None:
        if self._region is not None and self._region.handle == handle:
            return
        if self._region is not None:
            self._region.close()
        self._region = Region.attach(handle)

    # -- saving ------------------------------------------------------------------------------

    def start_save(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Before the step's encoder runs: copy planned items the encoder cache already holds.

        The engine does not encode an item its own encoder cache still holds, so
        `save_caches` never fires for it; when the scheduler found such an item
        missing from the region, it planned its save, and the copy happens here.
        """
        if not self._writer or self._plan is None:
            return
        for mm_hash, op in self._plan.saves.items():
            tensor = encoder_cache.get(mm_hash)
            if tensor is not None:
                self._save(op, tensor)

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self._writer or self._plan is None:
            return
        op = self._plan.saves.get(mm_hash)
        tensor = encoder_cache.get(mm_hash)
        if op is None or tensor is None or op.grant in self._saves_done:
            return
        self._save(op, tensor)

    def _save(self, op: SaveOp, tensor: torch.Tensor) -> None:
        self._saves_done.add(op.grant)
        start = time.perf_counter()
        try:
            self._copy_in(op, tensor)
        except Exception as exc:  # reported, so the scheduler frees the entry
            log.warning("ecshare: saving %s failed: %s", op.mm_hash, exc)
            self._report.save_failed[op.grant] = str(exc)[:500]
            return
        self._report.saved[op.grant] = (
            str(tensor.dtype).removeprefix("torch."),
            tuple(tensor.shape),
        )
        self._add("save_seconds", time.perf_counter() - start)

    def _report_unsaved(self) -> None:
        """A planned save with no encoder output by the step's end failed: say so now,
        so that its entry is freed at once rather than a lease later."""
        if not self._writer or self._plan is None:
            return
        for op in self._plan.saves.values():
            if op.grant not in self._saves_done:
                self._saves_done.add(op.grant)
                self._report.save_failed[op.grant] = "no encoder output for it in this step"

    def _copy_in(self, op: SaveOp, tensor: torch.Tensor) -> None:
        assert self._region is not None
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() != op.nbytes:
            raise ValueError(f"encoder output has {flat.numel()} bytes, planned {op.nbytes}")
        if flat.device.type != "cpu":
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(flat, non_blocking=False)
            flat = host
        src = flat.numpy()
        pos = 0
        for offset, length in op.extents:
            np.copyto(self._region.array[offset : offset + length], src[pos : pos + length])
            pos += length

    # -- loading -----------------------------------------------------------------------------

    def load(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        if self._plan is None:
            return
        for op in self._plan.loads:
            if op.mm_hash in encoder_cache:
                self._report.loaded.add(op.grant)
                continue
            start = time.perf_counter()
            try:
                encoder_cache[op.mm_hash] = self._copy_out(op)
            except Exception as exc:
                log.error("ecshare: loading %s failed: %s", op.mm_hash, exc)
                self._report.load_failed[op.grant] = str(exc)[:500]
                continue
            self._report.loaded.add(op.grant)
            self._add("load_seconds", time.perf_counter() - start)

    def _copy_out(self, op: LoadOp) -> torch.Tensor:
        assert self._region is not None
        pin = self._device.type == "cuda"
        host = torch.empty(op.nbytes, dtype=torch.uint8, pin_memory=pin)
        dst = host.numpy()
        pos = 0
        for offset, length in op.extents:
            np.copyto(dst[pos : pos + length], self._region.array[offset : offset + length])
            pos += length
        tensor = host.view(torch_dtype(op.dtype)).reshape(op.shape)
        # The host copy is ours alone, so the region's blocks can be unpinned
        # and reused as soon as this returns.
        return tensor.to(self._device, non_blocking=pin)

    def _add(self, key: str, value: Any) -> None:
        self._report.counters[key] = self._report.counters.get(key, 0.0) + float(value)

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
        if self._region is not None:
            self._region.close()
            self._region = None
