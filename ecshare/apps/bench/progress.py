"""The progress bar of a bench run: on stderr, only on a terminal, never from a thread.

Stdout stays the result (a table or one JSON object), so a pipe or a CI log gets no bar.
The bar redraws from the bench's own thread at most a few times a second instead of
rich's refresh thread: a thread waking ten times a second would compete with the threads
being measured, which on a 2-core machine shows in the figures.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

__all__ = ["BenchProgress"]

_REDRAW_S = 0.25


class BenchProgress:
    """``with BenchProgress(total, "fetch", quiet=...) as bar: bar.advance(step="4 MiB")``."""

    def __init__(self, total: int, label: str, *, quiet: bool = False) -> None:
        self._progress = None
        self._task = None
        self._last = 0.0
        if quiet or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            print("ecshare bench: no progress bar (install ecshare[bench])", file=sys.stderr)
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
            transient=True,
        )
        self._label = label
        self._task = self._progress.add_task(label, total=total)

    def advance(self, n: int = 1, step: str | None = None) -> None:
        if self._progress is None or self._task is None:
            return
        description = f"{self._label}: {step}" if step else None
        self._progress.update(self._task, advance=n, description=description)
        now = time.monotonic()
        if now - self._last >= _REDRAW_S:
            self._last = now
            self._progress.refresh()

    def __enter__(self) -> BenchProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
