"""`ecshare proxy`: every bad flag is one clear error, and the command serves for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from proxy_testing import Rig

from ecshare.apps.cli import build_parser
from ecshare.apps.proxy.config import API_KEY_ENV, ProxyConfig, config_from_args
from ecshare.apps.ready import ProxyReady, parse_ready
from ecshare.config import ConfigError, load_config


def _config(*flags: str, environ: dict[str, str] | None = None) -> ProxyConfig:
    args = build_parser().parse_args(["proxy", *flags])
    return config_from_args(args, environ or {})


def test_flags_decode_into_the_config() -> None:
    config = _config(
        "--encoder", "http://e1:8001/", "http://e2:8001",
        "--pd", "http://pd:8002",
        "--encoder", "http://e3:8001",
        "--port", "0", "--max-body-mb", "2", "--encoder-timeout", "1.5", "--encoder-batch", "4",
    )  # fmt: skip
    assert config.encoders == ("http://e1:8001", "http://e2:8001", "http://e3:8001")
    assert config.prefill_decode == ("http://pd:8002",)
    assert config.max_body_bytes == 2 << 20
    assert config.encoder_timeout_s == 1.5 and config.encoder_batch_size == 4


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        ([], "--pd"),
        (["--pd", "pd:8000"], "--pd"),
        (["--pd", "http://pd:8000/v1"], "--pd"),
        (["--pd", "http://a:1", "--encoder", "ftp://e"], "--encoder"),
        (["--pd", "http://a:1", "http://a:1"], "--pd"),
        (["--pd", "http://a:1", "--port", "70000"], "--port"),
        (["--pd", "http://a:1", "--encoder-timeout", "0"], "--encoder-timeout"),
        (["--pd", "http://a:1", "--pd-timeout", "nan"], "--pd-timeout"),
        (["--pd", "http://a:1", "--encoder-batch", "0"], "--encoder-batch"),
        (["--pd", "http://a:1", "--max-body-mb", "0"], "--max-body-mb"),
        (["--pd", "http://a:1", "--api-key-file", "/nonexistent/key"], "--api-key-file"),
        (["--pd", "http://a:1", "--workers", "0"], "--workers"),
        (["--pd", "http://a:1", "--workers", "100000"], "--workers"),
    ],
)
def test_bad_flags_are_one_clear_config_error(flags: list[str], blamed: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(*flags)
    assert str(info.value).startswith(blamed)


def test_api_key_comes_from_its_file_or_the_environment_and_never_shows(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    from_file = _config("--pd", "http://a:1", "--api-key-file", str(key_file))
    assert from_file.api_key == "from-file"
    from_env = _config("--pd", "http://a:1", environ={API_KEY_ENV: "from-env"})
    assert from_env.api_key == "from-env"
    assert _config("--pd", "http://a:1").api_key is None
    assert "from-env" not in repr(from_env) and "<hidden>" in repr(from_env)


def test_proxy_key_variable_does_not_upset_the_instance_config() -> None:
    assert load_config(env={API_KEY_ENV: "secret"}) is not None


def test_ecshare_proxy_command_serves_until_sigterm(rig: Rig) -> None:
    env = {**os.environ, API_KEY_ENV: "k"}
    cmd = [sys.executable, "-m", "ecshare", "proxy", "--pd", *rig.pd_urls, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready = parse_ready(line, ProxyReady)
        assert ready is not None, line
        assert ready.api_key is True and list(ready.prefill_decode) == rig.pd_urls
        url = ready.url
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
