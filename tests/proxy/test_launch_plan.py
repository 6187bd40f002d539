"""`ecshare launch`'s plan, without starting anything: roles, keys, ports, cores, options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ecshare.apps.cli import build_parser
from ecshare.apps.launch import LaunchOptions, options_from_args, plan_servers


def _options(*argv: str) -> LaunchOptions:
    return options_from_args(build_parser().parse_args(["launch", "--model", "m", *argv]))


def test_plan_has_one_key_pair_per_side_free_ports_and_cores_round_robin(tmp_path: Path) -> None:
    options = options_from_args(
        build_parser().parse_args(
            [
                "launch", "--model", "/models/m", "--encoders", "2", "--pd", "3",
                "--extra-vllm-args", "--max-model-len 2048 --dtype 'bfloat16'",
                "--ec-extra-config", '{"region_bytes": 1048576}',
            ]
        )
    )  # fmt: skip

    encoders, pd = plan_servers(options, tmp_path)

    assert [s.spec.ec_role for s in encoders] == ["ec_producer"] * 2
    assert [s.spec.ec_role for s in pd] == ["ec_consumer"] * 3
    servers = [*encoders, *pd]
    assert len({s.spec.port for s in servers}) == 5
    assert len({s.log_path for s in servers}) == 5
    cores = sorted(os.sched_getaffinity(0))
    assert [s.spec.core for s in servers] == [cores[i % len(cores)] for i in range(5)]
    for server in servers:
        command = server.spec.command()
        assert command[-4:] == ["--max-model-len", "2048", "--dtype", "bfloat16"]
        config = json.loads(command[command.index("--ec-transfer-config") + 1])
        extra = config["ec_connector_extra_config"]
        assert extra["region_bytes"] == 1048576
        assert command[command.index("--served-model-name") + 1] == "/models/m"
        key_files = [v for k, v in extra.items() if k.endswith("_file")]
        assert key_files and all(Path(f).is_file() for f in key_files)
    ports = [s.spec.extra_config.pop("listen_port") for s in encoders]
    assert len(set(ports)) == 2 and 0 not in ports
    assert encoders[0].spec.extra_config == encoders[1].spec.extra_config
    producer_public = encoders[0].spec.extra_config["authorized_keys_file"]
    assert pd[0].spec.extra_config["client_secret_key_file"] != producer_public
    # Prefill/decode fetches from the encoders it was launched with, and from no other.
    trusted = [f"tcp://127.0.0.1:{port}" for port in ports]
    assert all(s.spec.extra_config["trusted_producers"] == trusted for s in pd)


def test_encoders_advertised_host_is_what_prefill_decode_trusts(tmp_path: Path) -> None:
    extra = '{"listen_host": "0.0.0.0", "advertise_host": "10.1.2.3"}'
    encoders, pd = plan_servers(_options("--ec-extra-config", extra), tmp_path)
    port = encoders[0].spec.extra_config["listen_port"]
    assert pd[0].spec.extra_config["trusted_producers"] == [f"tcp://10.1.2.3:{port}"]


def test_unknown_encoder_endpoint_leaves_trust_to_the_producer_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, pd = plan_servers(_options("--ec-extra-config", '{"listen_port": 0}'), tmp_path)
    assert "trusted_producers" not in pd[0].spec.extra_config
    assert "trust any producer that authenticates" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [("--encoders", "0"), ("--pd", "0"), ("--ec-extra-config", "[1]"), ("--proxy-workers", "0")],
)
def test_bad_launch_options_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _options(*argv)
