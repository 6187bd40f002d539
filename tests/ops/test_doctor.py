"""`ecshare doctor` finds each problem it claims to, built for real by the test.

Doctor runs as a subprocess (`python -m ecshare doctor --json`) on this machine,
against real conditions: a `nixl` made unimportable (a package of that name
earlier on PYTHONPATH whose import raises ImportError), a region larger than
the memory the check measures, a small tmpfs as the shared-memory mount, a port
another socket listens on, a secret key file made readable by everyone, a UCX
transport selection this host lacks. The healthy run moves real bytes through
NIXL in its self-test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement
from peer_testing import REPO, child_env

from ecshare.apps.ops.versions import SUPPORTED, _within
from ecshare.control import generate_keypair

MiB = 1 << 20
TiB = 1 << 40
# Small and quick: nothing is prefaulted, and the region is only checked, never made. The
# host's huge-page setting is read from a copy that grants them (its own test reads the host's).
THP_ADVISE = Path(__file__).with_name("thp_advise.txt")
BASE = [
    *["--region-bytes", str(64 * MiB), "--no-prefault", "--ucx-net-devices", "lo"],
    *["--thp-shmem-path", str(THP_ADVISE)],
]


def doctor(
    *args: str, env: dict[str, str] | None = None, selftest: bool = False
) -> tuple[int, dict[str, Any], str]:
    """Run doctor; (exit status, the JSON report, stderr)."""
    argv = [sys.executable, "-m", "ecshare", "doctor", "--json", *BASE, *args]
    if not selftest:
        argv.append("--no-selftest")
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env or child_env(), timeout=240, check=False
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def assert_only_failures(report: dict[str, Any], names: Sequence[str]) -> None:
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    assert failed == set(names), report["checks"]
    assert report["ok"] is False


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    producer = generate_keypair(tmp_path / "keys", "producer")
    consumer = generate_keypair(tmp_path / "keys", "consumer")
    return {
        "producer_secret": producer.secret_path,
        "producer_public": producer.public_path,
        "consumer_secret": consumer.secret_path,
        "consumer_public": consumer.public_path,
    }


def key_flags(keys: dict[str, Path]) -> list[str]:
    return [
        "--server-secret-key-file",
        str(keys["producer_secret"]),
        "--authorized-keys-file",
        str(keys["consumer_public"]),
        "--client-secret-key-file",
        str(keys["consumer_secret"]),
        "--server-public-key-file",
        str(keys["producer_public"]),
    ]


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A real TCP socket listening on 127.0.0.1, as a running service would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


def test_healthy_machine_passes_every_check_and_moves_real_bytes(
    keys: dict[str, Path], listening: socket.socket
) -> None:
    port = listening.getsockname()[1]
    status, report, _ = doctor(
        *key_flags(keys), "--producer", f"tcp://127.0.0.1:{port}", selftest=True
    )
    checks = by_name(report)
    assert status == 0, report
    assert report["ok"] is True
    assert {c["status"] for c in report["checks"]} == {"ok"}, report["checks"]
    assert report["counts"] == {"ok": len(report["checks"]), "warn": 0, "fail": 0}
    for name in (
        "config",
        "nixl",
        "ucx transports",
        "memory",
        "memlock",
        "shared memory",
        "listen port",
        f"producer tcp://127.0.0.1:{port}",
        "keys (producer)",
        "keys (consumer)",
        "nixl self-test",
        "version vllm",
        "version nixl",
        "version torch",
    ):
        assert name in checks, (name, sorted(checks))
    selftest = checks["nixl self-test"]
    assert selftest["details"]["nbytes"] == 16 * MiB
    assert selftest["details"]["best_gb_per_s"] > 0
    assert "every byte verified" in selftest["finding"]
    ucx = checks["ucx transports"]
    assert ucx["details"]["selection"] == {"UCX_NET_DEVICES": "lo"}
    assert "tcp/lo" in ucx["details"]["resources"]


def test_table_output_names_each_check_and_exits_zero_when_healthy(
    keys: dict[str, Path], listening: socket.socket
) -> None:
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "ecshare", "doctor", *BASE, "--no-selftest", *key_flags(keys)],
            # A consumer told where its producers are: no warning that it cannot know.
            *["--trusted-producers", f"tcp://127.0.0.1:{listening.getsockname()[1]}"],
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["status", "check", "finding"]
    assert any(re.match(r"ok\s+nixl\s+nixl \d", line) for line in lines), proc.stdout
    assert lines[-1].startswith("ready: ") and lines[-1].endswith(" 0 warnings, 0 failed")


def test_missing_nixl_is_a_failed_check_with_the_install_command(
    keys: dict[str, Path], tmp_path: Path
) -> None:
    # A `nixl` package first on PYTHONPATH whose import raises, as a broken or
    # absent install does; the real one in site-packages is never reached.
    fake = tmp_path / "shadow" / "nixl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("nixl hidden by the doctor test")\n')
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), env["PYTHONPATH"]])
    status, report, _ = doctor(*key_flags(keys), env=env, selftest=True)
    checks = by_name(report)
    assert status == 1
    assert_only_failures(report, ["nixl", "nixl self-test"])
    assert "not importable" in checks["nixl"]["finding"]
    assert "nixl hidden by the doctor test" in checks["nixl"]["finding"]
    nixl_spec = next(spec for spec in SUPPORTED if spec.component == "nixl")
    assert checks["nixl"]["fix"] == f"run: {nixl_spec.install}"
    assert checks["nixl self-test"]["finding"].startswith("not run")


def test_region_larger_than_available_memory_fails_with_a_smaller_size(
    keys: dict[str, Path],
) -> None:
    # 1 TiB: more than MemAvailable (and any cgroup limit) of any machine this runs on.
    status, report, _ = doctor(*key_flags(keys), "--region-bytes", str(TiB))
    memory = by_name(report)["memory"]
    assert status == 1
    assert_only_failures(report, ["memory"])
    assert "more than this process can get" in memory["finding"]
    assert "MemAvailable" in memory["finding"]
    suggested = int(re.search(r"--region-bytes (\d+)", memory["fix"]).group(1))  # type: ignore[union-attr]
    assert 0 < suggested <= memory["details"]["budget_bytes"] < TiB
    assert suggested % (64 * 1024) == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small-shm"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(
            "mounting a 1 MiB tmpfs needs CAP_SYS_ADMIN, which this test run lacks: "
            + made.stderr.strip()
        )
    try:
        yield mount
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", str(mount)], check=False, timeout=30)


def test_small_shared_memory_mount_fails_with_a_remount_command(
    keys: dict[str, Path], small_tmpfs: Path
) -> None:
    status, report, _ = doctor(*key_flags(keys), "--shm-path", str(small_tmpfs))
    shm = by_name(report)["shared memory"]
    assert status == 1
    assert_only_failures(report, ["shared memory"])
    assert shm["details"]["total_bytes"] == MiB
    assert "memfd and does not use it" in shm["finding"]
    assert f"mount -o remount,size=2g {small_tmpfs}" in shm["fix"]


def test_shared_memory_without_2_mib_pages_warns_with_the_setting_to_change(
    keys: dict[str, Path], tmp_path: Path
) -> None:
    setting = tmp_path / "shmem_enabled"
    setting.write_text("always within_size advise [never] deny force\n")
    status, report, _ = doctor(*key_flags(keys), "--thp-shmem-path", str(setting))
    huge = by_name(report)["hugepages"]
    assert status == 0 and report["ok"] is True  # slower, not broken
    assert huge["status"] == "warn" and huge["details"]["setting"] == "never"
    assert "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled" in huge["fix"]
    # Asked for none, none are missed.
    _, report, _ = doctor(
        *key_flags(keys), "--thp-shmem-path", str(setting), "--no-region-hugepages"
    )
    assert by_name(report)["hugepages"]["status"] == "ok"


def test_the_hosts_own_huge_page_setting_is_read_and_judged() -> None:
    path = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
    try:
        words = Path(path).read_text().split()
    except OSError:
        words = []
    chosen = next((w[1:-1] for w in words if w.startswith("[")), None)
    _, report, _ = doctor("--thp-shmem-path", path)
    huge = by_name(report)["hugepages"]
    assert huge["details"]["setting"] == chosen
    granted = chosen in {"always", "within_size", "advise", "force"}
    assert huge["status"] == ("ok" if granted else "warn"), huge


def test_busy_listen_port_and_unreachable_producer_fail(
    keys: dict[str, Path], listening: socket.socket
) -> None:
    busy = listening.getsockname()[1]
    # A port nobody listens on: bound, then closed, so refused.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    status, report, _ = doctor(
        *key_flags(keys),
        "--listen-port",
        str(busy),
        "--producer",
        f"tcp://127.0.0.1:{closed}",
        "--producer",
        f"tcp://127.0.0.1:{busy}",
    )
    checks = by_name(report)
    assert status == 1
    assert_only_failures(report, ["listen port", f"producer tcp://127.0.0.1:{closed}"])
    assert checks["listen port"]["finding"] == f"127.0.0.1:{busy} is already in use"
    assert f"sport = :{busy}" in checks["listen port"]["fix"]
    assert "refused" in checks[f"producer tcp://127.0.0.1:{closed}"]["finding"].lower()
    assert checks[f"producer tcp://127.0.0.1:{busy}"]["status"] == "ok"


def test_secret_key_readable_by_everyone_fails_with_chmod(keys: dict[str, Path]) -> None:
    secret = keys["producer_secret"]
    secret.chmod(0o644)
    status, report, _ = doctor(*key_flags(keys))
    check = by_name(report)["keys (producer)"]
    assert status == 1
    assert_only_failures(report, ["keys (producer)"])
    assert "accessible to all users (mode 0o644)" in check["finding"]
    assert check["fix"] == f"run: chmod 600 {secret}"


def test_secret_key_readable_by_its_group_fails_with_chmod(keys: dict[str, Path]) -> None:
    secret = keys["consumer_secret"]
    secret.chmod(0o640)
    status, report, _ = doctor(*key_flags(keys))
    check = by_name(report)["keys (consumer)"]
    assert status == 1
    assert check["status"] == "fail", check
    assert "accessible to its group (mode 0o640)" in check["finding"]
    assert check["fix"] == f"run: chmod 600 {secret}"


def test_ucx_selection_this_host_lacks_fails_ucx_and_the_self_test(keys: dict[str, Path]) -> None:
    status, report, _ = doctor(*key_flags(keys), "--ucx-tls", "rc_mlx5", selftest=True)
    checks = by_name(report)
    assert status == 1
    assert_only_failures(report, ["ucx transports", "nixl self-test"])
    assert "found no usable transport" in checks["ucx transports"]["finding"]
    assert checks["ucx transports"]["details"]["selection"]["UCX_TLS"] == "rc_mlx5"


def test_tcp_only_selection_warns_that_local_reads_skip_cma(keys: dict[str, Path]) -> None:
    status, report, _ = doctor(*key_flags(keys), "--ucx-tls", "tcp")
    ucx = by_name(report)["ucx transports"]
    assert status == 0
    assert ucx["status"] == "warn"
    assert "no cma" in ucx["finding"]


def test_bad_config_file_is_a_failed_check_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"region_bytes": 64 * MiB, "lease_seconds": 3}))
    status, report, _ = doctor("--config", str(config))
    checks = by_name(report)
    assert status == 1
    assert checks["config"]["status"] == "fail"
    assert "lease_seconds" in checks["config"]["finding"]
    # The machine is still checked, with the defaults.
    assert checks["nixl"]["status"] == "ok"
    # What only the file could say is not checked against the defaults.
    assert "not checked" in checks["keys"]["finding"], checks["keys"]
    assert "not checked" in checks["checksum"]["finding"], checks["checksum"]


def test_extras_declare_the_supported_ranges_and_the_makefile_pins_inside_them() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    declared = {
        req.name: req.specifier
        for name in ("nixl", "vllm")
        for req in map(Requirement, extras[name])
    }
    makefile = (REPO / "Makefile").read_text()
    pins = dict(re.findall(r'"([a-z0-9-]+)==([0-9][^"]*)"', makefile))
    for spec in SUPPORTED:
        if spec.component == "torch":  # comes with vLLM, never installed on its own
            continue
        # A range any build of the component fits, never one exact version.
        assert declared[spec.component] == spec.spec, (spec.component, declared)
        assert f'"{spec.component}{spec.specifier}"' in spec.install, spec.install
        pinned = [d for d in spec.distributions if d in pins]
        assert pinned, (spec.component, pins)
        for dist in pinned:
            assert _within(pins[dist], spec.spec), (spec.component, pins[dist], spec.specifier)
            # The fix doctor prints names this machine's pins as well as the range.
            assert f'"{dist}=={pins[dist]}"' in spec.install, spec.install


def _fake_distribution(root: Path, name: str, version: str) -> Path:
    """A dist-info for `name` at `version` in `root`, which then shadows the installed one's
    metadata when `root` comes first on PYTHONPATH (the package itself still imports)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


