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
        (["--pd", "http://a:1", "--max-body-mb", "0"], "--max-body"),
        (["--pd", "http://a:1", "--max-body", "100"], "--max-body"),
        (["--pd", "http://a:1", "--max-body", "64MB"], "--max-body"),
        (["--pd", "http://a:1", "--max-body", "1MiB", "--max-body-mb", "1"], "--max-body"),
        (["--pd", "http://a:1", "--api-key-file", "/nonexistent/key"], "--api-key-file"),
        (["--pd", "http://a:1", "--workers", "0"], "--workers"),
        (["--pd", "http://a:1", "--workers", "100000"], "--workers"),
        (["--pd", "http://a:1", "--max-uuid-chars", "0"], "--max-uuid-chars"),
        (["--pd", "http://a:1", "--limit-mm-per-prompt", '{"smell": 1}'], "--limit-mm-per-prompt"),
        (["--pd", "http://a:1", "--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt"),
        (["--pd", "http://a:1", "--max-encoder-calls", "0"], "--max-encoder-calls"),
        (["--pd", "http://a:1", "--max-encoder-in-flight", "0"], "--max-encoder-in-flight"),
        (["--pd", "http://a:1", "--max-tenant-in-flight", "0"], "--max-tenant-in-flight"),
        (["--pd", "http://a:1", "--max-connections", "0"], "--max-connections"),
        (["--pd", "http://a:1", "--body-timeout", "0"], "--body-timeout"),
    ],
)
def test_bad_flags_are_one_clear_config_error(flags: list[str], blamed: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(*flags)
    assert str(info.value).startswith(blamed)


def test_the_body_limit_takes_size_units_as_every_size_setting_does() -> None:
    assert _config("--pd", "http://a:1", "--max-body", "512KiB").max_body_bytes == 512 << 10
    assert _config("--pd", "http://a:1", "--max-body", "1.5MiB").max_body_bytes == 3 << 19
    assert _config("--pd", "http://a:1").max_body_bytes == 64 << 20


def test_api_key_comes_from_its_file_or_the_environment_and_never_shows(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    from_file = _config("--pd", "http://a:1", "--api-key-file", str(key_file))
    assert from_file.api_key == "from-file"
    from_env = _config("--pd", "http://a:1", environ={API_KEY_ENV: "from-env"})
    assert from_env.api_key == "from-env"
    assert _config("--pd", "http://a:1").api_key is None
    assert "from-env" not in repr(from_env) and "<hidden>" in repr(from_env)


def test_a_key_file_maps_keys_to_tenants_and_never_shows(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# key tenant\n\nkey-a team-a\n  key-b   team-b  \nkey-c\n")
    key_file.chmod(0o600)
    config = _config("--pd", "http://a:1", "--api-key-file", str(key_file))
    assert config.keys() == {"key-a": "team-a", "key-b": "team-b", "key-c": "default"}
    assert "key-a" not in repr(config) and "<3 hidden>" in repr(config)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("key-a team-a extra\n", "line 1"),
        ("key-a team-a\nkey-a team-b\n", "twice"),
        ("key-a bad/tenant\n", "tenant"),
    ],
)
def test_a_bad_key_file_is_one_clear_config_error(tmp_path: Path, text: str, says: str) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(text)
    key_file.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        _config("--pd", "http://a:1", "--api-key-file", str(key_file))
    assert str(info.value).startswith("--api-key-file") and says in str(info.value)


def test_edge_flags_decode_into_the_config() -> None:
    config = _config(
        "--pd", "http://a:1", "--client-uuids", "tenant", "--max-uuid-chars", "64",
        "--allow-client-embeds", "--tenant-isolation", "--route-headers",
        "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--max-encoder-calls", "3",
        "--max-encoder-in-flight", "5", "--max-tenant-in-flight", "7",
        "--max-connections", "9", "--body-timeout", "2.5",
    )  # fmt: skip
    assert (config.client_uuids, config.max_uuid_chars) == ("tenant", 64)
    assert config.allow_client_embeds and config.tenant_isolation and config.route_headers
    assert config.limit_mm_per_prompt == {"image": 2, "video": 0}
    assert (config.max_encoder_calls, config.max_encoder_in_flight) == (3, 5)
    assert (config.max_tenant_in_flight, config.max_connections) == (7, 9)
    assert config.body_timeout_s == 2.5
    defaults = _config("--pd", "http://a:1")
    assert (defaults.client_uuids, defaults.allow_client_embeds) == ("refuse", False)
    assert not defaults.tenant_isolation and not defaults.route_headers


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
