"""`ecshare proxy --workers N`: real worker processes sharing one port, in front of stubs.

Which worker answered shows in the request id it sends upstream: each process draws its
own random prefix, and the stub prefill/decode instance records every request's headers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_testing import Rig, wait_until

from ecshare.apps.ready import ProxyReady, parse_ready


@contextmanager
def _proxy(rig: Rig, *flags: str) -> Iterator[tuple[subprocess.Popen[str], ProxyReady]]:
    cmd = [sys.executable, "-m", "ecshare", "proxy", "--pd", *rig.pd_urls, "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready = parse_ready(line, ProxyReady)
        assert ready is not None, (line, proc.stderr and proc.stderr.read())
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return stat[0] != "Z"


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric `name`, scraped on a fresh connection (any worker may answer)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def _chat_answered(url: str) -> float:
    found = _samples(url, "ecshare_proxy_requests_total")
    return sum(v for labels, v in found if labels == {"endpoint": "chat", "status": "200"})


def _worker_pids(url: str) -> set[int]:
    return {int(labels["pid"]) for labels, v in _samples(url, "ecshare_proxy_worker_up") if v}


def _send(url: str, n: int) -> None:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(n):  # a new connection each time, so the kernel spreads them
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=10).status_code == 200


def test_workers_share_the_port_and_report_one_set_of_metrics(rig: Rig) -> None:
    with _proxy(rig, "--workers", "2") as (proc, ready):
        url, pids = ready.url, set(ready.pids)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        _send(url, 40)
        calls = rig.prefill_decode[0].calls
        assert len(calls) == 40
        prefixes = {c.headers["x-request-id"].rsplit("-", 1)[0] for c in calls}
        assert len(prefixes) == 2, prefixes  # both workers answered
        # Whichever worker a scrape reaches, it reports the requests of both.
        for _ in range(4):
            assert _chat_answered(url) == 40
            assert _worker_pids(url) == pids

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        wait_until(lambda: not any(_alive(p) for p in pids), timeout_s=10)


def test_a_killed_worker_is_replaced_and_its_counts_are_kept(rig: Rig) -> None:
    with _proxy(rig, "--workers", "2") as (proc, ready):
        url, pids = ready.url, set(ready.pids)
        _send(url, 10)
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            now = _worker_pids(url)
            return len(now) == 2 and victim not in now

        wait_until(replaced, timeout_s=30)
        survivors = _worker_pids(url)
        assert pids - {victim} <= survivors
        _send(url, 10)
        assert _chat_answered(url) == 20  # the dead worker's answers still count
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not any(_alive(p) for p in survivors)
        assert proc.stderr is not None
        assert f"proxy worker {victim} exited with status -9" in proc.stderr.read()


def test_workers_end_with_a_killed_supervisor(rig: Rig) -> None:
    with _proxy(rig, "--workers", "2") as (proc, ready):
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(_alive(p) for p in ready.pids), timeout_s=10)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_port_is_a_clear_error(rig: Rig, workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-m", "ecshare", "proxy", "--pd", *rig.pd_urls, "--port", port]
        done = subprocess.run(
            [*cmd, "--workers", workers], capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_values_file_another_worker_has_not_yet_sized_is_left_out(tmp_path: Path) -> None:
    """A worker reads the shared metrics directory (its registry does, as it starts;
    `/metrics` does) while another has just created its values file, still 0 bytes:
    that file holds no sample yet and is left out. prometheus_client's own collector
    fails on it, which made a worker exit at its start in a clean-clone run."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from prometheus_client.multiprocess import MultiProcessCollector

    from ecshare.apps.proxy.metrics import _SharedCollector

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    key = mmap_key("ecshare_proxy_requests", "ecshare_proxy_requests_total", [], [], "h")
    written.write_value(key, 3.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # being created by another worker

    with pytest.raises(Exception, match="unpack"):
        MultiProcessCollector(CollectorRegistry(auto_describe=True), path=str(tmp_path))
    registry = CollectorRegistry(auto_describe=True)
    _SharedCollector(registry, path=str(tmp_path))  # reads the directory to register

    assert registry.get_sample_value("ecshare_proxy_requests_total") == 3.0