@pytest.mark.parametrize("version", ["1.4.2", "1.6.0"])
def test_nixl_outside_the_supported_range_is_reported_with_its_version(
    keys: dict[str, Path], tmp_path: Path, version: str
) -> None:
    env = child_env()
    shadow = _fake_distribution(tmp_path / "shadow", "nixl", version)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    status, report, _ = doctor(*key_flags(keys), env=env)
    checks = by_name(report)
    assert status == 1
    assert_only_failures(report, ["version nixl"])
    assert f"nixl {version}" in checks["version nixl"]["finding"]
    assert "outside the supported range >=1.5,<1.6" in checks["version nixl"]["finding"]
    # nixl still imports, so its own check warns, naming the version and the range.
    nixl = checks["nixl"]
    assert nixl["status"] == "warn", nixl
    assert f"nixl {version} is outside the supported range >=1.5,<1.6" in nixl["finding"]
    assert nixl["details"]["installed"]["nixl"] == version


def test_any_nixl_inside_the_supported_range_passes(keys: dict[str, Path], tmp_path: Path) -> None:
    # A patch release the build never pinned: the range, not one version, is what counts.
    env = child_env()
    shadow = _fake_distribution(tmp_path / "shadow", "nixl", "1.5.9")
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    status, report, _ = doctor(*key_flags(keys), env=env)
    checks = by_name(report)
    assert status == 0, report["checks"]
    assert checks["nixl"]["status"] == "ok"
    assert (
        "nixl 1.5.9 imports (nixl._api), within the supported range >=1.5,<1.6"
        in (checks["nixl"]["finding"])
    )
    assert checks["version nixl"]["status"] == "ok"
    assert "nixl 1.5.9" in checks["version nixl"]["finding"]


