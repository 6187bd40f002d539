"""The tests' one way to wait for something to become true: `wait_until`.

It fails the test (AssertionError) when the condition does not hold in time,
naming what was awaited, so a caller never has to check a result. The timeout
bounds a wait for something that must happen, never a measurement: it is generous
on purpose, for loaded hosts.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object],
    what: str = "",
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    *,
    detail: Callable[[], object] | None = None,
) -> None:
    """Return once `predicate()` is true; fail the test after `timeout_s` if it never is.

    `what` names the awaited thing in the failure (by default, the predicate's source
    line); `detail` is called at the failure, for the state that explains it.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            message = f"{what or _source(predicate)}: not within {timeout_s} s"
            if detail is not None:
                message += f"; {detail()!r}"
            raise AssertionError(message)
        time.sleep(interval_s)


def _source(predicate: Callable[[], object]) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)
