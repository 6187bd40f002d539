"""Doctor checks of the CURVE keys, loaded as a producer and a consumer would load them."""

from __future__ import annotations

from collections.abc import Callable

from ecshare.apps.ops.check import Check
from ecshare.config import Config
from ecshare.control.errors import ControlConfigError

_KEY_FIX = "create a pair with `ecshare keys generate DIR --name NAME`, or correct the path"


def check_keys(config: Config) -> list[Check]:
    """Load the configured keys the way a producer and a consumer would, with their messages."""
    if config.insecure:
        return [
            Check(
                name="keys",
                status="warn",
                finding="insecure=true: the control plane has no authentication or encryption",
                fix="only for loopback tests: generate keys (`ecshare keys generate`) and "
                "drop insecure",
            )
        ]
    out: list[Check] = []
    if config.server_secret_key_file:
        out.append(_load_keys("keys (producer)", lambda: _producer(config)))
    if config.client_secret_key_file or config.server_public_key_file or config.server_public_key:
        out.append(_load_keys("keys (consumer)", lambda: _consumer(config)))
    if not out:
        out.append(
            Check(
                name="keys",
                status="warn",
                finding="no CURVE keys configured, so neither a producer nor a consumer can start",
                fix="`ecshare keys generate DIR --name producer` (and --name consumer); then set "
                "server_secret_key_file + authorized_keys_file on producers, "
                "client_secret_key_file + server_public_key_file on consumers",
            )
        )
    return out


def _producer(config: Config) -> str:
    from ecshare.peer.node import producer_admins, producer_keys

    keys, authorized = producer_keys(config)
    admins = producer_admins(config, keys)
    return (
        f"server key {config.server_secret_key_file} readable and private; "
        f"{len(authorized)} authorized client key(s), {len(admins)} admin key(s)"
    )


def _consumer(config: Config) -> str:
    from ecshare.peer.node import consumer_keys

    consumer_keys(config)
    return f"client key {config.client_secret_key_file} readable and private; producer key loaded"


def _load_keys(name: str, load: Callable[[], str]) -> Check:
    try:
        finding = load()
    except ControlConfigError as exc:
        text = str(exc)
        finding, _, fix = text.partition(" Fix it with: ")
        return Check(
            name=name,
            status="fail",
            finding=finding,
            fix=f"run: {fix}" if fix else _KEY_FIX,
        )
    return Check(name=name, status="ok", finding=finding)
