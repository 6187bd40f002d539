"""`ecshare proxy --workers N`: real worker processes sharing one port, in front of stubs.

Which worker answered shows in the request id it sends upstream: each process draws its
own random prefix, and the stub prefill/decode instance records every request's headers.
The workers share the registered members and their encodes in flight through their
supervisor (`ecshare.apps.proxy.shared`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_stubs import PREFILL_DECODE, StubBackend, serve_stubs
from proxy_testing import Rig, chat
from test_directory_feed import Child
from waiting import wait_until

from ecshare.apps.ready import ProxyReady, parse_ready
from ecshare.control import generate_keypair, load_keypair


@contextmanager
def _proxy(
    rig: Rig, *flags: str, pd: list[str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], ProxyReady]]:
    pd_urls = rig.pd_urls if pd is None else pd
    cmd = [sys.executable, "-m", "ecshare", "proxy", "--pd", *pd_urls, "--port", "0", *flags]
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
    """The samples of metric `name`, scraped on a fresh connection (any worker may answer),
    with the admin key that some of these proxies are given (one without keys ignores it)."""
    text = httpx.get(url + "/metrics", headers=AS_ADMIN, timeout=10).text
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


def _workers_of(stub: StubBackend, since: int = 0) -> set[str]:
    """The workers (by request-id prefix) whose requests reached `stub`."""
    return {c.headers["x-request-id"].rsplit("-", 1)[0] for c in stub.calls[since:]}


def _post_into(url: str, body: dict[str, Any], statuses: list[int]) -> None:
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    statuses.append(answer.status_code)


ADMIN_KEY = "an-admin-key-of-some-length"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _members(url: str, method: str, role: str, member: str) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"role": role, "url": member}
    answer = httpx.request(method, url + "/v1/members", json=body, headers=auth, timeout=10)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def _extra_pd(rig: Rig) -> tuple[StubBackend, str]:
    extra = StubBackend(PREFILL_DECODE)
    started = rig.loop.run(serve_stubs([extra]))
    rig._runners.extend(runner for runner, _ in started)
    return extra, started[0][1]


def test_a_member_registered_through_one_worker_serves_through_every_worker(
    rig: Rig, tmp_path: Path
) -> None:
    admin = tmp_path / "admin"
    admin.write_text(ADMIN_KEY)
    admin.chmod(0o600)
    extra, extra_url = _extra_pd(rig)
    with _proxy(rig, "--workers", "2", "--admin-key-file", str(admin)) as (proc, ready):
        url, pids = ready.url, set(ready.pids)
        assert _members(url, "POST", PREFILL_DECODE, extra_url) == {"joined": True}
        # Requests on fresh connections reach both workers, and both send some to it.
        wait_until(lambda: (_send(url, 4), len(_workers_of(extra)) == 2)[1], timeout_s=30)

        # A worker that restarts gets the registered member before it serves.
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: victim not in _worker_pids(url) and len(_worker_pids(url)) == 2, timeout_s=30
        )
        before = _workers_of(extra)
        wait_until(lambda: (_send(url, 4), bool(_workers_of(extra) - before))[1], timeout_s=30)

        # Unregistered through any worker: no worker sends it anything more.
        assert _members(url, "DELETE", PREFILL_DECODE, extra_url) == {"left": True}
        seen = len(extra.calls)
        _send(url, 20)
        assert len(extra.calls) == seen
        assert len(_workers_of(rig.prefill_decode[0], len(rig.prefill_decode[0].calls) - 20)) == 2
        listed = httpx.get(
            url + "/v1/members", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        )
        assert extra_url not in {m["url"] for m in listed.json()["members"]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_every_worker_subscribes_to_a_registered_members_feed_and_hears_its_items(
    rig: Rig, tmp_path: Path
) -> None:
    admin = tmp_path / "admin"
    admin.write_text(ADMIN_KEY)
    admin.chmod(0o600)
    instance = generate_keypair(tmp_path, "instance")
    proxy_key = generate_keypair(tmp_path, "proxy")
    feed = Child(
        {
            "port": 0,
            "secret_key_file": str(instance.secret_path),
            "subscribers": [load_keypair(proxy_key.secret_path).public_text],
        }
    )
    flags = ["--workers", "2", "--admin-key-file", str(admin), "--events-port", str(feed.port)]
    flags += ["--events-key", str(proxy_key.secret_path)]
    flags += ["--events-encoder-key", str(instance.public_path)]
    member = "http://127.0.0.1:9"  # its HTTP port is shut: a member, ejected, feed watched
    # The static prefill/decode instance's feed would be the same one on the same host.
    elsewhere = "http://127.0.0.2:9"
    try:
        with _proxy(rig, *flags, pd=[elsewhere]) as (proc, ready):
            url = ready.url
            assert _members(url, "POST", "encoder", member) == {"joined": True}
            feed("put a")
            heard: set[int] = set()

            def every_worker_holds_it() -> bool:
                listed = httpx.get(
                    url + "/v1/members",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    timeout=10,
                ).json()
                if listed["stats"]["directory_entries"] == 1:
                    heard.add(listed["worker"])
                return heard == set(ready.pids)

            wait_until(every_worker_holds_it, timeout_s=60)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
    finally:
        feed.kill()


def test_concurrent_requests_with_one_new_image_through_two_workers_make_one_encode(
    rig: Rig,
) -> None:
    for encoder in rig.encoders:
        encoder.behaviour.delay_s = 1.0  # every request arrives while the first encodes
    encoders = [arg for u in rig.encoder_urls for arg in ("--encoder", u)]
    pd = rig.prefill_decode[0]
    both = False
    with _proxy(rig, "--workers", "2", *encoders) as (proc, _ready):
        url = _ready.url
        for round_ in range(5):  # until both workers took part (the kernel spreads them)
            image = {
                "type": "image_url",
                "image_url": {"url": f"data:image/png;base64,{round_:04d}"},
            }
            calls_before = sum(len(e.calls) for e in rig.encoders)
            pd_before = len(pd.calls)
            answers: list[int] = []

            threads = [
                threading.Thread(target=_post_into, args=(url, chat(image, text=f"q{i}"), answers))
                for i in range(6)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert answers == [200] * 6
            assert sum(len(e.calls) for e in rig.encoders) == calls_before + 1
            sent = pd.bodies()[pd_before:]
            assert all(len(body["ec_transfer_params"]) == 1 for body in sent)
            if len(_workers_of(pd, pd_before)) == 2:
                both = True
                break
        assert both, "the kernel never spread six connections over both workers"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_every_worker_salts_a_tenant_alike_under_the_one_secret_its_supervisor_made(
    rig: Rig,
) -> None:
    # No --tenant-secret-file: the supervisor makes the secret, and every worker, a
    # replaced one too, keys the tenant's salt under it (else a tenant would miss its own
    # entries whenever another worker took its request).
    encoders = [arg for u in rig.encoder_urls for arg in ("--encoder", u)]
    flags = ["--workers", "2", "--tenant-isolation", "--pd-media", "keep", *encoders]
    pd = rig.prefill_decode[0]
    sent = iter(range(1_000_000))

    def send_images(n: int) -> None:
        for i in (next(sent) for _ in range(n)):  # a new image each time: each is encoded
            image = {"type": "image_url", "image_url": {"url": f"https://example.com/{i}.jpg"}}
            answer = httpx.post(url + "/v1/chat/completions", json=chat(image), timeout=10)
            assert answer.status_code == 200, answer.text

    with _proxy(rig, *flags) as (proc, ready):
        url = ready.url
        wait_until(lambda: (send_images(4), len(_workers_of(pd)) == 2)[1], timeout_s=30)
        first = _workers_of(pd)
        os.kill(min(ready.pids), signal.SIGKILL)
        wait_until(lambda: (send_images(4), bool(_workers_of(pd) - first))[1], timeout_s=30)
        salts = {body["media_io_kwargs"]["image"]["ecshare_tenant"] for body in pd.bodies()}
        encoded = {
            body["media_io_kwargs"]["image"]["ecshare_tenant"]
            for encoder in rig.encoders
            for body in encoder.bodies()
        }
        assert len(_workers_of(pd)) >= 3 and len(salts) == 1 and encoded == salts
        unkeyed = hashlib.sha256(b"ecshare-tenant-salt\x00default").hexdigest()[:32]
        assert salts != {unkeyed}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


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
