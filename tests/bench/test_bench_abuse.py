"""`ecshare bench abuse`: its figures and targets, and its attackers against a real proxy.

The victim's statistics, the four targets, the table and the flags are checked with no
process. One test starts instant stub backends (`ecshare.apps.bench.instant`) and a real
`ecshare proxy` in front of them, runs the attackers' child process with a few idle
sockets from 127.0.0.2, and reads the proxy's own socket table: the attack reaches it
from that address, never from 127.0.0.1. No test here starts vLLM: the whole bench takes
about three and a half minutes.
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
from waiting import wait_until

from ecshare.apps.bench.abuse import _MemorySampler
from ecshare.apps.bench.abuse_attacks import (
    ATTACKING,
    AttackPlan,
    attack_addresses,
    bomb_png,
)
from ecshare.apps.bench.abuse_report import (
    BOMB_SIDE,
    AbuseBenchResult,
    AbuseSpec,
    AttackTally,
    PhaseStats,
    ProcessMemory,
    VictimRecord,
    check_targets,
    p99_ratio,
    phase_stats,
    print_result,
    quantile,
)
from ecshare.apps.bench.commands import add_bench_arguments
from ecshare.apps.bench.schema import machine_info, utc_now
from ecshare.apps.ready import AnyReady, ProxyReady, StubsReady, parse_ready
from ecshare.config.secret_files import write_secret_file

GiB = 1 << 30


def _records(phase: str, ttfts_ms: list[float], errors: tuple[str, ...] = ()) -> list[VictimRecord]:
    ok = [VictimRecord(phase, n * 0.5, t / 1e3) for n, t in enumerate(ttfts_ms)]
    return ok + [VictimRecord(phase, 99.0, None, e) for e in errors]


def _process(
    name: str, rss: int = GiB, pids: tuple[int, ...] = (1,), alive: bool = True
) -> ProcessMemory:
    return ProcessMemory(name, pids, rss, rss // 2, alive, len(pids) - 1 + (not alive))


def test_quantile_interpolates_between_ranks_as_numpy_does() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == pytest.approx(50.5)
    assert quantile(values, 0.99) == pytest.approx(99.01)
    assert quantile([7.0], 0.99) == 7.0
    assert quantile([3.0, 1.0, 2.0], 0.0) == 1.0


def test_each_phase_counts_only_its_own_requests_and_times_only_successes() -> None:
    records = _records("baseline", [100, 200, 300]) + _records(
        "attack", [1000], ("HTTP 503", "HTTP 503", "timeout")
    )
    baseline, attack = phase_stats("baseline", records), phase_stats("attack", records)
    assert (baseline.sent, baseline.succeeded, baseline.success_pct) == (3, 3, 100.0)
    assert baseline.ttft_p50_ms == 200.0
    assert (attack.sent, attack.succeeded, attack.success_pct) == (4, 1, 25.0)
    assert attack.ttft_p50_ms == attack.ttft_p99_ms == 1000.0
    assert attack.errors == {"HTTP 503": 2, "timeout": 1}
    assert p99_ratio(baseline, attack) == pytest.approx(1000 / baseline.ttft_p99_ms, rel=1e-2)


def test_a_phase_with_no_success_has_no_ttft_and_no_ratio() -> None:
    baseline = phase_stats("baseline", _records("baseline", [100]))
    attack = phase_stats("attack", _records("attack", [], ("HTTP 503",)))
    assert attack.ttft_p99_ms is None and attack.success_pct == 0.0
    assert p99_ratio(baseline, attack) is None


def _verdicts(
    baseline: PhaseStats, attack: PhaseStats, processes: list[ProcessMemory]
) -> list[bool]:
    return [t.holds for t in check_targets(baseline, attack, processes, 2 * GiB)]


def test_every_target_holds_when_the_victim_is_served_as_before_and_nothing_grew() -> None:
    baseline = phase_stats("baseline", _records("baseline", [100.0] * 50 + [200.0]))
    attack = phase_stats("attack", _records("attack", [150.0] * 50 + [390.0]))
    assert (
        _verdicts(baseline, attack, [_process("launch (proxy)"), _process("encoder0")])
        == [True] * 4
    )


def test_one_failed_victim_request_fails_success_and_ttft() -> None:
    baseline = phase_stats("baseline", _records("baseline", [100.0] * 10))
    attack = phase_stats("attack", _records("attack", [100.0] * 10, ("HTTP 503",)))
    assert _verdicts(baseline, attack, [_process("p")]) == [False, False, True, True]


def test_a_p99_past_twice_the_unattacked_one_fails_only_the_ttft_target() -> None:
    baseline = phase_stats("baseline", _records("baseline", [100.0] * 10))
    attack = phase_stats("attack", _records("attack", [100.0] * 9 + [250.0]))
    assert _verdicts(baseline, attack, [_process("p")]) == [True, False, True, True]


def test_memory_past_the_bound_and_any_restart_fail_their_targets() -> None:
    ok = phase_stats("baseline", _records("baseline", [100.0] * 10))
    grown = [_process("encoder0", rss=3 * GiB)]
    assert _verdicts(ok, ok, grown) == [True, True, False, True]
    for restarted in (_process("encoder0", pids=(1, 2)), _process("encoder0", alive=False)):
        assert _verdicts(ok, ok, [restarted]) == [True, True, True, False]
    assert _verdicts(ok, ok, []) == [True, True, False, False]  # nothing sampled proves nothing


def test_the_table_shows_both_phases_the_ratio_each_process_refusals_and_verdicts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    baseline = phase_stats("baseline", _records("baseline", [100.0] * 10))
    attack = phase_stats("attack", _records("attack", [300.0] * 10, ("HTTP 503",)))
    processes = [_process("launch (proxy)", rss=300 << 20), _process("encoder0", pids=(5, 6))]
    targets = check_targets(baseline, attack, processes, 2 * GiB)
    tally = AttackTally(attack="idle", addresses=("127.0.2.1", "127.0.2.4"), clients=1030)
    tally.opened()
    tally.ended("HTTP 503", 0.01)
    result = AbuseBenchResult(
        created_at=utc_now(),
        machine=machine_info(0.0),
        parameters=AbuseSpec(),
        baseline=baseline,
        attack=attack,
        p99_ratio=p99_ratio(baseline, attack),
        attacks=[tally],
        processes=processes,
        refusals={"connections": 12.0, "auth": 0.0},
        targets=targets,
        passed=False,
        problems=[],
    )
    print_result(result)
    out = capsys.readouterr().out
    assert "baseline" in out and "attack" in out and "3x" in out
    assert "127.0.2.1-4" in out and "HTTP 503 1" in out
    assert "launch (proxy)" in out and "300 MiB" in out
    assert "connections" in out and " auth " not in out  # refusals that happened only
    assert out.count("FAIL") == 3 and "PASS  peak RSS" in out
    again = msgspec.json.decode(msgspec.json.encode(result), type=AbuseBenchResult)
    assert again == result


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(["abuse", *argv])


def test_every_setting_is_a_flag_made_from_the_spec_and_checked_by_it() -> None:
    args = _parse("--idle", "5", "--max-rss", "3GiB", "--baseline-s", "1.5")
    assert (args.idle, args.max_rss, args.baseline_s) == (5, 3 * GiB, 1.5)
    assert args.attack_s == AbuseSpec().attack_s
    for bad in (["--idle", "-1"], ["--max-rss", "1k"], ["--first-address", "10.0.0.1"]):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_each_attack_has_addresses_of_its_own_after_the_first() -> None:
    assert attack_addresses("127.0.2.1", 0, 2) == ("127.0.2.1", "127.0.2.2")
    assert attack_addresses("127.0.2.1", 1, 2) == ("127.0.2.3", "127.0.2.4")
    assert attack_addresses("127.0.2.255", 0, 2) == ("127.0.2.255", "127.0.3.0")


def test_a_bomb_is_small_decodes_to_its_full_side_and_differs_each_time() -> None:
    make = bomb_png()
    first, second = make(), make()
    assert first != second and len(first) < 300_000
    width, height = struct.unpack(">II", first[16:24])
    assert (width, height) == (BOMB_SIDE, BOMB_SIDE)
    idat = first.index(b"IDAT")
    (length,) = struct.unpack(">I", first[idat - 4 : idat])
    assert len(zlib.decompress(first[idat + 4 : idat + 4 + length])) == BOMB_SIDE * (BOMB_SIDE + 1)


def _started(command: list[str], kind: type[AnyReady]) -> tuple[subprocess.Popen[str], AnyReady]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = parse_ready(proc.stdout.readline(), kind)
    assert ready is not None, f"{command} printed no ready line"
    return proc, ready


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[psutil.Process, str]]:
    """A real `ecshare proxy` with an API key, in front of instant stub backends."""
    procs: list[subprocess.Popen[str]] = []
    try:
        stubs, found = _started(
            [sys.executable, "-m", "ecshare.apps.bench.instant", "--role", "encoder",
             "--role", "prefill_decode"],
            StubsReady,
        )  # fmt: skip
        procs.append(stubs)
        keys = tmp_path / "keys"
        write_secret_file(keys, "0123456789abcdef0123 flood")
        server, ready = _started(
            [sys.executable, "-m", "ecshare", "proxy", "--encoder", found.urls["encoder"],
             "--pd", found.urls["prefill_decode"], "--port", "0", "--api-key-file", str(keys)],
            ProxyReady,
        )  # fmt: skip
        procs.append(server)
        yield psutil.Process(server.pid), ready.url
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait()


def test_an_attacker_from_127_0_0_2_reaches_the_proxy_from_that_address(
    proxy: tuple[psutil.Process, str], tmp_path: Path
) -> None:
    server, url = proxy
    port = int(url.rsplit(":", 1)[1])
    spec = AbuseSpec(
        idle=3, half_headers=0, slow_bodies=0, slow_bodies_keyed=0, bombs=0, many_parts=0,
        flood=0, addresses_per_attack=1, first_address="127.0.0.2",
    )  # fmt: skip
    plan = tmp_path / "plan.json"
    write_secret_file(
        plan, msgspec.json.encode(AttackPlan(spec=spec, url=url, flood_key="unused")).decode()
    )
    attackers = subprocess.Popen(
        [sys.executable, "-m", "ecshare.apps.bench.abuse_attacks", str(plan)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert attackers.stdout is not None
        assert attackers.stdout.readline().strip() == ATTACKING

        def peers() -> list[str]:
            held = server.net_connections(kind="tcp")
            return [c.raddr.ip for c in held if c.laddr.port == port and c.raddr]

        wait_until(lambda: peers().count("127.0.0.2") >= 3, detail=peers)
        assert "127.0.0.1" not in peers()
        attackers.send_signal(signal.SIGTERM)
        out, _ = attackers.communicate(timeout=30)
    finally:
        if attackers.poll() is None:
            attackers.kill()
            attackers.wait()
    tallies = msgspec.json.decode(out, type=list[AttackTally])
    (idle,) = [t for t in tallies if t.clients]
    assert (idle.attack, idle.addresses, idle.peak_open) == ("idle", ("127.0.0.2",), 3)


def test_the_sampler_splits_each_processs_cpu_at_the_attack() -> None:
    """This process, sampled as the launch: CPU burnt before `mark_attack` is the
    baseline's, after it the attack's, each in cores over its own span."""
    sampler = _MemorySampler(os.getpid(), (), ())

    def burn(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    sampler.sample()
    burn(0.2)
    sampler.mark_attack()
    time.sleep(0.3)  # idle: the attack's share is smaller
    sampler.sample()
    (me,) = sampler.processes()
    assert me.baseline_cores > 0.3
    assert me.attack_cores < me.baseline_cores
