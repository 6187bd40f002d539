"""Doctor checks of the installed software: nixl imports, and each version is supported."""

from __future__ import annotations

from importlib import metadata

from ecshare.apps.ops.check import Check
from ecshare.apps.ops.versions import SUPPORTED, Supported, installed
from ecshare.transport.nixl import import_nixl_api


def check_nixl() -> Check:
    """nixl imports, and which version it is against the supported range."""
    spec = next(s for s in SUPPORTED if s.component == "nixl")
    try:
        api = import_nixl_api()
    except Exception as exc:  # ImportError, or a native library that fails to load
        return Check(
            name="nixl",
            status="fail",
            finding=f"nixl is not importable ({type(exc).__name__}: {exc}); no data plane",
            fix=f"run: {spec.install}",
        )
    version = _dist_version("nixl") or "unknown version"
    if not hasattr(api, "nixl_agent"):
        return Check(
            name="nixl",
            status="fail",
            finding=f"nixl {version} imports, but nixl._api has no nixl_agent",
            fix=f"reinstall: {spec.install}",
        )
    found = installed(spec)
    if found.outside:
        # It imports, so it may work; the version check below fails on it.
        outside = ", ".join(f"{d} {v}" for d, v in found.outside.items())
        return Check(
            name="nixl",
            status="warn",
            finding=f"nixl {version} imports (nixl._api), but {outside} is outside the "
            f"supported range {spec.specifier}",
            fix=f"run: {spec.install}",
            details={"installed": found.found, "supported": spec.specifier},
        )
    return Check(
        name="nixl",
        status="ok",
        finding=f"nixl {version} imports (nixl._api), within the supported range {spec.specifier}",
        details={"installed": found.found, "supported": spec.specifier},
    )


def check_versions() -> list[Check]:
    return [_check_version(spec) for spec in SUPPORTED]


def _check_version(spec: Supported) -> Check:
    name = f"version {spec.component}"
    found = installed(spec)
    if found.missing:
        return Check(
            name=name,
            status="warn",
            finding=f"{spec.component} is not installed; needed for {spec.needed_for}",
            fix=f"if you need it, run: {spec.install}",
        )
    shown = ", ".join(f"{d} {v}" for d, v in found.found.items())
    if found.outside:
        return Check(
            name=name,
            status="fail",
            finding=f"{shown} is outside the supported range {spec.specifier}",
            fix=f"run: {spec.install}",
            details={"installed": found.found, "supported": spec.specifier},
        )
    return Check(
        name=name,
        status="ok",
        finding=f"{shown} (supported: {spec.specifier})",
        details={"installed": found.found, "supported": spec.specifier},
    )


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
