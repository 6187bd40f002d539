"""Under CI, a skip must be on the allow-list: any other skip fails the run.

A skipped test is a promise nobody checked. Where a skip is expected (a tool the
machine lacks, a GPU), `tests/skips_allowed.txt` names the test and says why, one
per line: `<nodeid>  <why>`; a nodeid without its `[parameters]` covers every case,
a file's path covers a module skipped whole (an `importorskip`). With CI=true (or
ECSHARE_STRICT_SKIPS=1) a skip not on the list is reported as a failure, with its
reason; an xfail is not a skip. ECSHARE_SKIPS_ALLOWED names another list.

Registered by tests/conftest.py; tests/test_skip_check.py runs it on its own.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

ALLOWED = Path(__file__).resolve().parent / "skips_allowed.txt"


def strict() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true") for v in ("CI", "ECSHARE_STRICT_SKIPS")
    )


def allowed(path: Path) -> dict[str, str]:
    """The allow-list: nodeid -> why. A line without a why is an error, not a pass."""
    entries: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, _, why = line.partition(" ")
        if not why.strip():
            raise pytest.UsageError(f"{path}:{n}: {nodeid} is allowed to skip, but not said why")
        entries[nodeid] = why.strip()
    return entries


def on_list(nodeid: str, entries: dict[str, str]) -> bool:
    return nodeid in entries or nodeid.split("[", 1)[0] in entries


def _list() -> dict[str, str]:
    return allowed(Path(os.environ.get("ECSHARE_SKIPS_ALLOWED", ALLOWED)))


def _fail(report: pytest.CollectReport | pytest.TestReport) -> None:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, and not on the allow-list ({os.environ.get('ECSHARE_SKIPS_ALLOWED', ALLOWED)}): "
        f"{reason}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    skipped = report.skipped and not hasattr(report, "wasxfail")
    if skipped and strict() and not on_list(report.nodeid, _list()):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and strict() and not on_list(report.nodeid, _list()):
        _fail(report)
