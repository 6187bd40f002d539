"""Both ends of a control connection take their socket settings from the Config one way."""

from __future__ import annotations

from dataclasses import fields

from ecshare.config import Config
from ecshare.control import LinkSettings

# The Config key behind a LinkSettings field, where the names differ.
CONFIG_KEY = {"heartbeat_ivl_s": "heartbeat_interval_s"}
# LinkSettings fields that no Config key sets: they keep their defaults.
NOT_CONFIGURED = frozenset({"linger_ms"})
# A value other than its default for the Config key behind every other field.
CHANGED = {
    "max_frame_bytes": 8 * 1024,
    "heartbeat_interval_s": 0.3,
    "heartbeat_timeout_s": 2.5,
    "handshake_timeout_s": 7.0,
}


def test_link_settings_carry_every_field_the_config_sets() -> None:
    config = Config.from_dict(CHANGED)
    settings = LinkSettings.of(config)
    for field in fields(LinkSettings):
        key = CONFIG_KEY.get(field.name, field.name)
        if field.name in NOT_CONFIGURED:
            assert key not in Config.__struct_fields__, f"Config sets {key}: carry it in of()"
            assert getattr(settings, field.name) == field.default
            continue
        assert key in CHANGED, f"LinkSettings.{field.name}: list its Config key in CHANGED"
        assert getattr(config, key) != getattr(Config(), key), f"CHANGED keeps {key}'s default"
        assert getattr(settings, field.name) == getattr(config, key), field.name


def test_a_default_config_asks_for_the_default_link() -> None:
    assert LinkSettings.of(Config()) == LinkSettings()
