"""``ecshare bench abuse``'s result: what it records, the figures made of it, its targets.

Nothing here does I/O but printing. The victim's requests (`VictimRecord`) become each
phase's success share and time to first token (`phase_stats`); the attackers' child
reports what each attack met (`AttackTally`, decoded from its standard output); the
memory sampler reports each process of the launch (`ProcessMemory`). `check_targets`
judges a run by the issue's four promises:

* every victim request succeeds, with and without the attack;
* the victim's TTFT p99 under attack is at most `MAX_P99_RATIO` times its p99 without;
* no process of the launch grew past the `--max-rss` bound;
* no process of the launch restarted or went away.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec
from msgspec import Meta

from ecshare.apps.bench.schema import ReportHeader

__all__ = [
    "MAX_P99_RATIO",
    "AbuseBenchResult",
    "AbuseSpec",
    "AttackTally",
    "PhaseStats",
    "ProcessMemory",
    "Target",
    "VictimRecord",
    "check_targets",
    "phase_stats",
    "print_result",
    "quantile",
]

MAX_P99_RATIO = 2.0
MiB = 1 << 20
# A little over the largest process of an unattacked run on the tiny model (prefill/decode's
# engine core), so that a process an attack makes grow by a few hundred MiB fails it.
DEFAULT_MAX_RSS = 2 << 30
BOMB_SIDE = 8000  # a decompression bomb's width and height, in pixels


class VictimRecord(msgspec.Struct, frozen=True):
    """One victim request: in which phase it was sent, its TTFT, or why it failed."""

    phase: str  # "baseline" or "attack"
    sent_s: float  # from the start of the victim's run
    ttft_s: float | None = None  # to the first chunk carrying content
    error: str | None = None  # None: the stream ended with [DONE] and some content


class PhaseStats(msgspec.Struct, frozen=True):
    phase: str
    sent: int
    succeeded: int
    success_pct: float
    ttft_p50_ms: float | None  # of the requests that succeeded
    ttft_p99_ms: float | None
    errors: dict[str, int]  # each kind of failure (its first words), counted


class AttackTally(msgspec.Struct, kw_only=True):
    """What one attack met, as the attackers' child counts it.

    A try is a connection (raw attacks) or a request (HTTP attacks). Its outcome is the
    proxy's answer ("HTTP 503"), "closed" (the proxy closed the connection without a
    byte), "reset", "timeout", or "connect ERRNO" (the connection never opened)."""

    attack: str
    addresses: tuple[str, ...]
    clients: int  # connections, or request loops, it keeps going at once
    tries: int = 0
    outcomes: dict[str, int] = {}
    retry_after: int = 0  # answers that carried a Retry-After header
    held_s: float = 0.0  # summed over tries that ended: how long each was open
    open_now: int = 0
    peak_open: int = 0
    open_at_end: int = 0  # still open when the attack was stopped

    def ended(self, outcome: str, held_s: float) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.held_s += held_s

    def opened(self) -> None:
        self.tries += 1
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)


class ProcessMemory(msgspec.Struct, frozen=True):
    """One process of the launch, named by its role: the pids it had, its peak RSS."""

    name: str
    pids: tuple[int, ...]  # more than one: it restarted
    peak_rss_bytes: int  # over the whole run
    unattacked_rss_bytes: int  # before the attack; 0: it started during the attack
    alive_at_end: bool
    restarts: int  # pids replaced, plus one where it was gone at the end
    # CPU it used, in cores (CPU-seconds a second), before the attack and during it.
    baseline_cores: float = 0.0
    attack_cores: float = 0.0


class Target(msgspec.Struct, frozen=True):
    name: str
    holds: bool
    detail: str


# Bounds several fields share; each field adds its description.
_Count = Annotated[int, Meta(ge=0, le=100_000)]
_Seconds = Annotated[float, Meta(gt=0, le=86_400)]


class AbuseSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A run's settings: each field is a flag of `ecshare bench abuse` (`--baseline-s`)."""

    baseline_s: Annotated[
        _Seconds, Meta(description="seconds of victim traffic before the attack")
    ] = 30.0
    attack_s: Annotated[_Seconds, Meta(description="seconds of victim traffic under attack")] = 60.0
    victim_rate: Annotated[
        float, Meta(gt=0, le=100, description="victim requests per second, each with a fresh image")
    ] = 2.0
    max_tokens: Annotated[
        int, Meta(ge=1, le=4096, description="tokens per answer, victim and flood")
    ] = 8
    request_timeout_s: Annotated[
        _Seconds, Meta(description="a victim request not answered whole by then has failed")
    ] = 60.0
    max_rss: Annotated[
        int,
        Meta(ge=1 << 20, extra={"size": True}, description="bound on every process's peak RSS"),
    ] = DEFAULT_MAX_RSS
    images_per_prompt: Annotated[
        int,
        Meta(ge=1, le=64, description="the instances' (and proxy's) --limit-mm-per-prompt images"),
    ] = 2
    idle: Annotated[_Count, Meta(description="(a) connections that send nothing")] = 1030
    half_headers: Annotated[
        _Count,
        Meta(description="(b) connections that send half a request header, a line at a time"),
    ] = 1030
    slow_bodies: Annotated[
        _Count, Meta(description="(c) requests without a key whose body comes a byte at a time")
    ] = 256
    slow_bodies_keyed: Annotated[
        _Count, Meta(description="(c) the same with the flood tenant's key")
    ] = 256
    bombs: Annotated[
        _Count, Meta(description=f"(d) clients sending PNGs that decode to {BOMB_SIDE}x{BOMB_SIDE}")
    ] = 2
    many_parts: Annotated[
        _Count, Meta(description="(e) clients sending requests of --parts images")
    ] = 2
    parts: Annotated[int, Meta(ge=1, le=10_000, description="images in a many-parts request")] = 64
    flood: Annotated[
        _Count, Meta(description="(f) the flood tenant's concurrent media requests")
    ] = 64
    addresses_per_attack: Annotated[
        int, Meta(ge=1, le=64, description="loopback source addresses each attack spreads over")
    ] = 4
    first_address: Annotated[
        str,
        Meta(
            pattern=r"127\.\d{1,3}\.\d{1,3}\.\d{1,3}",
            description="the attackers' first source address; the next ones follow it",
        ),
    ] = "127.0.2.1"
    trickle_s: Annotated[
        float,
        Meta(
            gt=0, le=60, description="seconds between the bytes (or header lines) of slow attackers"
        ),
    ] = 1.0
    proxy_args: Annotated[
        str,
        Meta(
            max_length=1000,
            description="more ecshare proxy flags for the launch's proxy "
            "(ecshare launch --extra-proxy-args)",
        ),
    ] = ""
    retry_delay_s: Annotated[
        float,
        Meta(ge=0, le=60, description="pause before an attacker tries again once refused or cut"),
    ] = 0.5

    def attacks(self) -> dict[str, int]:
        """Each attack's clients, by name, in the order they are run."""
        return {
            "idle": self.idle,
            "half_headers": self.half_headers,
            "slow_bodies": self.slow_bodies,
            "slow_bodies_keyed": self.slow_bodies_keyed,
            "bombs": self.bombs,
            "many_parts": self.many_parts,
            "flood": self.flood,
        }


