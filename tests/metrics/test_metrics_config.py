"""The metrics port is validated like every other key, and a port that cannot be served
stops start-up with a message naming it, in this process and through the CLI."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from metrics_testing import free_port
from peer_testing import FAST, Keyring, MakeConsumer, child_env, flags

from ecshare.config import Config, ConfigError, load_config


@pytest.mark.parametrize("bad", [0, -1, 65536, "9100", 9100.5, True])
def test_bad_metrics_port_is_a_clear_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="metrics_port") as error:
        Config.from_dict({"metrics_port": bad})
    assert error.value.key == "metrics_port"


@pytest.mark.parametrize("bad", ["abc", "0", "70000"])
def test_bad_metrics_port_from_environment_names_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match="ECSHARE_METRICS_PORT") as error:
        load_config(env={"ECSHARE_METRICS_PORT": bad})
    assert error.value.key == "metrics_port"


def test_metrics_port_cannot_be_the_control_port() -> None:
    with pytest.raises(ConfigError, match=r"metrics_port.*listen_port"):
        Config.from_dict({"metrics_port": 9100, "listen_port": 9100})


def test_unset_metrics_port_serves_nothing() -> None:
    assert Config.from_dict({}).metrics_port is None
    assert load_config(env={"ECSHARE_METRICS_PORT": "none"}).metrics_port is None


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket holds for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_metrics_port_stops_consumer_start_with_clear_error(
    make_consumer: MakeConsumer, keyring: Keyring, busy_port: int
) -> None:
    with pytest.raises(ConfigError, match=rf"metrics_port: cannot serve metrics on .*:{busy_port}"):
        make_consumer(keyring.consumer_config(), {"metrics_port": busy_port})
    # Nothing was left half-started: the same port, once free, serves a new consumer.
    port = free_port()
    _, consumer = make_consumer(keyring.consumer_config(), {"metrics_port": port})
    assert consumer.metrics_url == f"http://127.0.0.1:{port}/metrics"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


def test_serve_rejects_out_of_range_metrics_port(keyring: Keyring) -> None:
    config = flags(keyring.producer_config())
    out = _run(["serve", "--synthetic", "64KiB:1", *config, "--metrics-port", "70000"])
    assert out.returncode == 2, out.stderr
    assert "argument --metrics-port: got 70000, expected an integer between 1 and 65535" in (
        out.stderr
    )


def test_serve_and_fetch_pass_a_busy_metrics_port_through_to_a_clear_error(
    keyring: Keyring, busy_port: int
) -> None:
    served = flags({**FAST, **keyring.producer_config(), "metrics_port": busy_port})
    serve = _run(["serve", "--synthetic", "64KiB:1", *served])
    assert serve.returncode == 2, serve.stderr
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in serve.stderr
    fetched = flags({**FAST, **keyring.consumer_config(), "metrics_port": busy_port})
    fetch = _run(["fetch", "tcp://127.0.0.1:9", "h", *fetched])
    assert fetch.returncode == 2, fetch.stderr
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in fetch.stderr
