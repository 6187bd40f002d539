"""`ecshare doctor`: is this machine, and this config, ready to run ecshare?

Every check says ok, warn or fail, what it found in one line, and how to fix
what is not ok. The exit status is 0 when nothing fails and 1 otherwise; a
check that cannot run is a failed check, never a traceback. UCX is asked for
its transports, and the NIXL self-test moves real bytes, in child processes,
so that a native library that hangs or crashes is reported, not inherited.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ecshare.apps.bench.synthetic import format_size
from ecshare.apps.ops.check import Check, guarded
from ecshare.apps.ops.integrity_checks import check_integrity
from ecshare.apps.ops.key_checks import check_keys
from ecshare.apps.ops.memory_checks import (
    THP_SHMEM_PATH,
    check_hugepages,
    check_memlock,
    check_memory,
    check_shm,
)
from ecshare.apps.ops.network_checks import check_ports
from ecshare.apps.ops.selftest import SelfTestResult
from ecshare.apps.ops.software_checks import check_nixl, check_versions
from ecshare.apps.ops.table import render_table
from ecshare.apps.ops.ucx import UcxProbe
from ecshare.apps.ops.ucx_checks import check_ucx
from ecshare.config import Config, ConfigError, add_config_arguments, load_config
from ecshare.config.fields import parse_size

_T = TypeVar("_T", bound=msgspec.Struct)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
_SELFTEST_TIMEOUT_S = 90.0
_UCX_TIMEOUT_S = 30.0
_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


class Report(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool  # nothing failed (warnings allowed)
    counts: dict[str, int]
    checks: list[Check]


@dataclass
class DoctorOptions:
    config: Config | None
    config_error: str = ""
    config_source: str = "defaults, environment and flags"
    producers: list[str] = field(default_factory=list)
    shm_path: str = "/dev/shm"
    thp_shmem_path: str = THP_SHMEM_PATH
    selftest: bool = True
    selftest_bytes: int = 16 << 20
    connect_timeout_s: float = 2.0


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a JSON object of config keys, as in ec_connector_extra_config (flags override it)",
    )
    parser.add_argument(
        "--producer",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a producer this instance will fetch from (tcp://HOST:PORT): check it is "
        "reachable, as each of the config's trusted_producers is; repeatable",
    )
    parser.add_argument(
        "--shm-path",
        default="/dev/shm",
        metavar="PATH",
        help="the shared-memory mount to check [default: /dev/shm]",
    )
    parser.add_argument(
        "--thp-shmem-path",
        default=THP_SHMEM_PATH,
        metavar="PATH",
        help=f"the file that says whether shared memory may have 2 MiB pages [default: "
        f"{THP_SHMEM_PATH}]",
    )
    parser.add_argument("--no-selftest", action="store_true", help="skip the NIXL self-test")
    parser.add_argument(
        "--selftest-size",
        default="16MiB",
        metavar="SIZE",
        help="bytes the NIXL self-test reads [default: 16MiB]",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_arguments(parser)


def run_doctor(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    report = diagnose(options)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(render_report(report, options))
    return 0 if report.ok else 1


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    source = "defaults, environment and flags"
    config: Config | None = None
    error = ""
    try:
        extra: dict[str, Any] | None = None
        if args.config:
            extra = _read_config_file(args.config)
            source = f"{args.config}, environment and flags"
        config = load_config(extra=extra, cli=args)
    except ConfigError as exc:
        error = str(exc)
    try:
        selftest_bytes = parse_size(args.selftest_size)
    except ValueError as exc:
        selftest_bytes, error = 16 << 20, error or f"--selftest-size: {exc}"
    return DoctorOptions(
        config=config,
        config_error=error,
        config_source=source,
        producers=list(args.producer),
        shm_path=args.shm_path,
        thp_shmem_path=args.thp_shmem_path,
        selftest=not args.no_selftest,
        selftest_bytes=max(4096, selftest_bytes),
    )


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(None, f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(None, f"config file {path} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(None, f"config file {path} must hold one JSON object of config keys")
    return value


def diagnose(options: DoctorOptions) -> Report:
    checks: list[Check] = []
    config = options.config
    if config is None:
        checks.append(
            Check(
                name="config",
                status="fail",
                finding=options.config_error,
                fix="correct the key named above (`ecshare doctor --help` lists every key); "
                "the other checks use the defaults",
            )
        )
        config = load_config(env={})
    else:
        checks.append(
            Check(
                name="config",
                status="ok",
                finding=f"valid ({options.config_source}): region "
                f"{format_size(config.region_bytes)} in {format_size(config.block_bytes)} "
                f"blocks, listen {config.listen_host}:{config.listen_port}",
            )
        )
    ucx_env = _ucx_env(config)
    nixl = guarded("nixl", lambda: [check_nixl()])
    checks += nixl
    probe, probe_error = _child(UcxProbe, "ecshare.apps.ops.ucx", [], ucx_env, _UCX_TIMEOUT_S)
    checks += guarded("ucx transports", lambda: [check_ucx(config, probe, probe_error, ucx_env)])
    checks += guarded("memory", lambda: [check_memory(config)])
    checks += guarded("memlock", lambda: [check_memlock(config, probe)])
    checks += guarded("shared memory", lambda: [check_shm(config, options.shm_path)])
    checks += guarded("hugepages", lambda: [check_hugepages(config, options.thp_shmem_path)])
    checks += guarded(
        "ports", lambda: check_ports(config, _producers(config, options), options.connect_timeout_s)
    )
    if options.config is None:
        # Checked against the defaults, they would report what the file did not say.
        checks += [_unchecked(name) for name in ("keys", "checksum")]
    else:
        checks += guarded("keys", lambda: check_keys(config))
        checks += guarded("checksum", lambda: check_integrity(config, options.producers))
    if options.selftest:
        nixl_ok = all(c.status != "fail" for c in nixl)
        checks += guarded("nixl self-test", lambda: [_selftest(options, ucx_env, nixl_ok)])
    checks += guarded("versions", check_versions)
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
    return Report(ok=counts["fail"] == 0, counts=counts, checks=checks)


def _producers(config: Config, options: DoctorOptions) -> list[str]:
    """The producers to reach: those named to doctor, then the config's trusted ones."""
    return list(dict.fromkeys([*options.producers, *config.trusted_producers]))