class AbuseBenchResult(ReportHeader, tag_field="bench", tag="abuse"):
    parameters: AbuseSpec
    baseline: PhaseStats
    attack: PhaseStats
    p99_ratio: float | None
    attacks: list[AttackTally]
    processes: list[ProcessMemory]
    refusals: dict[str, float]  # ecshare_proxy_rejected_total by reason, at the end
    targets: list[Target]
    passed: bool
    problems: list[str]  # what kept a figure from being read (e.g. /metrics unreachable)


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (not empty), interpolated between ranks as numpy's
    default does."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def phase_stats(phase: str, records: Iterable[VictimRecord]) -> PhaseStats:
    mine = [r for r in records if r.phase == phase]
    ttfts = [r.ttft_s * 1e3 for r in mine if r.error is None and r.ttft_s is not None]
    errors: dict[str, int] = {}
    for r in mine:
        if r.error is not None:
            kind = " ".join(r.error.split()[:2]).rstrip(":")
            errors[kind] = errors.get(kind, 0) + 1
    ok = len(mine) - sum(errors.values())
    return PhaseStats(
        phase=phase,
        sent=len(mine),
        succeeded=ok,
        success_pct=round(100.0 * ok / len(mine), 2) if mine else 0.0,
        ttft_p50_ms=round(quantile(ttfts, 0.5), 1) if ttfts else None,
        ttft_p99_ms=round(quantile(ttfts, 0.99), 1) if ttfts else None,
        errors=errors,
    )


def p99_ratio(baseline: PhaseStats, attack: PhaseStats) -> float | None:
    if not baseline.ttft_p99_ms or attack.ttft_p99_ms is None:
        return None
    return round(attack.ttft_p99_ms / baseline.ttft_p99_ms, 2)


