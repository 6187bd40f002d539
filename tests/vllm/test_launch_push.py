"""`ecshare launch` wires push: names for prefill/decode, the encoders' allow-list of them."""

from __future__ import annotations

from pathlib import Path

from ecshare.apps.cli import build_parser
from ecshare.apps.launch import options_from_args, pd_push_names, plan_servers
from ecshare.vllm.servers import VllmServer
from ecshare.vllm.settings import split_extra


def _plan(tmp_path: Path, *argv: str) -> tuple[list[VllmServer], list[VllmServer]]:
    args = build_parser().parse_args(["launch", "--model", "m", "--encoders", "2", *argv])
    return plan_servers(options_from_args(args), tmp_path)


def test_each_prefill_decode_is_named_and_the_encoders_may_push_to_exactly_those(
    tmp_path: Path,
) -> None:
    encoders, pd = _plan(tmp_path, "--pd", "3")

    names = [s.spec.extra_config["push_name"] for s in pd]
    assert names == ["pd0", "pd1", "pd2"]
    assert pd_push_names(pd) == ("pd0", "pd1", "pd2")
    for encoder in encoders:
        _, settings = split_extra(encoder.spec.extra_config)
        assert settings.push_targets == ("pd0", "pd1", "pd2")
    for server in pd:
        # It pushes only over sessions it holds: it must know the encoders to open them.
        assert len(server.spec.extra_config["trusted_producers"]) == 2
        # The encoders' key may push: the default push_trusted_keys is the producer key.
        assert "push_trusted_keys" not in server.spec.extra_config


def test_no_push_leaves_push_out(tmp_path: Path) -> None:
    encoders, pd = _plan(tmp_path, "--pd", "2", "--no-push")

    assert all("push_name" not in s.spec.extra_config for s in pd)
    assert all("push_targets" not in s.spec.extra_config for s in encoders)
    assert pd_push_names(pd) == ()