def test_checksum_none_across_hosts_over_tcp_is_warned(keys: dict[str, Path]) -> None:
    # Advertised off this host: peers may be on other hosts, and UCX may use TCP.
    status, report, _ = doctor(*key_flags(keys), "--advertise-host", "192.0.2.10")
    check = by_name(report)["checksum"]
    assert (status, check["status"]) == (0, "warn"), check
    assert "xxh3_64" in check["fix"]

    # The same with checksums on, or with reads confined to RDMA and shared memory, is fine.
    for flags in (["--checksum", "xxh3_64"], ["--ucx-tls", "rc,sm,self"]):
        _, report, _ = doctor(*key_flags(keys), "--advertise-host", "192.0.2.10", *flags)
        assert by_name(report)["checksum"]["status"] == "ok", (flags, report["checks"])


def test_store_canary_is_flagged_as_a_debug_setting(keys: dict[str, Path]) -> None:
    _, report, _ = doctor(*key_flags(keys), "--store-canary")
    check = by_name(report)["store canary"]
    assert check["status"] == "warn" and "off" in check["fix"], check


def _deployment_examples() -> list[dict[str, Any]]:
    """Every `ec_connector_extra_config` in docs/DEPLOYMENT.md's `--ec-transfer-config`s."""
    text = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    found = re.findall(r"--ec-transfer-config '(\{.*?\})'", text, flags=re.S)
    return [json.loads(block)["ec_connector_extra_config"] for block in found]


