"""Fixtures: the wheel `python -m build` makes, and a fresh venv it is installed into
(see install_testing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from install_testing import REPO, Built, InstalledVenv


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


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """sdist and wheel, the wheel built from the sdist (as `python -m build` does)."""
    tmp = tmp_path_factory.mktemp("build")
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


@pytest.fixture(scope="session")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> InstalledVenv:
    tmp = tmp_path_factory.mktemp("installed")
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
