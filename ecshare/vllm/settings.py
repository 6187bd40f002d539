"""The connector's own keys in `ec_connector_extra_config`, beside the core `Config` keys.

`trusted_producers` is the prefill/decode side's peer allow-list: the only
producer endpoints (`tcp://host:port`, as producers advertise them in
`ec_transfer_params`) this instance fetches from. A request whose params name
any other endpoint gets no fetch: the item is encoded locally, and the refusal
is counted (`peer_refused`). A request body therefore cannot point the
instance at an address of its choosing.

Unset (the default) trusts any endpoint that authenticates with the
configured producer key (`server_public_key[_file]`): the CURVE handshake
still refuses an impostor, but the instance connects wherever a request
points. `ecshare launch` sets the list to the encoders it starts.

`push_targets` is the encoder side's push allow-list: the consumer push names
(`push_name`) it may push to when a request asks (`ec_transfer_params:
{"push_to": [...]}`, see `pushes`). Unset, it pushes to any name that a
consumer holding an authenticated session with it (its key on
`authorized_keys`) announced; a name no such session holds is never pushed
to, whatever the list says. `ecshare launch` sets it to the prefill/decode
instances' names.

Everything else in `ec_connector_extra_config` is a core key and decodes into
`ecshare.config.Config`, strictly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

# What a producer advertises (`Producer.address`): tcp://HOST:PORT.
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^tcp://[^\s/:]+(:[^\s/:]+)*:\d{1,5}$")]
# A consumer's push name, as `Config.push_name` allows it.
PushName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
TRUSTED_PRODUCERS = "trusted_producers"
PUSH_TARGETS = "push_targets"
_OWN_KEYS = frozenset({TRUSTED_PRODUCERS, PUSH_TARGETS})


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys only the vLLM connector reads (see the module docstring)."""

    trusted_producers: Annotated[tuple[Endpoint, ...], msgspec.Meta(max_length=4096)] = ()
    push_targets: Annotated[tuple[PushName, ...], msgspec.Meta(max_length=4096)] = ()

    def trusts(self, endpoint: str) -> bool:
        return not self.trusted_producers or endpoint in self.trusted_producers

    def may_push_to(self, name: str) -> bool:
        return not self.push_targets or name in self.push_targets


def split_extra(extra: Mapping[str, Any]) -> tuple[dict[str, Any], ConnectorSettings]:
    """(the core Config keys, the connector's own settings) of `ec_connector_extra_config`."""
    core = {k: v for k, v in extra.items() if k not in _OWN_KEYS}
    own = {k: v for k, v in extra.items() if k in _OWN_KEYS}
    try:
        settings = msgspec.convert(own, ConnectorSettings)
    except msgspec.ValidationError as exc:
        raise ValueError(
            f"ecshare: bad ec_connector_extra_config: {exc} "
            "(trusted_producers is a list of producer endpoints, e.g. ['tcp://10.0.0.5:5555']; "
            "push_targets a list of consumer push names, e.g. ['pd0'])"
        ) from None
    return core, settings
