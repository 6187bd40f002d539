"""benchmarks/launch_push.py's readings, against real /proc files of this process, real
Prometheus text and real phase records. (The whole benchmark starts two `vllm serve`
instances and takes minutes; it is run by hand, see its docstring.)"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ecshare.peer.thread import name_os_thread

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "launch_push.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launch_push_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _busy_thread(name: str, started: threading.Event, stop: threading.Event) -> None:
    name_os_thread(name)
    started.set()
    n = 0
    while not stop.is_set():
        n += 1


def test_a_named_threads_cpu_is_counted_under_its_name_and_kind(bench: ModuleType) -> None:
    # A name with a space and a ')' too: /proc's comm field is not delimited.
    name = "ecshare-a) b"
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_busy_thread, args=(name, started, stop))
    worker.start()
    started.wait(10)
    before = {os.getpid(): bench.read_proc(os.getpid())}
    try:
        # Run until the busy thread has used at least two clock ticks.
        while True:
            now = bench.read_proc(os.getpid())
            spent = (
                now.threads[worker.native_id][1] - before[os.getpid()].threads[worker.native_id][1]
            )
            if spent >= 2:
                break
    finally:
        stop.set()
        worker.join()
    delta = bench.cpu_delta(before, {os.getpid(): now})[str(os.getpid())]
    assert now.threads[worker.native_id][0] == name
    assert delta["threads"][name] >= 2 / bench.CLK_TCK
    assert delta["kinds"]["ecshare"] >= 2 / bench.CLK_TCK
    # The process's total holds every live thread's time (whole clock ticks each, summed in
    # floating point: 0.14 + 0.01 is 0.15000000000000002).
    assert delta["cpu_s"] >= round(sum(delta["threads"].values()), 9)


def test_a_process_total_that_lags_its_threads_is_raised_to_theirs(bench: ModuleType) -> None:
    # A kernel that updates the process's ticks later than its threads' (a sandboxed
    # kernel in CI did) must not show a busy process as idle.
    before = {7: bench.ProcCpu(7, "p", 100, {7: ("p", 40), 8: ("ecshare-x", 60)})}
    after = {7: bench.ProcCpu(7, "p", 100, {7: ("p", 41), 8: ("ecshare-x", 69)})}
    delta = bench.cpu_delta(before, after)["7"]
    assert delta["cpu_s"] == pytest.approx(10 / bench.CLK_TCK)
    assert delta["threads"]["ecshare-x"] == pytest.approx(9 / bench.CLK_TCK)
    assert delta["ended_threads_s"] == 0.0
    # A process whose total grew by more than its live threads took: the rest is what
    # threads that ended took.
    after[7] = bench.ProcCpu(7, "p", 130, {7: ("p", 41), 8: ("ecshare-x", 69)})
    delta = bench.cpu_delta(before, after)["7"]
    assert delta["cpu_s"] == pytest.approx(30 / bench.CLK_TCK)
    assert delta["ended_threads_s"] == pytest.approx(20 / bench.CLK_TCK)


def test_a_process_is_found_in_its_session(bench: ModuleType) -> None:
    assert os.getpid() in bench.session_pids(os.getsid(0))
    assert os.getpid() in bench.child_pids(os.getppid())


def test_exposed_latency_is_read_per_mode_from_prometheus_text(bench: ModuleType) -> None:
    registry = CollectorRegistry()
    exposed = Histogram(
        "vllm:ecshare_exposed_latency_seconds",
        "exposed",
        ["mode", "model_name"],
        registry=registry,
    )
    exposed.labels(mode="pushed", model_name="tiny").observe(0.0001)
    exposed.labels(mode="pushed", model_name="tiny").observe(0.0031)
    exposed.labels(mode="pulled", model_name="tiny").observe(0.004)
    samples = bench.metric_samples(generate_latest(registry).decode())
    name = bench.EXPOSED
    assert bench.summed(samples, name + "_count", mode="pushed") == 2
    assert bench.summed(samples, name + "_sum", mode="pushed") == pytest.approx(0.0032)
    assert bench.summed(samples, name + "_count", mode="pulled") == 1
    assert bench.summed(samples, name + "_count") == 3


def test_quantiles_are_nearest_rank_and_none_when_empty(bench: ModuleType) -> None:
    values = [float(v) for v in range(1, 11)]
    assert bench.quantiles(values) == {"n": 10, "p50": 5.0, "p90": 9.0, "max": 10.0}
    assert bench.quantiles([])["p90"] is None


def test_a_push_committed_after_the_ask_is_listed_late_with_its_steps(bench: ModuleType) -> None:
    def push(key: str, t0: float, committed: float, asked: float) -> list[tuple[str, str, float]]:
        return [
            (key, "push_call", t0),
            (key, "p_picked", t0 + 0.001),
            (key, "offer_sent", t0 + 0.002),
            (key, "committed", committed),
            (key, "call", asked),
        ]

    records = push("early", 10.0, 10.01, 10.15) + push("late", 20.0, 20.2, 20.15)
    steps = bench.push_steps(records)
    assert steps["items"] == 2
    assert [i["mm_hash"] for i in steps["late"]] == ["late"]
    assert steps["late"][0]["late_ms"] == pytest.approx(50.0)
    assert steps["late"][0]["slack_ms"] == pytest.approx(150.0)
    assert steps["median_steps_ms"]["wake producer thread"] == pytest.approx(1.0)