def test_deployment_doc_example_configs_are_accepted_and_their_keys_checked(
    tmp_path: Path,
) -> None:
    examples = _deployment_examples()
    assert len(examples) >= 2
    assert any("trusted_producers" in e for e in examples)
    for i, example in enumerate(examples):
        path = tmp_path / f"example{i}.json"
        path.write_text(json.dumps(example))
        _, report, _ = doctor("--config", str(path))
        checks = by_name(report)
        assert checks["config"]["status"] == "ok", checks["config"]
        # The keys checked are the ones the file names (absent here), not the defaults.
        key_checks = [c for name, c in checks.items() if name.startswith("keys")]
        assert key_checks and all("/etc/ecshare/" in c["finding"] for c in key_checks), key_checks


def test_consumer_reading_a_remote_producer_over_tcp_is_warned(
    keys: dict[str, Path], tmp_path: Path, listening: socket.socket
) -> None:
    # Listening on loopback says nothing about where its producers are.
    remote = "tcp://192.0.2.7:5701"  # TEST-NET-1: never reachable
    config = tmp_path / "pd.json"
    config.write_text(json.dumps({"trusted_producers": [remote]}))
    status, report, _ = doctor(*key_flags(keys), "--config", str(config))
    checks = by_name(report)
    assert checks["checksum"]["status"] == "warn", checks["checksum"]
    assert "192.0.2.7" in checks["checksum"]["finding"] and "xxh3_64" in checks["checksum"]["fix"]
    # Each trusted producer is tried, as one named with --producer is.
    assert status == 1 and checks[f"producer {remote}"]["status"] == "fail", checks
    # Producers on this host only: reads stay here.
    local = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
    config.write_text(json.dumps({"trusted_producers": [local]}))
    status, report, _ = doctor(*key_flags(keys), "--config", str(config))
    checks = by_name(report)
    assert checks["checksum"]["status"] == "ok", checks["checksum"]
    assert "stay on this host" in checks["checksum"]["finding"]
    assert status == 0 and checks[f"producer {local}"]["status"] == "ok", checks


def test_consumer_that_names_no_producer_is_not_told_its_reads_stay_local(
    keys: dict[str, Path],
) -> None:
    _, report, _ = doctor(*key_flags(keys))
    check = by_name(report)["checksum"]
    assert check["status"] == "warn", check
    assert "trusted_producers" in check["finding"] and "stay on this host" not in check["finding"]
