"""Which UCX transports this machine offers NIXL, asked of UCX itself.

Runs as a child process (`python -m ecshare.apps.ops.ucx`), because it loads native
libraries that could take the doctor down with them. It opens a UCP context
with the RMA feature (what NIXL's READs need) through the libucp bundled in the
NIXL wheel, or the system's if there is none, honouring UCX_TLS and
UCX_NET_DEVICES from the environment, and prints the resources UCP chose
(`ucp_context_print_info`: one "transport/device" per line) as one JSON line.
`ucx_info -d` would say the same, but the wheel does not ship it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import msgspec

# ucp.h: UCP_PARAM_FIELD_FEATURES, UCP_FEATURE_RMA.
_PARAM_FIELD_FEATURES = 1 << 0
_FEATURE_RMA = 1 << 1
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s*(\S+)/(\S+)")

# Transport families, by UCX transport name.
SHARED_MEMORY = frozenset({"cma", "knem", "xpmem", "posix", "sysv"})
RDMA_PREFIXES = ("rc", "ud", "dc")


class UcxProbe(msgspec.Struct, frozen=True, kw_only=True):
    library: str
    version: str
    resources: list[tuple[str, str]]  # (transport, device)
    error: str = ""

    @property
    def transports(self) -> set[str]:
        return {t for t, _ in self.resources}

    def devices(self, transport: str) -> list[str]:
        return sorted(d for t, d in self.resources if t == transport)

    @property
    def rdma(self) -> list[str]:
        return sorted(f"{t}/{d}" for t, d in self.resources if t.startswith(RDMA_PREFIXES))

    @property
    def shared_memory(self) -> list[str]:
        return sorted(t for t in self.transports if t in SHARED_MEMORY)


def find_libucp() -> str | None:
    """The libucp NIXL loads (bundled in nixl-cu12's wheel), else the system's."""
    for package in ("nixl_cu12", "nixl_cu13", "nixl_rocm"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        libs = Path(next(iter(spec.submodule_search_locations))).parent / f"{package}.libs"
        found = sorted(libs.glob("libucp-*.so*")) + sorted(libs.glob("libucp.so*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library("ucp")


def probe(library: str) -> UcxProbe:
    ucp = ctypes.CDLL(library)
    # ucs_status_t is an int8_t enum: 0 is OK, errors are negative.
    ucp.ucp_config_read.restype = ctypes.c_int8
    ucp.ucp_init_version.restype = ctypes.c_int8
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    version = f"{major.value}.{minor.value}.{release.value}"
    config = ctypes.c_void_p()
    status = ucp.ucp_config_read(None, None, ctypes.byref(config))
    if status != 0:
        return UcxProbe(library=library, version=version, resources=[], error=_status(ucp, status))
    # ucp_params_t begins with field_mask and features; the rest stays zero and unread.
    params = (ctypes.c_uint64 * 32)()
    params[0], params[1] = _PARAM_FIELD_FEATURES, _FEATURE_RMA
    context = ctypes.c_void_p()
    status = ucp.ucp_init_version(major, minor, ctypes.byref(params), config, ctypes.byref(context))
    ucp.ucp_config_release(config)
    if status != 0:
        return UcxProbe(library=library, version=version, resources=[], error=_status(ucp, status))
    try:
        text = _print_info(ucp, context)
    finally:
        ucp.ucp_cleanup(context)
    resources = [(m.group(1), m.group(2)) for m in map(_RESOURCE.search, text.splitlines()) if m]
    return UcxProbe(library=library, version=version, resources=resources)


def _print_info(ucp: ctypes.CDLL, context: ctypes.c_void_p) -> str:
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    with tempfile.TemporaryFile() as out:
        stream = libc.fdopen(os.dup(out.fileno()), b"w")
        if not stream:
            raise OSError("fdopen failed")
        ucp.ucp_context_print_info(context, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        out.seek(0)
        return out.read().decode("utf-8", "replace")


def _status(ucp: ctypes.CDLL, status: int) -> str:
    ucp.ucs_status_string.restype = ctypes.c_char_p
    try:
        text = ucp.ucs_status_string(ctypes.c_int8(status))
    except AttributeError:  # lives in libucs, which libucp links
        text = None
    return f"UCX status {status}" + (f" ({text.decode()})" if text else "")


def main() -> int:
    library = find_libucp()
    if library is None:
        result = UcxProbe(library="", version="", resources=[], error="no libucp found")
    else:
        result = probe(library)
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
