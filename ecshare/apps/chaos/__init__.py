"""Fault injection and soak runs: real producer and consumer processes under faults.

`ecshare chaos` (see `harness`) proves that nothing is lost, leaked or left
hanging when processes die, pause or restart and control messages are delayed
or lost; `ecshare chaos --soak SECONDS` runs sustained load and measures memory
drift. docs/RELIABILITY.md has the figures.

May import: anything in ecshare.
"""

from ecshare.apps.chaos.harness import FAULT_KINDS, ChaosOptions, run_chaos
from ecshare.apps.chaos.report import ChaosReport, print_report

__all__ = ["FAULT_KINDS", "ChaosOptions", "ChaosReport", "print_report", "run_chaos"]
