"""docs/DEPLOYMENT.md's ports table names every port ecshare opens, and only those.

A firewall is written from that table: a port key added to the connector's `Config` or to
the proxy's `ProxyConfig` without a row is a port no rule lets through, and a row whose
key is gone asks for a hole nothing listens on. Each row's "set by" cell names its port as
the configs do: a connector key (`lane_port`) or a proxy flag (`ecshare proxy --port`).
A port field is one named `port` or `*_port`, or one whose values are bounded by 65535.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from ecshare.apps.proxy.config import ProxyConfig, add_proxy_arguments
from ecshare.config import Config

REPO = Path(__file__).parents[2]
DOC = REPO / "docs" / "DEPLOYMENT.md"
SECTION = "## Ports and firewall"
SET_BY = "set by (default)"
PROXY = "ecshare proxy "
CODE = re.compile(r"`([^`]+)`")
MAX_PORT = 65535
# Ports the table names that no config of ecshare sets, and whose they are.
NOT_OURS = {
    "--port": "vLLM's HTTP port (`vllm serve --port`)",
    "UCX_TCP_PORT_RANGE": "UCX's",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "vLLM's KV connector's (E->P->D)",
}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _rows() -> list[dict[str, str]]:
    """The ports table's rows, each by its column headings."""
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"{DOC.name} has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    header = _cells(table[0])
    assert SET_BY in header, f"the ports table has no {SET_BY!r} column: {header}"
    return [dict(zip(header, _cells(line), strict=True)) for line in table[2:]]


def _set_by() -> list[str]:
    return [row[SET_BY] for row in _rows()]


def _named_ports(cells: list[str]) -> set[str]:
    """Every port the cells name: each code span that says `port`, in any case."""
    return {name for cell in cells for name in CODE.findall(cell) if "port" in name.lower()}


def _bounded_like_a_port(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _bounded_like_a_port(t.type)
    if isinstance(t, mi.UnionType):
        return any(_bounded_like_a_port(member) for member in t.types)
    return isinstance(t, mi.IntType) and t.le == MAX_PORT


def port_fields(struct: type[msgspec.Struct]) -> set[str]:
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return {
        f.name
        for f in info.fields
        if f.name == "port" or f.name.endswith("_port") or _bounded_like_a_port(f.type)
    }


def proxy_flags() -> dict[str, str]:
    """Each ProxyConfig field the `ecshare proxy` command sets, to its long flag."""
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    return {
        action.dest: flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }


def mismatches(named: set[str], connector: set[str], proxy: set[str]) -> list[str]:
    """What the table and the configs disagree on: ports without a row, rows without a port."""
    flags = proxy_flags()
    proxy_named = {PROXY + flags[field] for field in proxy if field in flags}
    out = [f"Config.{key}: no row names `{key}`" for key in sorted(connector - named)]
    for field in sorted(proxy):
        flag = flags.get(field)
        if flag is None:
            out.append(f"ProxyConfig.{field}: no flag of `ecshare proxy` sets it")
        elif PROXY + flag not in named:
            out.append(f"ProxyConfig.{field}: no row names `{PROXY}{flag}`")
    out += [
        f"`{name}` is in the table but is no port of Config or ProxyConfig"
        for name in sorted(named - connector - proxy_named - NOT_OURS.keys())
    ]
    return out


def test_every_config_port_has_a_row_and_every_row_a_config_port() -> None:
    named = _named_ports(_set_by())
    connector, proxy = port_fields(Config), port_fields(ProxyConfig)
    assert {"listen_port", "lane_port", "metrics_port", "events_port"} <= connector
    assert {"port", "events_port"} <= proxy
    assert not mismatches(named, connector, proxy)


def test_a_port_key_without_a_row_or_a_row_without_a_key_is_caught() -> None:
    named = _named_ports(_set_by())
    connector, proxy = port_fields(Config), port_fields(ProxyConfig)
    assert mismatches(named, connector | {"status_port"}, proxy) == [
        "Config.status_port: no row names `status_port`"
    ]
    assert mismatches(named - {PROXY + "--port"}, connector, proxy) == [
        "ProxyConfig.port: no row names `ecshare proxy --port`"
    ]
    assert mismatches(named, connector, proxy | {"admin_port"}) == [
        "ProxyConfig.admin_port: no flag of `ecshare proxy` sets it"
    ]
    assert mismatches(named - {"lane_port"}, connector, proxy) == [
        "Config.lane_port: no row names `lane_port`"
    ]
    assert mismatches(named | {"gone_port"}, connector, proxy) == [
        "`gone_port` is in the table but is no port of Config or ProxyConfig"
    ]


def test_the_fetch_lane_row_says_tls_not_the_framing_it_replaced() -> None:
    (lane,) = [row for row in _rows() if "`lane_port`" in row[SET_BY]]
    assert "TLS 1.3" in lane["connection"] and "ChaCha20" not in lane["connection"]
