"""Push routing: the proxy chooses the prefill/decode instance first and asks the encoders
to push the items there, by the push name its configuration gives (`--pd URL=PUSH_NAME`)."""

from __future__ import annotations

import pytest
from proxy_testing import IMAGE_A, IMAGE_B, Rig, chat

from ecshare.apps.cli import build_parser
from ecshare.apps.proxy.config import ProxyConfig, config_from_args
from ecshare.config import ConfigError


def _config(*flags: str) -> ProxyConfig:
    return config_from_args(build_parser().parse_args(["proxy", *flags]), {})


def test_encoders_are_asked_to_push_to_the_instance_that_gets_the_request(rig: Rig) -> None:
    proxy = rig.start_proxy(pd_push_names=("pd0",))
    # A client's own push_to is dropped with the rest of its ec_transfer_params.
    body = chat(IMAGE_A, IMAGE_B, ec_transfer_params={"push_to": ["elsewhere"]})

    assert proxy.post("/v1/chat/completions", body).status_code == 200

    calls = [b for stub in rig.encoders for b in stub.bodies()]
    assert len(calls) == 2
    assert all(b["ec_transfer_params"] == {"push_to": ["pd0"]} for b in calls)
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert "push_to" not in forwarded["ec_transfer_params"]


def test_without_push_names_the_encoders_are_asked_for_no_push(rig: Rig) -> None:
    proxy = rig.start_proxy()
    assert proxy.post("/v1/chat/completions", chat(IMAGE_A)).status_code == 200
    (call,) = [b for stub in rig.encoders for b in stub.bodies()]
    assert "ec_transfer_params" not in call


def test_pd_flag_takes_an_optional_push_name() -> None:
    config = _config("--pd", "http://a:8000=pd0", "http://b:8000/", "--pd", "http://c:8000=pd-2")
    assert config.prefill_decode == ("http://a:8000", "http://b:8000", "http://c:8000")
    assert config.pd_push_names == ("pd0", "", "pd-2")
    assert _config("--pd", "http://a:8000").pd_push_names == ()


@pytest.mark.parametrize("value", ["http://a:8000=../x", "http://a:8000=" + "x" * 65])
def test_bad_push_name_is_a_clear_error(value: str) -> None:
    with pytest.raises(ConfigError, match="push name"):
        _config("--pd", value)
