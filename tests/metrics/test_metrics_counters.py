"""Every counter the parts keep is in `ecshare.metrics.COUNTED`: exported as a metric
of its own, under `ecshare_events_total`, or left out with a reason.

The counters of Consumer and Producer (and their Inbox and Pusher) are found by
reading their source with `ast`: every key passed to a counting call, including
the reason prefix of an f-string key. The control server's are read from a real
server, which holds every key it counts from the start.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ecshare import metrics
from ecshare.control import ControlServer
from ecshare.control.lane import STAT_NAMES as LANE_STAT_NAMES
from ecshare.metrics import COUNTED, EVENTS, NOT_EXPORTED, SPEC_BY_NAME, Side

PEER = Path(metrics.__file__).resolve().parent / "peer"
SOURCES = {
    Side.CONSUMER: ("consumer.py", "inbox.py", "link.py"),
    Side.PRODUCER: ("producer.py", "pusher.py"),
}
# Calls that count: the key is the argument at this position.
COUNTING_CALLS = {"_count": 0, "_count_add": 0, "_add": 0, "_drop_link": 1}


def _keys(expr: ast.expr) -> list[tuple[str, bool]]:
    """(key, is_a_prefix) of a key expression: a literal, an f-string, or a choice of them."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [(expr.value, False)]
    if isinstance(expr, ast.JoinedStr):
        head = expr.values[0]
        assert isinstance(head, ast.Constant), ast.unparse(expr)
        return [(str(head.value), True)]
    if isinstance(expr, ast.IfExp):
        return _keys(expr.body) + _keys(expr.orelse)
    return []


def counted_in_source(side: Side) -> set[tuple[str, bool]]:
    found: set[tuple[str, bool]] = set()
    for name in SOURCES[side]:
        for node in ast.walk(ast.parse((PEER / name).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                position = COUNTING_CALLS.get(node.func.attr)
                if position is not None and len(node.args) > position:
                    found.update(_keys(node.args[position]))
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "counters"
            ):
                found.update(_keys(node.slice))
    return found


def listed(side: Side, key: str, is_prefix: bool) -> bool:
    for row in COUNTED:
        if row.side is not side:
            continue
        if row.by_reason and key.startswith(row.key):
            return True
        if not row.by_reason and not is_prefix and row.key == key:
            return True
    return False


@pytest.mark.parametrize("side", list(SOURCES), ids=lambda s: s.value)
def test_every_counter_in_the_source_is_listed(side: Side) -> None:
    found = counted_in_source(side)
    assert len(found) > 20, found  # the scan sees the counting calls at all
    missing = sorted(key for key, prefix in found if not listed(side, key, prefix))
    assert missing == [], f"add these {side.value} counters to ecshare.metrics.COUNTED"


def test_every_control_server_counter_is_listed() -> None:
    server = ControlServer(
        host="127.0.0.1", port=0, keys=None, authorized=frozenset(), insecure=True
    )
    try:
        keys = set(server.stats)
    finally:
        server.close()
    assert {"received", "sent", "auth_accepted"} <= keys
    keys |= set(LANE_STAT_NAMES)  # a producer's control stats hold its lane server's too
    missing = sorted(key for key in keys if not listed(Side.CONTROL, key, False))
    assert missing == []


def test_each_row_names_a_metric_or_says_why_not() -> None:
    for row in COUNTED:
        if row.metric == NOT_EXPORTED:
            assert row.why, row
        else:
            spec = SPEC_BY_NAME[row.metric]
            assert spec.kind is metrics.Kind.COUNTER, row
            labelled = row.by_reason or bool(row.reason) or row.metric == EVENTS
            assert labelled == bool(spec.labels), row
    keys = [(row.side, row.key) for row in COUNTED]
    assert len(keys) == len(set(keys)), "a counter listed twice"


def test_a_counter_is_read_as_its_row_says() -> None:
    out: metrics.Samples = {spec.name: {} for spec in metrics.SPECS}
    counters = {
        "fetched": 3,
        "failed.timeout": 2,
        "late_replies": 1,
        "a_counter_nobody_listed": 5,
    }
    metrics._add_counters(out, Side.CONSUMER, counters)
    assert out["fetched_items"] == {(): 3}
    assert out["fetch_failures"] == {("timeout",): 2}
    assert out[EVENTS] == {
        ("consumer", "late_replies"): 1,
        # Not lost: exported as an event (and logged) until it is listed.
        ("consumer", "a_counter_nobody_listed"): 5,
    }
    control: metrics.Samples = {spec.name: {} for spec in metrics.SPECS}
    metrics._add_counters(
        control, Side.CONTROL, {"auth_rejected": 4, "auth_refused.unknown_key": 4, "sent": 9}
    )
    assert control["auth_failures"] == {("unknown_key",): 4}  # counted once, not twice
    assert control[EVENTS] == {("control", "sent"): 9}
