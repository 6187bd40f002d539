"""Soak sampling: every process's RSS and every region's usage over a run, and their drift."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ecshare.apps.chaos.fleet import Fleet
from ecshare.apps.chaos.options import MiB
from ecshare.apps.chaos.report import ProcessMemory, RegionUsage, Soak
from ecshare.apps.chaos.state import _Tally


class SoakSampling(Fleet):
    def sample(self, t: float) -> None:
        named = {"harness": os.getpid()}
        for c in [*self.consumers, *filter(None, self.producers)]:
            if c.alive():
                named[f"{c.role}-{c.index}"] = c.pid
        for name, pid in named.items():
            with contextlib.suppress(self._psutil.Error):
                mem = self._psutil.Process(pid).memory_info()
                self.rss.setdefault(name, []).append(
                    (t, mem.rss / MiB, (mem.rss - mem.shared) / MiB)
                )
        for c in [*filter(None, self.producers), *self.consumers]:
            if c.answers():
                stats = self._stats(c)
                if stats is not None:
                    s = stats.store
                    self.usage.setdefault(f"{c.role}-{c.index}", []).append(
                        (t, s.used_blocks / s.total_blocks)
                    )

    def _soak(self, t: _Tally) -> Soak:
        warmup_s = self.o.soak_s * self.o.warmup_fraction
        memory = []
        for name, series in sorted(self.rss.items()):
            ts = np.array([s[0] for s in series])
            rss = np.array([s[1] for s in series])
            anon = np.array([s[2] for s in series])
            warm = ts >= warmup_s
            if warm.sum() < 2:
                warm = np.ones_like(ts, dtype=bool)
            warm_i = int(np.argmax(warm))
            memory.append(
                ProcessMemory(
                    process=name,
                    samples=len(series),
                    start_mib=round(float(rss[0]), 1),
                    warm_mib=round(float(rss[warm_i]), 1),
                    end_mib=round(float(rss[-1]), 1),
                    max_mib=round(float(rss.max()), 1),
                    slope_mib_per_min=round(_slope(ts[warm], rss[warm]) * 60, 3),
                    anon_warm_mib=round(float(anon[warm_i]), 1),
                    anon_end_mib=round(float(anon[-1]), 1),
                    anon_slope_mib_per_min=round(_slope(ts[warm], anon[warm]) * 60, 3),
                )
            )
        regions = []
        for name, usage in sorted(self.usage.items()):
            fractions = np.array([u[1] for u in usage])
            regions.append(
                RegionUsage(
                    node=name,
                    samples=len(usage),
                    mean_used_fraction=round(float(fractions.mean()), 3),
                    max_used_fraction=round(float(fractions.max()), 3),
                    end_used_fraction=round(float(fractions[-1]), 3),
                    end_pins=0,
                )
            )
        seconds = self.soak_elapsed or self.o.soak_s
        return Soak(
            seconds=round(seconds, 1),
            warmup_s=warmup_s,
            sample_interval_s=self.o.sample_interval_s,
            fetch_rate_per_s=round(t.attempted / seconds, 1),
            fetches_after_warmup=t.attempted - (self.warm_attempted or 0),
            delivered_mib=round(t.delivered_bytes / MiB, 1),
            memory=memory,
            regions=regions,
        )


def _slope(ts: np.ndarray, ys: np.ndarray) -> float:
    if len(ts) < 2 or float(np.ptp(ts)) == 0.0:
        return 0.0
    return float(np.polyfit(ts, ys, 1)[0])
