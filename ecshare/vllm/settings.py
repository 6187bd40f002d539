"""What the vLLM connector reads of `--ec-transfer-config`, checked before it starts anything.

Every key in `ec_connector_extra_config` is a key of the one typed `ecshare.config.Config`,
the connector's own included: `trusted_producers` (the prefill/decode side's peer
allow-list) and `push_targets` (the encoder side's push allow-list) are documented with
the other keys in docs/CONFIG.md, and `ecshare doctor --config` checks a file of them.
`ConnectorSettings` is the view of those two keys that the scheduler side holds.

vLLM's own `ec_ip` and `ec_port` are for connectors that open one socket per instance;
ecshare's endpoints are `listen_host`/`advertise_host` and `listen_port`. A value other
than vLLM's default is refused, naming the ecshare key, rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from ecshare.config import Config, ConfigError, load_config
from ecshare.config.schema import Endpoint as Endpoint
from ecshare.config.schema import PushName as PushName

TRUSTED_PRODUCERS = "trusted_producers"
PUSH_TARGETS = "push_targets"
# vLLM's defaults of the ECTransferConfig fields ecshare does not read, and the ecshare
# key that does their job.
_VLLM_FIELDS = {
    "ec_ip": ("127.0.0.1", "listen_host (and advertise_host, the address peers use)"),
    "ec_port": (14579, "listen_port"),
}


_HINTS = {
    TRUSTED_PRODUCERS: " (trusted_producers is a list of producer endpoints, "
    "e.g. ['tcp://10.0.0.5:5701'])",
    PUSH_TARGETS: " (push_targets is a list of consumer push names, e.g. ['pd0'])",
}


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The allow-lists the scheduler side applies (see `Config.trusted_producers` and
    `Config.push_targets`)."""

    trusted_producers: tuple[str, ...] = ()
    push_targets: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Config) -> ConnectorSettings:
        return cls(trusted_producers=config.trusted_producers, push_targets=config.push_targets)

    def trusts(self, endpoint: str) -> bool:
        return not self.trusted_producers or endpoint in self.trusted_producers

    def may_push_to(self, name: str) -> bool:
        return not self.push_targets or name in self.push_targets


class _TransferConfig(Protocol):
    """The part of vLLM's ECTransferConfig read here."""

    ec_connector_extra_config: dict[str, Any]


def config_of(ec_transfer_config: _TransferConfig | None) -> Config:
    """The `Config` of vLLM's `--ec-transfer-config` (and ECSHARE_* variables), or
    ValueError naming the key: its extra config decoded strictly, and vLLM's `ec_ip` /
    `ec_port` refused when set (see the module docstring)."""
    if ec_transfer_config is None:
        return load_config()
    for name, (default, key) in _VLLM_FIELDS.items():
        value = getattr(ec_transfer_config, name, default)
        if value != default:
            raise ValueError(
                f"ecshare: --ec-transfer-config sets {name}={value!r}, which ECShareConnector "
                f"does not read; set {key} in ec_connector_extra_config instead"
            )
    extra = dict(ec_transfer_config.ec_connector_extra_config or {})
    try:
        return load_config(extra=extra)
    except ConfigError as exc:
        hint = _HINTS.get((exc.key or "").split("[", 1)[0], "")
        raise ValueError(f"ecshare: bad ec_connector_extra_config: {exc}{hint}") from None


def split_extra(extra: Mapping[str, Any]) -> tuple[dict[str, Any], ConnectorSettings]:
    """(`extra` as a dict, the allow-lists it sets), or ConfigError (a ValueError) naming
    the key; every key of `extra` is checked as a `Config` key."""
    config = Config.from_dict(extra)
    return dict(extra), ConnectorSettings.of(config)
