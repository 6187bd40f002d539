"""Registers the proxy test fixtures, which live in proxy_testing.py.

The proxy needs aiohttp and prometheus_client (the `proxy` extra), and the tests talk to it
with the official `openai` client and httpx. Without them this directory is not collected,
and the report header says why.
"""

from __future__ import annotations

_NEEDED = ("aiohttp", "prometheus_client", "openai", "httpx")

try:
    from proxy_testing import rig
except ModuleNotFoundError as exc:
    if exc.name not in _NEEDED:
        raise
    _missing = exc.name
    collect_ignore_glob = ["test_*.py"]

    def pytest_report_header() -> str:
        return f"tests/proxy not collected: {_missing} is not installed (the proxy extra)"


__all__ = ["rig"]
