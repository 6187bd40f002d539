"""The figures of ``ecshare bench serve``: one routing mode's, the issue's ratios, the table.

Pure: everything here is computed from the client's records and two snapshots of the
instances' and the proxy's counters taken around a run (`Snapshot`), so that what a
figure means can be read and tested apart from the servers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ecshare.apps.bench.serve_client import Record
    from ecshare.apps.bench.serve_workload import Workload

__all__ = [
    "ModeResult",
    "Ratios",
    "Result",
    "Round",
    "Snapshot",
    "mode_result",
    "print_result",
    "ratios",
]


class ModeResult(msgspec.Struct, kw_only=True):
    """One routing mode's figures (see `mode_result`)."""

    routing: str
    rounds: int  # runs of the workload, each over images of its own, pooled here
    requests: int
    failed: int
    checked: int  # answers compared with the plain instance's
    wrong: int
    encoder_calls: float  # requests the encoders finished (vLLM's counter)
    encoder_calls_per_request: float
    encoded_items: float  # encoder outputs stored (ecshare's saved_items)
    bytes_moved: float  # pulled + pushed into prefill/decode regions
    fetched_bytes: float
    pushed_bytes: float
    local_encodes: float  # items prefill/decode encoded itself
    ttft_first_p50_ms: float | None
    ttft_first_p99_ms: float | None
    ttft_later_p50_ms: float | None
    ttft_later_p99_ms: float | None
    ttft_later_p50_by_round_ms: list[float | None]
    requests_per_s: float
    encoder_round_trip_ms: float | None  # the proxy's mean encoder stage, every request
    # The p50 of the encoder stage of later turns that called an encoder (the proxy's
    # `Server-Timing`): what routing by reuse skips for a later turn whose items are held.
    later_encoder_round_trip_ms: float | None = None
    # Where later turns' time to first token goes, p50 of each step over the later turns
    # the proxy timed (a step a request skipped counts 0): the proxy's own steps
    # (`ecshare.apps.proxy.routing`), `proxy` their sum, and `after` the rest of the
    # time to first token (the client's hops, prefill/decode after its headers).
    later_steps_p50_ms: dict[str, float] = {}
    # Later turns split by their media: those that only resend images sent before (which
    # reuse routing can serve without an encoder) and those that add a new one: TTFT p50,
    # and the encoder stage p50 (a request that skipped it counts 0).
    later_repeats: int = 0
    ttft_later_repeat_p50_ms: float | None = None
    encode_later_repeat_p50_ms: float | None = None
    later_new: int = 0
    ttft_later_new_p50_ms: float | None = None
    encode_later_new_p50_ms: float | None = None
    # Items prefill/decode waited for (pushed or pulled: its exposed latency histogram),
    # and their mean wait, from the scheduler asking to the item being local.
    item_waits: float = 0.0
    item_wait_ms: float | None = None
    route_reasons: dict[str, float]  # ecshare_proxy_route_total, where the proxy counts it
    encoder_calls_saved: float | None
    errors: list[str]


class Ratios(msgspec.Struct, kw_only=True):
    encoder_calls_ratio: float  # reuse / load, per request
    encoder_calls_bound: float  # (1 - reuse) + 0.05
    encoder_calls_met: bool
    later_ttft_p50_gain_ms: float  # load - reuse
    # What the gain is held to: load routing's later-turn encoder stage p50 (the round
    # trip a held later turn skips) where the proxy timed it, else its mean encoder stage.
    encoder_round_trip_ms: float
    later_ttft_met: bool
    mean_encoder_round_trip_ms: float = 0.0  # load routing's, over every request


class Result(msgspec.Struct, kw_only=True):
    bench: str = "serve"
    chats: int
    turns: int
    reuse_target: float
    reuse: float  # achieved by the workload
    zipf: float
    rate: float
    arrivals: str
    seed: int
    max_tokens: int
    check_share: float
    rounds: int  # per mode
    encoders: int
    prefill_decode: int
    media_parts: int
    distinct_images: int
    modes: list[ModeResult]
    ratios: Ratios | None
    problems: list[str]


class Snapshot(msgspec.Struct):
    """Counters at one moment, each summed over its instances, without their prefix."""

    encoders: dict[str, float]  # vLLM's and ecshare's samples, summed over the encoders
    prefill_decode: dict[str, float]
    proxy: dict[str, float]
    route: dict[str, float]


def _delta(after: dict[str, float], before: dict[str, float], *names: str) -> float:
    """The change of the first of `names` present (a counter's name with or without
    `_total`), 0 when none is."""
    for name in names:
        for key in (name, name + "_total"):
            if key in after:
                return after[key] - before.get(key, 0.0)
    return 0.0


