"""`ecshare launch`'s plan, without starting anything: roles, keys, ports, cores, options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ecshare.cli import build_parser
from ecshare.launch import LaunchOptions, options_from_args, plan_servers


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
    assert encoders[0].spec.extra_config == encoders[1].spec.extra_config
    producer_public = encoders[0].spec.extra_config["authorized_keys_file"]
    assert pd[0].spec.extra_config["client_secret_key_file"] != producer_public


@pytest.mark.parametrize(
    "argv",
    [("--encoders", "0"), ("--pd", "0"), ("--ec-extra-config", "[1]"), ("--proxy-workers", "0")],
)
def test_bad_launch_options_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _options(*argv)
