"""The config promises: every bad value is one clear ConfigError, and every source agrees."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils import z85

from ecshare.config import (
    Config,
    ConfigError,
    add_config_arguments,
    config_from_args,
    describe_fields,
    load_config,
    main,
    render_reference_markdown,
)
from ecshare.config.reference import render_config_doc

GiB = 1 << 30
REPO = Path(__file__).parents[2]
FIELD_NAMES = [doc.name for doc in describe_fields()]
KEY_A = z85.encode(bytes(range(32))).decode()
KEY_B = z85.encode(bytes(range(100, 132))).decode()
BLOCK_ALLOWED = (
    "a power of two between 4KiB and 16MiB (bytes, or with a binary unit such as 64KiB or 1GiB)"
)


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    return str(info.value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test")
    add_config_arguments(p)
    return p


# --- defaults ---------------------------------------------------------------------------------


def test_defaults_form_a_valid_config() -> None:
    config = Config()
    assert config.fetch_deadline_max_s < config.grant_lease_s
    assert config.insecure is False
    assert config.nixl_progress_thread is True
    assert config.advertised_host == config.listen_host
    assert Config.from_dict({}) == config


# --- dict -------------------------------------------------------------------------------------


def test_unknown_key_rejected_with_did_you_mean() -> None:
    assert (
        error_of({"grant_lease_sec": 30})
        == "grant_lease_sec: unknown key; did you mean `grant_lease_s`?"
    )


def test_unknown_key_without_close_match_points_to_the_reference() -> None:
    assert "unknown key" in error_of({"zzzzzz": 1})
    assert "docs/CONFIG.md lists every key" in error_of({"zzzzzz": 1})


def test_non_string_key_rejected() -> None:
    assert "got key 7 (int), expected str" in error_of({7: 1})  # type: ignore[dict-item]


def test_non_mapping_rejected() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        Config.from_dict([("grant_lease_s", 3)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_batch_items": "abc"}, "max_batch_items: got 'abc' (str), expected int"),
        ({"max_retries": True}, "max_retries: got True (bool), expected int"),
        ({"grant_lease_s": "30"}, "grant_lease_s: got '30' (str), expected float"),
        ({"prefault": 1}, "prefault: got 1 (int), expected bool"),
        ({"nixl_backends": "UCX"}, "nixl_backends: got 'UCX' (str), expected list[str]"),
        ({"metrics_port": "x"}, "metrics_port: got 'x' (str), expected int | None"),
        ({"listen_host": None}, "listen_host: got None (NoneType), expected str"),
        ({"checksum": "md5"}, 'checksum: got \'md5\' (str), expected one of "none", "xxh3_64"'),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(data: dict[str, Any], message: str) -> None:
    assert error_of(data) == message


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"grant_lease_s": -1},
            "grant_lease_s: got -1, expected a number more than 0 and at most 3600",
        ),
        ({"listen_port": 70000}, "listen_port: got 70000, expected an integer between 0 and 65535"),
        ({"max_retries": -1}, "max_retries: got -1, expected an integer between 0 and 100"),
        (
            {"region_bytes": 4096},
            "region_bytes: got 4096, expected a size between 1MiB and 1TiB",
        ),
        ({"nixl_backends": []}, "nixl_backends: got [], expected 1 to 16 items"),
        ({"listen_host": ""}, "listen_host: got '', expected non-empty string"),
    ],
)
def test_out_of_range_value_names_the_bounds(data: dict[str, Any], message: str) -> None:
    assert error_of(data).startswith(message)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_rejected(value: float) -> None:
    assert error_of({"grant_lease_s": value}).startswith(
        f"grant_lease_s: got {value!r}, expected a number"
    )


@pytest.mark.parametrize("value", [1000, 12288, 4095, 1 << 25])
def test_block_bytes_must_be_a_power_of_two_in_range(value: int) -> None:
    assert error_of({"block_bytes": value}) == (
        f"block_bytes: got {value}, expected {BLOCK_ALLOWED}"
    )


@pytest.mark.parametrize("value", [4096, 65536, 1 << 24])
def test_power_of_two_block_bytes_accepted(value: int) -> None:
    assert Config.from_dict({"block_bytes": value}).block_bytes == value


def test_region_holds_whole_blocks() -> None:
    message = error_of({"region_bytes": 3 << 20, "block_bytes": 1 << 21})
    assert message.startswith("region_bytes: got 3145728, expected a multiple of block_bytes")


def test_integral_float_accepted_for_int_field() -> None:
    config = Config.from_dict({"region_bytes": 2.0 * GiB})
    assert config.region_bytes == 2 * GiB
    assert isinstance(config.region_bytes, int)
    assert "got 4096.5 (float), expected int" in error_of({"block_bytes": 4096.5})


@pytest.mark.parametrize("deadline", [30.0, 31.0])
def test_fetch_deadline_at_or_above_lease_rejected_with_invariant_explained(
    deadline: float,
) -> None:
    message = error_of({"grant_lease_s": 30, "fetch_deadline_max_s": deadline})
    assert message.startswith(
        f"fetch_deadline_max_s: got {deadline!r}, expected less than grant_lease_s"
    )
    assert "the consumer's deadline must be shorter than the producer's lease" in message


def test_fetch_deadline_base_above_cap_rejected() -> None:
    message = error_of({"fetch_deadline_base_s": 6, "fetch_deadline_max_s": 5})
    assert message.startswith(
        "fetch_deadline_base_s: got 6.0, expected at most fetch_deadline_max_s"
    )


def test_heartbeat_timeout_must_exceed_interval() -> None:
    message = error_of({"heartbeat_interval_s": 2, "heartbeat_timeout_s": 2})
    assert message.startswith("heartbeat_timeout_s: got 2.0, expected more than heartbeat_interval")


def test_retry_max_backoff_not_below_initial() -> None:
    message = error_of({"retry_initial_backoff_s": 2, "retry_max_backoff_s": 1})
    assert message.startswith("retry_max_backoff_s: got 1.0, expected at least")


def test_metrics_port_differs_from_listen_port() -> None:
    assert "a port other than listen_port" in error_of({"listen_port": 9000, "metrics_port": 9000})


def test_wildcard_listen_host_needs_advertise_host() -> None:
    message = error_of({"listen_host": "0.0.0.0"})
    assert message.startswith("advertise_host: got None, expected an address")
    assert "peers cannot connect to a wildcard address" in message
    config = Config.from_dict({"listen_host": "0.0.0.0", "advertise_host": "10.0.0.5"})
    assert config.advertised_host == "10.0.0.5"


@pytest.mark.parametrize(
    "key",
    [
        "short",
        KEY_A[:-1],
        KEY_A + "0",
        KEY_A[:-1] + " ",  # space is outside the Z85 alphabet
        KEY_A[:-1] + "\n",
        "#" * 40,  # every character valid, but "#####" is above 2**32
    ],
)
def test_bad_z85_key_rejected(key: str) -> None:
    assert error_of({"server_public_key": key}) == (
        f"server_public_key: got {key!r}, expected 40-character Z85 string"
    )
    assert error_of({"authorized_keys": [KEY_A, key]}).startswith(
        f"authorized_keys[1]: got {key!r}, expected 40-character Z85 string"
    )


def test_z85_keys_from_zmq_accepted() -> None:
    config = Config.from_dict({"server_public_key": KEY_A, "authorized_keys": [KEY_A, KEY_B]})
    assert config.server_public_key == KEY_A
    assert config.authorized_keys == (KEY_A, KEY_B)


def test_instance_name_checked() -> None:
    assert Config.from_dict({"instance_name": "enc-0.a_b"}).instance_name == "enc-0.a_b"
    assert error_of({"instance_name": "-bad"}).startswith("instance_name: got '-bad', expected")
    assert error_of({"instance_name": "a" * 65}).startswith("instance_name: got")


def test_direct_construction_runs_the_same_checks() -> None:
    with pytest.raises(ConfigError, match="block_bytes: got 1000"):
        Config(block_bytes=1000)
    with pytest.raises(ConfigError, match="grant_lease_s: got 'x' \\(str\\), expected float"):
        Config(grant_lease_s="x")  # type: ignore[arg-type]
    config = Config(grant_lease_s=40, nixl_backends=["UCX", "GDS"])  # type: ignore[arg-type]
    assert isinstance(config.grant_lease_s, float)
    assert config.nixl_backends == ("UCX", "GDS")
    hash(config)


def test_msgspec_decoding_runs_the_same_checks() -> None:
    good = msgspec.json.decode(b'{"grant_lease_s": 40, "nixl_backends": ["UCX"]}', type=Config)
    assert good == Config(grant_lease_s=40.0)
    with pytest.raises(msgspec.ValidationError, match="the consumer's deadline"):
        msgspec.json.decode(b'{"fetch_deadline_max_s": 100}', type=Config)


def test_to_dict_is_json_and_round_trips() -> None:
    config = Config.from_dict({"authorized_keys": [KEY_A], "grant_lease_s": 45, "ucx_tls": "rc"})
    data = config.to_dict()
    assert set(data) == set(FIELD_NAMES)
    assert data["authorized_keys"] == [KEY_A]
    assert Config.from_dict(json.loads(json.dumps(data))) == config


def test_merged_applies_overrides_and_checks_again() -> None:
    config = Config().merged({"grant_lease_s": 60, "fetch_deadline_max_s": 50})
    assert (config.grant_lease_s, config.fetch_deadline_max_s) == (60.0, 50.0)
    with pytest.raises(ConfigError, match="did you mean `grant_lease_s`"):
        config.merged({"grant_lease_sec": 1})
    with pytest.raises(ConfigError, match="the consumer's deadline"):
        config.merged({"grant_lease_s": 40})


def test_config_error_is_a_value_error_that_pickles() -> None:
    error = ConfigError("grant_lease_s", "got -1", source="ECSHARE_GRANT_LEASE_S")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) == "grant_lease_s (from ECSHARE_GRANT_LEASE_S): got -1"
    assert (copy.key, copy.detail, copy.source) == (
        "grant_lease_s",
        "got -1",
        "ECSHARE_GRANT_LEASE_S",
    )


# --- deadline ---------------------------------------------------------------------------------


def test_fetch_deadline_scales_with_size_and_is_capped() -> None:
    config = Config(
        fetch_deadline_base_s=2.0, fetch_deadline_per_gib_s=10.0, fetch_deadline_max_s=20.0
    )
    assert config.fetch_deadline_s(0) == 2.0
    assert config.fetch_deadline_s(GiB // 2) == pytest.approx(7.0)
    assert config.fetch_deadline_s(GiB) == pytest.approx(12.0)
    assert config.fetch_deadline_s(100 * GiB) == 20.0
    sizes = [0, 1 << 20, 50 << 20, GiB, 2 * GiB, 10 * GiB]
    deadlines = [config.fetch_deadline_s(n) for n in sizes]
    assert deadlines == sorted(deadlines)
    assert all(d < config.grant_lease_s for d in deadlines)


def test_fetch_deadline_rejects_negative_size() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        Config().fetch_deadline_s(-1)


# --- environment ------------------------------------------------------------------------------


def test_env_parses_ints_floats_bools_lists_and_none() -> None:
    config = Config.from_env(
        {
            "ECSHARE_REGION_BYTES": "2147483648",
            "ECSHARE_GRANT_LEASE_S": "40.5",
            "ECSHARE_PREFAULT": "no",
            "ECSHARE_INSECURE": "TRUE",
            "ECSHARE_NIXL_BACKENDS": "UCX, GDS,",
            "ECSHARE_AUTHORIZED_KEYS": f"{KEY_A},{KEY_B}",
            "ECSHARE_UCX_TLS": "none",
            "ECSHARE_METRICS_PORT": "",
            "ECSHARE_CHECKSUM": "xxh3_64",
            "PATH": "/usr/bin",
            "OTHER_GRANT_LEASE_S": "x",
        }
    )
    assert config.region_bytes == 2 * GiB
    assert config.grant_lease_s == 40.5
    assert config.prefault is False
    assert config.insecure is True
    assert config.nixl_backends == ("UCX", "GDS")
    assert config.authorized_keys == (KEY_A, KEY_B)
    assert config.ucx_tls is None
    assert config.metrics_port is None
    assert config.checksum == "xxh3_64"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("0", False), ("true", True), ("False", False), ("yes", True), ("off", False)],
)
def test_env_bool_words(text: str, value: bool) -> None:
    assert Config.from_env({"ECSHARE_NIXL_PROGRESS_THREAD": text}).nixl_progress_thread is value


def test_env_bad_value_names_variable_and_expected_type() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"ECSHARE_GRANT_LEASE_S": "soon"})
    assert (
        str(info.value) == "grant_lease_s (from ECSHARE_GRANT_LEASE_S): got 'soon', expected float"
    )
    with pytest.raises(ConfigError, match=r"prefault \(from ECSHARE_PREFAULT\): got 'maybe'"):
        Config.from_env({"ECSHARE_PREFAULT": "maybe"})
    with pytest.raises(ConfigError, match=r"block_bytes \(from ECSHARE_BLOCK_BYTES\): got 1000"):
        Config.from_env({"ECSHARE_BLOCK_BYTES": "1000"})


def test_env_rule_error_says_where_the_other_key_came_from() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"ECSHARE_GRANT_LEASE_S": "10"})
    assert str(info.value).startswith(
        "fetch_deadline_max_s: got 20.0, expected less than grant_lease_s"
    )
    assert "grant_lease_s was set by ECSHARE_GRANT_LEASE_S" in str(info.value)


def test_unknown_ecshare_env_var_rejected_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"ECSHARE_GRANT_LEASE_SEC": "30"})
    assert str(info.value) == (
        "ECSHARE_GRANT_LEASE_SEC: unknown environment variable; "
        "did you mean `ECSHARE_GRANT_LEASE_S`?"
    )


def test_env_prefix_is_configurable_and_defaults_to_os_environ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Config.from_env({"MYAPP_GRANT_LEASE_S": "40"}, prefix="MYAPP_").grant_lease_s == 40.0
    for name in list(os.environ):
        if name.startswith("ECSHARE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ECSHARE_MAX_RETRIES", "7")
    assert Config.from_env().max_retries == 7
    assert load_config().max_retries == 7


# --- command line -----------------------------------------------------------------------------


def as_argv(config: Config) -> list[str]:
    argv = []
    for name, value in config.to_dict().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv.append(f"{flag}={','.join(value)}")
        else:
            argv.append(f"{flag}={'none' if value is None else value}")
    return argv


@pytest.mark.parametrize(
    "config",
    [
        Config(),
        Config(
            region_bytes=4 * GiB,
            block_bytes=1 << 20,
            prefault=False,
            listen_host="0.0.0.0",
            listen_port=5555,
            advertise_host="node-1",
            insecure=True,
            server_secret_key_file="/etc/ecshare/server.key_secret",
            server_public_key=KEY_A,
            authorized_keys=(KEY_A, KEY_B),
            grant_lease_s=60.0,
            fetch_deadline_max_s=45.5,
            retry_initial_backoff_s=0.001,
            checksum="xxh3_64",
            nixl_backends=("UCX", "GDS"),
            nixl_progress_thread=True,
            ucx_tls="rc,sm,self",
            instance_name="enc-0",
            metrics_port=9100,
        ),
    ],
)
def test_cli_flags_round_trip_every_field(config: Config) -> None:
    namespace = parser().parse_args(as_argv(config))
    values = config_from_args(namespace)
    assert set(values) == set(FIELD_NAMES)
    assert Config.from_dict(values) == config


def test_cli_reports_only_flags_the_user_gave() -> None:
    p = parser()
    p.add_argument("--verbose", action="store_true")
    namespace = p.parse_args(["--grant-lease-s", "40", "--no-prefault", "--verbose"])
    assert config_from_args(namespace) == {"grant_lease_s": 40.0, "prefault": False}
    assert config_from_args(p.parse_args([])) == {}


def test_cli_rejects_bad_value_with_the_same_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--block-bytes", "1000"])
    err = capsys.readouterr().err
    assert f"--block-bytes: got 1000, expected {BLOCK_ALLOWED}" in err


def test_cli_help_shows_description_default_and_env_var() -> None:
    text = parser().format_help()
    assert "--grant-lease-s SECONDS" in text
    assert "ECSHARE_GRANT_LEASE_S" in text
    assert "--no-prefault" in text


def test_precedence_is_defaults_then_env_then_dict_then_cli() -> None:
    env = {"ECSHARE_GRANT_LEASE_S": "40", "ECSHARE_MAX_RETRIES": "1", "ECSHARE_QUARANTINE_S": "3"}
    extra = {"grant_lease_s": 50, "max_retries": 2}
    cli = parser().parse_args(["--grant-lease-s", "60"])
    config = load_config(env=env, extra=extra, cli=cli)
    assert config.grant_lease_s == 60.0  # the command line beats all
    assert config.max_retries == 2  # the dict beats the environment
    assert config.quarantine_s == 3.0  # the environment beats the default
    assert config.heartbeat_interval_s == Config().heartbeat_interval_s
    assert load_config(env={}) == Config()


def test_load_config_errors_name_where_the_value_came_from() -> None:
    with pytest.raises(ConfigError, match=r"^--block-bytes: got 1000"):
        load_config(env={}, cli=argparse.Namespace(block_bytes=1000))
    with pytest.raises(ConfigError, match=r"block_bytes \(from extra config\)"):
        load_config(env={}, extra={"block_bytes": 1000})
    with pytest.raises(ConfigError, match="did you mean `grant_lease_s`"):
        load_config(env={}, extra={"grant_lease_sec": 1})


# --- reference --------------------------------------------------------------------------------


def test_describe_fields_covers_every_field_with_a_description() -> None:
    docs = describe_fields()
    assert [d.name for d in docs] == list(Config.__struct_fields__)
    assert all(d.description and d.type and d.allowed for d in docs)
    block = next(d for d in docs if d.name == "block_bytes")
    assert block.default == 65536
    assert block.allowed == BLOCK_ALLOWED


def test_reference_lists_every_key_env_var_and_flag() -> None:
    text = render_reference_markdown()
    for doc in describe_fields():
        assert f"| `{doc.name}` | `{doc.env_var}` | `{doc.flag}`" in text
    assert "the consumer's deadline must be shorter than the producer's lease" in text


def test_config_doc_is_current() -> None:
    doc = REPO / "docs" / "CONFIG.md"
    assert doc.read_text(encoding="utf-8") == render_config_doc(), (
        "docs/CONFIG.md is stale: run `make config-doc` "
        "(python -m ecshare.config --write-doc docs/CONFIG.md)"
    )
    assert main(["--check-doc", str(doc)]) == 0


def test_write_doc_writes_the_whole_reference_page(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "CONFIG.md"
    assert main(["--check-doc", str(doc)]) == 1
    assert main(["--write-doc", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# ecshare configuration reference\n")
    for field in describe_fields():
        assert f"| `{field.name}` | `{field.env_var}` |" in text
    assert main(["--check-doc", str(doc)]) == 0
    doc.write_text(text.replace("region_bytes", "region_size"), encoding="utf-8")
    assert main(["--check-doc", str(doc)]) == 1


# --- junk never escapes as anything but ConfigError -------------------------------------------

USEFUL = st.sampled_from(
    [
        *(0, 1, 5, 4096, 65536, 1 << 20, 1 << 30, 0.5, 30.0, 25.0),
        *("0.0.0.0", "xxh3_64", "none", "nixl", "UCX", KEY_A, [KEY_A], ["UCX"], "", [], {}),
    ]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=50)
    | st.binary(max_size=10)
    | USEFUL
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=20) | st.integers() | st.none()
PLAUSIBLE = (
    st.integers(min_value=0, max_value=1 << 31)
    | st.floats(min_value=0, max_value=100)
    | st.booleans()
    | st.none()
    | USEFUL
)
# Junk keys reject early; dicts of known keys with plausible values reach the cross-key rules.
DICTS = st.dictionaries(KEYS, JUNK, max_size=10) | st.dictionaries(
    st.sampled_from(FIELD_NAMES), PLAUSIBLE, max_size=6
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DICTS)
def test_any_dict_of_junk_yields_config_or_config_error(data: dict[Any, Any]) -> None:
    try:
        config = Config.from_dict(data)
    except ConfigError:
        return
    assert Config.from_dict(config.to_dict()) == config
    assert config.fetch_deadline_max_s < config.grant_lease_s


ENV_NAMES = st.sampled_from(["ECSHARE_" + n.upper() for n in FIELD_NAMES])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        ENV_NAMES | st.text(max_size=12).map("ECSHARE_".__add__) | st.text(max_size=12),
        st.text(max_size=30) | st.sampled_from(["1", "0", "true", "none", "", "65536", "2.5"]),
        max_size=8,
    )
)
def test_any_environment_yields_config_or_config_error(environ: dict[str, str]) -> None:
    with contextlib.suppress(ConfigError):
        Config.from_env(environ)