def percentile_ms(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (seconds), in milliseconds; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return round(ordered[rank - 1] * 1e3, 2)


@dataclass
class Round:
    """One run of the workload in one mode: the client's records, the plain instance's
    tokens (None where not checked) and the counters before and after."""

    records: list[Record]
    reference: list[list[int] | None]
    before: Snapshot
    after: Snapshot


def mode_result(mode: str, workload: Workload, rounds: list[Round]) -> ModeResult:
    """One mode's figures, pooled over its rounds (each a run of `workload`)."""
    requests = [t for _ in rounds for t in workload.requests]
    records = [r for one in rounds for r in one.records]
    reference = [ref for one in rounds for ref in one.reference]
    failed = [r for r in records if r.error is not None]
    checked = [
        (r, ref)
        for r, ref in zip(records, reference, strict=True)
        if ref is not None and r.error is None
    ]
    first = [r.ttft_s for r, t in zip(records, requests, strict=True) if t.turn == 0 and r.ttft_s]
    timed_later = [
        r for r, t in zip(records, requests, strict=True) if t.turn > 0 and r.ttft_s and r.steps
    ]
    repeat = [
        r
        for r, t in zip(records, requests, strict=True)
        if t.turn > 0 and r.ttft_s and not t.first_sightings
    ]
    new = [
        r
        for r, t in zip(records, requests, strict=True)
        if t.turn > 0 and r.ttft_s and t.first_sightings
    ]

    def ttft_p50(some: list[Record]) -> float | None:
        return percentile_ms([r.ttft_s for r in some if r.ttft_s], 0.5)

    def encode_p50(some: list[Record]) -> float | None:
        return percentile_ms([r.steps.get("encode", 0.0) for r in some if r.steps], 0.5)

    later = [r.ttft_s for r, t in zip(records, requests, strict=True) if t.turn > 0 and r.ttft_s]
    by_round = [
        percentile_ms(
            [
                r.ttft_s
                for r, t in zip(one.records, workload.requests, strict=True)
                if t.turn > 0 and r.ttft_s
            ],
            0.5,
        )
        for one in rounds
    ]
    span = sum(
        max(r.ended_s for r in one.records) - min(r.sent_s for r in one.records)
        for one in rounds
        if one.records
    )

    def delta(side: str, *names: str) -> float:
        return sum(_delta(getattr(o.after, side), getattr(o.before, side), *names) for o in rounds)

    n = len(records)
    calls = delta("encoders", "request_success")
    fetched = delta("prefill_decode", "ecshare_fetched_bytes")
    pushed = delta("prefill_decode", "ecshare_pushed_in_bytes")
    waits = delta("prefill_decode", "ecshare_exposed_latency_seconds_count")
    waited_s = delta("prefill_decode", "ecshare_exposed_latency_seconds_sum")
    stage_n = delta("proxy", "encode_seconds_count")
    stage_s = delta("proxy", "encode_seconds_sum")
    reasons: dict[str, float] = {}
    for one in rounds:
        for k, v in one.after.route.items():
            reasons[k] = reasons.get(k, 0.0) + v - one.before.route.get(k, 0.0)
    saved = None
    if rounds and any(k.startswith("encoder_calls_saved") for k in rounds[0].after.proxy):
        saved = delta("proxy", "encoder_calls_saved")
    return ModeResult(
        routing=mode, rounds=len(rounds), requests=n, failed=len(failed), checked=len(checked),
        wrong=sum(1 for r, ref in checked if r.tokens != ref), encoder_calls=calls,
        encoder_calls_per_request=round(calls / n, 4) if n else 0.0,
        encoded_items=delta("encoders", "ecshare_saved_items"),
        bytes_moved=fetched + pushed, fetched_bytes=fetched, pushed_bytes=pushed,
        local_encodes=delta("prefill_decode", "ecshare_local_encodes"),
        ttft_first_p50_ms=percentile_ms(first, 0.5), ttft_first_p99_ms=percentile_ms(first, 0.99),
        ttft_later_p50_ms=percentile_ms(later, 0.5), ttft_later_p99_ms=percentile_ms(later, 0.99),
        ttft_later_p50_by_round_ms=by_round,
        requests_per_s=round((n - len(failed)) / span, 3) if span > 0 else 0.0,
        encoder_round_trip_ms=round(stage_s / stage_n * 1e3, 2) if stage_n else None,
        later_encoder_round_trip_ms=percentile_ms(
            [r.steps["encode"] for r in timed_later if "encode" in r.steps], 0.5
        ),
        later_steps_p50_ms=steps_p50_ms(timed_later),
        later_repeats=len(repeat), ttft_later_repeat_p50_ms=ttft_p50(repeat),
        encode_later_repeat_p50_ms=encode_p50(repeat), later_new=len(new),
        ttft_later_new_p50_ms=ttft_p50(new), encode_later_new_p50_ms=encode_p50(new),
        item_waits=waits, item_wait_ms=round(waited_s / waits * 1e3, 2) if waits else None,
        route_reasons=reasons, encoder_calls_saved=saved,
        errors=sorted({r.error for r in failed if r.error})[:5],
    )  # fmt: skip


PROXY_STEPS = ("parse", "key", "lookup", "encode", "wait", "render")


def steps_p50_ms(records: list[Record]) -> dict[str, float]:
    """The p50 of each proxy step over `records` (0 where a request skipped it), of their
    sum before prefill/decode (`proxy`), of `pd`, and of the rest of each time to first
    token (`after`); {} without records."""
    if not records:
        return {}
    named = {name for r in records for name in r.steps}
    order = [*PROXY_STEPS, *sorted(named - {*PROXY_STEPS, "pd"}), "pd"]
    out: dict[str, float] = {}
    for name in order:
        if name in named:
            out[name] = percentile_ms([r.steps.get(name, 0.0) for r in records], 0.5) or 0.0
    before = [sum(v for k, v in r.steps.items() if k != "pd") for r in records]
    out["proxy"] = percentile_ms(before, 0.5) or 0.0
    rest = [(r.ttft_s or 0.0) - sum(r.steps.values()) for r in records]
    out["after"] = percentile_ms(rest, 0.5) or 0.0
    return out


def ratios(modes: list[ModeResult], reuse: float) -> Ratios | None:
    """The issue's two ratios, reuse routing against load routing; None without both."""
    by = {m.routing: m for m in modes}
    load, on = by.get("load"), by.get("reuse")
    if load is None or on is None or not load.encoder_calls_per_request:
        return None
    if load.ttft_later_p50_ms is None or on.ttft_later_p50_ms is None:
        return None
    ratio = on.encoder_calls_per_request / load.encoder_calls_per_request
    bound = (1.0 - reuse) + 0.05
    gain = load.ttft_later_p50_ms - on.ttft_later_p50_ms
    mean = load.encoder_round_trip_ms or 0.0
    trip = load.later_encoder_round_trip_ms or mean
    return Ratios(
        encoder_calls_ratio=round(ratio, 4), encoder_calls_bound=round(bound, 4),
        encoder_calls_met=ratio <= bound, later_ttft_p50_gain_ms=round(gain, 2),
        encoder_round_trip_ms=trip, later_ttft_met=gain >= trip,
        mean_encoder_round_trip_ms=mean,
    )  # fmt: skip


def print_result(result: Result) -> None:
    print(
        f"bench serve: {result.chats} chats x {result.turns} turns, reuse {result.reuse:.2f} "
        f"(target {result.reuse_target:.2f}), zipf {result.zipf:g}, {result.rate:g} req/s "
        f"{result.arrivals}, {result.max_tokens} tokens, {result.encoders} encoder(s), "
        f"{result.prefill_decode} prefill/decode, {result.media_parts} media parts over "
        f"{result.distinct_images} images, {result.rounds} round(s) per mode"
    )
    head = (
        "routing",
        "enc/req",
        "encoded",
        "MiB moved",
        "TTFT1 p50",
        "p99",
        "TTFTn p50",
        "p99",
        "req/s",
        "enc ms",
        "wrong",
        "failed",
    )
    print("".join(f"{h:>10}" for h in head))
    for m in result.modes:
        cells = (
            m.routing, f"{m.encoder_calls_per_request:.2f}", f"{m.encoded_items:g}",
            f"{m.bytes_moved / (1 << 20):.2f}", _ms(m.ttft_first_p50_ms), _ms(m.ttft_first_p99_ms),
            _ms(m.ttft_later_p50_ms), _ms(m.ttft_later_p99_ms), f"{m.requests_per_s:.2f}",
            _ms(m.encoder_round_trip_ms), f"{m.wrong}/{m.checked}", str(m.failed),
        )  # fmt: skip
        print("".join(f"{c:>10}" for c in cells))
        if m.rounds > 1:
            each = ", ".join(_ms(v) for v in m.ttft_later_p50_by_round_ms)
            print(f"  {m.routing}: later-turn TTFT p50 by round: {each} ms")
        if m.later_steps_p50_ms:
            steps = ", ".join(f"{k} {v:.2f}" for k, v in m.later_steps_p50_ms.items())
            print(f"  {m.routing}: later turns, p50 ms per step: {steps}")
        if m.later_repeats or m.later_new:
            print(
                f"  {m.routing}: later turns that only resend ({m.later_repeats}): TTFT p50 "
                f"{_ms(m.ttft_later_repeat_p50_ms)} ms, encoder stage p50 "
                f"{_ms(m.encode_later_repeat_p50_ms)} ms; that add an image ({m.later_new}): "
                f"{_ms(m.ttft_later_new_p50_ms)} ms, {_ms(m.encode_later_new_p50_ms)} ms"
            )
        if m.item_waits:
            print(
                f"  {m.routing}: prefill/decode waited for {m.item_waits:g} items (pushed or "
                f"pulled), {_ms(m.item_wait_ms)} ms each on average"
            )
        for error in m.errors:
            print(f"  {m.routing}: {error}")
    r = result.ratios
    if r is not None:
        print(
            f"encoder calls, reuse / load: {r.encoder_calls_ratio:.2f} (bound "
            f"{r.encoder_calls_bound:.2f}: {'met' if r.encoder_calls_met else 'NOT met'}); "
            f"later-turn TTFT p50 gain {r.later_ttft_p50_gain_ms:.1f} ms against the encoder "
            f"round trip {r.encoder_round_trip_ms:.1f} ms: "
            f"{'met' if r.later_ttft_met else 'NOT met'} (the mean encoder stage of every "
            f"request: {r.mean_encoder_round_trip_ms:.1f} ms)"
        )
    for problem in result.problems:
        print(f"note: {problem}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
