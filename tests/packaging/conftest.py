"""Fixtures: the wheel `python -m build` makes, and a fresh venv it is installed into
(see install_testing.py; each is made once per session)."""

from __future__ import annotations

import pytest
from install_testing import Built, InstalledVenv, built_once, installed_once


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """sdist and wheel, the wheel built from the sdist (as `python -m build` does)."""
    return built_once(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> InstalledVenv:
    return installed_once(tmp_path_factory.mktemp("installed"), built)
