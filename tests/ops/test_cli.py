"""The `ecshare` command itself: its version, and a top-level help that names every command."""

from __future__ import annotations

import subprocess
import sys

import ecshare


def _ecshare(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_version_is_the_package_version() -> None:
    proc = _ecshare("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"ecshare {ecshare.__version__}")


def test_top_level_help_names_every_command() -> None:
    proc = _ecshare("--help")
    assert proc.returncode == 0
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("    ")}
    for command in (
        "launch", "proxy", "doctor", "status", "chaos", "keys", "serve", "fetch", "demo", "bench"
    ):  # fmt: skip
        assert command in listed, (command, proc.stdout)