def _unchecked(name: str) -> Check:
    return Check(
        name=name,
        status="warn",
        finding="not checked: the configuration did not load (see the config check)",
        fix="fix the config, then run doctor again",
    )


def _ucx_env(config: Config) -> dict[str, str]:
    """UCX_TLS / UCX_NET_DEVICES as a node would run: config over environment."""
    env = {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if os.environ.get(k)}
    if config.ucx_tls:
        env["UCX_TLS"] = config.ucx_tls
    if config.ucx_net_devices:
        env["UCX_NET_DEVICES"] = config.ucx_net_devices
    return env


def _selftest(options: DoctorOptions, ucx_env: dict[str, str], nixl_ok: bool) -> Check:
    size = format_size(options.selftest_bytes)
    if not nixl_ok:
        return Check(
            name="nixl self-test",
            status="fail",
            finding="not run: nixl is not importable (see the nixl check)",
            fix="fix the nixl check first",
        )
    result, error = _child(
        SelfTestResult,
        "ecshare.apps.ops.selftest",
        [str(options.selftest_bytes)],
        ucx_env,
        _SELFTEST_TIMEOUT_S,
    )
    if result is None or not result.ok:
        why = result.error if result is not None else error
        return Check(
            name="nixl self-test",
            status="fail",
            finding=f"a loopback READ of {size} between two NIXL agents failed: {why}",
            fix="see the ucx transports check; rerun with UCX_LOG_LEVEL=info for UCX's reasons",
        )
    return Check(
        name="nixl self-test",
        status="ok",
        finding=f"READ {size} between two local NIXL agents {result.reads} times, every byte "
        f"verified; best {result.best_gb_per_s:.2f} GB/s",
        details={"nbytes": result.nbytes, "best_gb_per_s": result.best_gb_per_s},
    )


def _child(
    kind: type[_T], module: str, argv: list[str], ucx_env: dict[str, str], timeout_s: float
) -> tuple[_T | None, str]:
    """Run `python -m module`, and decode the last JSON line it prints as `kind`."""
    env = dict(os.environ)
    env.update(ucx_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), _PACKAGE_ROOT]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return None, f"cannot start {sys.executable}: {exc}"
    # UCX logs to stdout too; its complaints are the best explanation we have.
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    ucx_said = "; ".join(
        line.split("UCX ", 1)[1].strip() for line in lines if " UCX " in line and "ERROR" in line
    )
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return msgspec.json.decode(line, type=kind), ucx_said
            except msgspec.DecodeError:
                break
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"exit status {proc.returncode}: {ucx_said or tail}"


def render_report(report: Report, options: DoctorOptions) -> str:
    rows: list[list[str]] = []
    for check in report.checks:
        rows.append([_MARK[check.status], check.name, check.finding])
        if check.status != "ok" and check.fix:
            rows.append(["", "", f"-> fix: {check.fix}"])
    c = report.counts
    verdict = "ready" if report.ok else "NOT ready"
    summary = f"{verdict}: {c['ok']} ok, {c['warn']} warnings, {c['fail']} failed"
    return render_table(["status", "check", "finding"], rows) + "\n\n" + summary
