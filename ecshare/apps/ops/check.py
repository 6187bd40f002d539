"""The result every doctor check returns, and the guard that turns a broken check into one.

A `Check` has a name, a status (ok / warn / fail), a one-line finding and, when
not ok, a fix an operator can act on. The checks that load native libraries
(UCX, the NIXL self-test) run in child processes; see doctor.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec

Status = Literal["ok", "warn", "fail"]


class Check(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    status: Status
    finding: str
    fix: str = ""
    details: dict[str, Any] = {}


def guarded(name: str, check: Callable[[], list[Check]]) -> list[Check]:
    """Run a check; a bug in it becomes a failed check, not a traceback."""
    try:
        return check()
    except Exception as exc:
        return [
            Check(
                name=name,
                status="fail",
                finding=f"the check itself failed: {type(exc).__name__}: {exc}",
                fix="report this as an ecshare bug, with the output of `ecshare doctor --json`",
            )
        ]
