"""One config surface: the connector's allow-lists are `Config` keys, sizes take units from
every source, and errors name a flag as it was typed."""

from __future__ import annotations

import argparse

import pytest

from ecshare.config import Config, ConfigError, add_config_arguments, load_config
from ecshare.config.fields import parse_size
from ecshare.vllm.settings import ConnectorSettings, config_of

ENDPOINTS = ("tcp://10.0.0.11:5701", "tcp://enc-1.example:5702")


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="test")
    add_config_arguments(parser)
    return parser.parse_args(list(argv))


def test_connector_allow_lists_are_config_keys_from_every_source() -> None:
    from_dict = Config.from_dict({"trusted_producers": list(ENDPOINTS), "push_targets": ["pd0"]})
    from_env = load_config(
        env={
            "ECSHARE_TRUSTED_PRODUCERS": ",".join(ENDPOINTS),
            "ECSHARE_PUSH_TARGETS": "pd0",
        }
    )
    from_cli = load_config(
        env={}, cli=_cli("--trusted-producers", ",".join(ENDPOINTS), "--push-targets", "pd0")
    )
    assert from_dict == from_env == from_cli
    settings = ConnectorSettings.of(from_dict)
    assert settings.trusts(ENDPOINTS[1]) and not settings.trusts("tcp://10.9.9.9:5701")
    assert settings.may_push_to("pd0") and not settings.may_push_to("pd1")
    assert ConnectorSettings.of(Config()).trusts("tcp://anywhere:1")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"trusted_producers": ["10.0.0.11:5701"]}, "trusted_producers[0]: got '10.0.0.11:5701'"),
        ({"trusted_producers": "tcp://a:1"}, "trusted_producers: got 'tcp://a:1' (str)"),
        ({"push_targets": ["../x"]}, "push_targets[0]: got '../x', expected 1-64 of"),
        ({"push_target": ["pd0"]}, "push_target: unknown key; did you mean `push_targets`?"),
    ],
)
def test_bad_allow_list_is_one_clear_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("65536", 65536),
        ("64KiB", 64 << 10),
        ("64 KiB", 64 << 10),
        ("512MiB", 512 << 20),
        ("512m", 512 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("2TiB", 2 << 40),
    ],
)
def test_size_units_are_binary(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_every_size_key_takes_units_from_dict_env_and_flags() -> None:
    sizes = {
        "region_bytes": ("6GiB", 6 << 30),
        "block_bytes": ("1MiB", 1 << 20),
        "max_frame_bytes": ("4MiB", 4 << 20),
        "max_pinned_bytes_per_session": ("512MiB", 512 << 20),
    }
    want = Config(**{k: v for k, (_, v) in sizes.items()})
    assert Config.from_dict({k: t for k, (t, _) in sizes.items()}) == want
    env = {f"ECSHARE_{k.upper()}": t for k, (t, _) in sizes.items()}
    assert load_config(env=env) == want
    argv = [a for k, (t, _) in sizes.items() for a in ("--" + k.replace("_", "-"), t)]
    assert load_config(env={}, cli=_cli(*argv)) == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1GB", "units are binary"),
        ("1 gigabyte", "expected a size such as"),
        ("0.5B", "not a whole number of bytes"),
        ("-1MiB", "expected a size such as"),
    ],
)
def test_an_unclear_size_is_refused_with_the_units(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        Config.from_dict({"region_bytes": text})
    assert str(info.value).startswith("region_bytes: ")
    with pytest.raises(ConfigError, match=r"^region_bytes \(from ECSHARE_REGION_BYTES\)"):
        load_config(env={"ECSHARE_REGION_BYTES": text})


def test_a_size_out_of_range_is_shown_as_written() -> None:
    with pytest.raises(
        ConfigError, match=r"^region_bytes: got '512KiB', expected a size between 1MiB"
    ):
        Config.from_dict({"region_bytes": "512KiB"})


def test_errors_name_flags_as_the_user_typed_them() -> None:
    cli = _cli("--grant-lease-s", "10", "--fetch-deadline-max-s", "15")
    with pytest.raises(ConfigError) as info:
        load_config(env={}, cli=cli)
    text = str(info.value)
    assert text.startswith("--fetch-deadline-max-s: got 15.0, expected less than --grant-lease-s")
    assert "_s" not in text.split(":", 1)[1].split(":")[0]  # no Python spelling in the rule
    with pytest.raises(ConfigError, match=r"^--trusted-producers\[0\]: got 'x:1'"):
        load_config(env={}, cli=argparse.Namespace(trusted_producers=("x:1",)))


def test_vllm_ec_transfer_config_is_read_whole() -> None:
    from vllm.config import ECTransferConfig

    real = ECTransferConfig(
        ec_connector="ECShareConnector",
        ec_role="ec_consumer",
        ec_connector_extra_config={"trusted_producers": [ENDPOINTS[0]], "region_bytes": "2GiB"},
    )
    config = config_of(real)
    assert config.trusted_producers == (ENDPOINTS[0],)
    assert config.region_bytes == 2 << 30


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [("ec_ip", "10.0.0.11", "listen_host"), ("ec_port", 5701, "listen_port")],
)
def test_vllm_ec_ip_and_ec_port_are_refused_with_the_ecshare_key(
    field: str, value: object, key: str
) -> None:
    from vllm.config import ECTransferConfig

    real = ECTransferConfig(
        ec_connector="ECShareConnector", ec_role="ec_producer", **{field: value}
    )
    with pytest.raises(ValueError, match=rf"sets {field}=.*set {key}"):
        config_of(real)
    bad = {"push_targets": "pd0"}
    with pytest.raises(ValueError, match=r"bad ec_connector_extra_config: push_targets"):
        config_of(ECTransferConfig(ec_role="ec_producer", ec_connector_extra_config=bad))