def check_targets(
    baseline: PhaseStats,
    attack: PhaseStats,
    processes: Sequence[ProcessMemory],
    max_rss_bytes: int,
) -> list[Target]:
    """The issue's four targets, each with what was seen."""
    ratio = p99_ratio(baseline, attack)
    biggest = max(processes, key=lambda p: p.peak_rss_bytes, default=None)
    restarted = [p for p in processes if p.restarts]
    return [
        Target(
            "victim success 100%",
            bool(baseline.sent and attack.sent)
            and baseline.succeeded == baseline.sent
            and attack.succeeded == attack.sent,
            f"baseline {baseline.succeeded}/{baseline.sent}, "
            f"attack {attack.succeeded}/{attack.sent}",
        ),
        Target(
            f"victim TTFT p99 under attack <= {MAX_P99_RATIO:g}x unattacked",
            ratio is not None and ratio <= MAX_P99_RATIO and attack.succeeded == attack.sent,
            f"{_ms(attack.ttft_p99_ms)} against {_ms(baseline.ttft_p99_ms)}"
            + (f" ({ratio:g}x)" if ratio is not None else "")
            + ("" if attack.succeeded == attack.sent else "; failed requests have no TTFT"),
        ),
        Target(
            f"peak RSS of every process <= {max_rss_bytes / MiB:.0f} MiB",
            bool(processes) and all(p.peak_rss_bytes <= max_rss_bytes for p in processes),
            f"largest {biggest.name} {biggest.peak_rss_bytes / MiB:.0f} MiB"
            if biggest
            else "no process sampled",
        ),
        Target(
            "no process restarted",
            bool(processes) and not restarted,
            ", ".join(f"{p.name} x{p.restarts}" for p in restarted) or "none",
        ),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _addresses(addresses: Sequence[str]) -> str:
    if len(addresses) <= 1:
        return "".join(addresses)
    return f"{addresses[0]}-{addresses[-1].rsplit('.', 1)[-1]}"


def _outcomes(tally: AttackTally, most: int = 4) -> str:
    top = sorted(tally.outcomes.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name} {count}" for name, count in top[:most])
    if len(top) > most:
        shown += f", {len(top) - most} more"
    return shown or "-"


def print_result(result: AbuseBenchResult) -> None:
    p = result.parameters
    print(
        f"ecshare bench abuse: {p.baseline_s:g} s unattacked, then {p.attack_s:g} s under "
        f"attack; the victim sends {p.victim_rate:g} requests/s, each with a fresh image"
    )
    print()
    print(f"{'victim':<10} {'sent':>5} {'ok %':>6} {'TTFT p50':>10} {'TTFT p99':>10}  failures")
    for s in (result.baseline, result.attack):
        failures = ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "-"
        print(
            f"{s.phase:<10} {s.sent:>5} {s.success_pct:>6.1f} {_ms(s.ttft_p50_ms):>10} "
            f"{_ms(s.ttft_p99_ms):>10}  {failures}"
        )
    ratio = "-" if result.p99_ratio is None else f"{result.p99_ratio:g}x"
    print(f"TTFT p99 attack / baseline: {ratio} (target <= {MAX_P99_RATIO:g}x)")
    print()
    print(
        f"{'attack':<18} {'from':<18} {'clients':>7} {'tries':>6} {'peak':>5} "
        f"{'at end':>6} {'mean held':>9}  outcomes"
    )
    for t in result.attacks:
        ended = sum(t.outcomes.values())
        held = f"{t.held_s / ended:.1f} s" if ended else "-"
        print(
            f"{t.attack:<18} {_addresses(t.addresses):<18} {t.clients:>7} {t.tries:>6} "
            f"{t.peak_open:>5} {t.open_at_end:>6} {held:>9}  {_outcomes(t)}"
            + (f", Retry-After on {t.retry_after}" if t.retry_after else "")
        )
    print()
    print(
        f"{'process':<34} {'pids':>4} {'peak RSS':>10} {'unattacked':>10}  "
        "CPU cores (baseline, attack)  restarts"
    )
    for m in result.processes:
        gone = "" if m.alive_at_end else " (gone at the end)"
        print(
            f"{m.name:<34} {len(m.pids):>4} {m.peak_rss_bytes / MiB:>6.0f} MiB "
            f"{m.unattacked_rss_bytes / MiB:>6.0f} MiB  "
            f"{m.baseline_cores:>12.2f} {m.attack_cores:>8.2f}      {m.restarts}{gone}"
        )
    print()
    print("refusals by reason (ecshare_proxy_rejected_total, at the end)")
    counted = {k: v for k, v in sorted(result.refusals.items()) if v}
    for reason, count in counted.items():
        print(f"  {reason:<20} {count:>8.0f}")
    if not counted:
        print("  none")
    for problem in result.problems:
        print(f"problem: {problem}")
    print()
    for target in result.targets:
        print(f"{'PASS' if target.holds else 'FAIL'}  {target.name}: {target.detail}")
    print("all targets hold" if result.passed else "some targets do not hold")
