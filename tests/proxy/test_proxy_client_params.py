"""A client cannot choose where prefill/decode fetches from: its own ec_transfer_params are
dropped and counted, unless the operator passes them on (`--pass-ec-transfer-params`)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from proxy_stubs import stub_mm_hash
from proxy_testing import IMAGE_A, Rig, chat

from ecshare.apps.proxy.config import add_proxy_arguments, config_from_args

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FORGED = {"h-forged": {"peer": "tcp://attacker.example:5555", "fingerprint": "x"}}


def forwarded(rig: Rig, path: str = CHAT) -> dict[str, Any]:
    (body,) = rig.prefill_decode[0].bodies(path)
    return body


def test_forged_params_beside_media_are_dropped_and_counted(rig: Rig) -> None:
    proxy = rig.start_proxy()
    response = proxy.post(CHAT, chat(IMAGE_A, ec_transfer_params=FORGED))
    assert response.status_code == 200
    assert set(forwarded(rig)["ec_transfer_params"]) == {stub_mm_hash(IMAGE_A)}
    assert proxy.metric("client_params_dropped_total") == 1


@pytest.mark.parametrize("where", ["top_level", "vllm_xargs"])
def test_forged_params_in_a_request_without_media_are_dropped(rig: Rig, where: str) -> None:
    proxy = rig.start_proxy()
    if where == "top_level":
        body = chat(text="hello", ec_transfer_params=FORGED)
    else:
        body = chat(text="hello", vllm_xargs={"ec_transfer_params": "x", "other": 1})
    assert proxy.post(CHAT, body).status_code == 200
    sent = forwarded(rig)
    assert "ec_transfer_params" not in sent
    assert sent.get("vllm_xargs", {}) == ({} if where == "top_level" else {"other": 1})
    assert sent["messages"] == body["messages"]  # the rest is unchanged
    assert proxy.metric("client_params_dropped_total") == 1


def test_forged_params_in_a_completion_are_dropped(rig: Rig) -> None:
    proxy = rig.start_proxy()
    body = {"model": "stub-model", "prompt": "hi", "ec_transfer_params": FORGED}
    assert proxy.post(COMPLETIONS, body).status_code == 200
    sent = forwarded(rig, COMPLETIONS)
    assert "ec_transfer_params" not in sent and sent["prompt"] == "hi"
    assert proxy.metric("client_params_dropped_total") == 1


def test_request_without_client_params_is_not_counted(rig: Rig) -> None:
    proxy = rig.start_proxy()
    assert proxy.post(CHAT, chat(IMAGE_A)).status_code == 200
    assert proxy.metric("client_params_dropped_total") == 0


def test_operator_can_pass_client_params_on(rig: Rig) -> None:
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    args = parser.parse_args(["--pd", "http://pd:1", "--pass-ec-transfer-params"])
    assert config_from_args(args, {}).pass_ec_transfer_params
    assert not config_from_args(
        parser.parse_args(["--pd", "http://pd:1"]), {}
    ).pass_ec_transfer_params

    proxy = rig.start_proxy(pass_ec_transfer_params=True)
    assert proxy.post(CHAT, chat(IMAGE_A, ec_transfer_params=FORGED)).status_code == 200
    # The encoders' params are merged over the client's.
    assert set(forwarded(rig)["ec_transfer_params"]) == {"h-forged", stub_mm_hash(IMAGE_A)}
    assert proxy.metric("client_params_dropped_total") == 0
