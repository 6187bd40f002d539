"""`ecshare launch` before it starts anything: its plan (roles, keys, ports, cores or GPUs,
options), and the checks that refuse a bad launch, run as a real `ecshare launch` process.

The one test of a failed run starts a real `vllm serve` that exits at once."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ecshare.apps import launch
from ecshare.apps.cli import build_parser
from ecshare.apps.launch import (
    TENANT_SECRET_NAME,
    LaunchOptions,
    gpus_for,
    instance_name,
    instance_ports,
    options_from_args,
    plan_servers,
    preflight,
    proxy_config,
    second_proxy_argv,
    send_requests_here,
    where_each_listens,
)
from ecshare.apps.launch_checks import check_model, check_multimodal, find_gpus
from ecshare.apps.proxy.config import add_proxy_arguments, config_from_args
from ecshare.apps.ready import LaunchReady
from ecshare.control import load_keypair, load_public_key
from ecshare.vllm.servers import CPU_ARGS, CPU_ENV, CPU_ENV_DEFAULTS, ENV_DEFAULTS, free_port


def _options(*argv: str) -> LaunchOptions:
    return options_from_args(build_parser().parse_args(["launch", "--model", "m", *argv]))


def test_plan_has_one_key_pair_per_side_free_ports_and_cores_round_robin(tmp_path: Path) -> None:
    options = options_from_args(
        build_parser().parse_args(
            [
                "launch", "--model", "/models/m", "--encoders", "2", "--pd", "3",
                "--extra-vllm-args", "--max-model-len 2048 --dtype 'bfloat16'",
                "--ec-extra-config", '{"region_bytes": 1048576}',
            ]
        )
    )  # fmt: skip

    encoders, pd = plan_servers(options, tmp_path)

    assert [s.spec.ec_role for s in encoders] == ["ec_producer"] * 2
    assert [s.spec.ec_role for s in pd] == ["ec_consumer"] * 3
    servers = [*encoders, *pd]
    assert len({s.spec.port for s in servers}) == 5
    assert len({s.log_path for s in servers}) == 5
    cores = sorted(os.sched_getaffinity(0))
    assert [s.spec.core for s in servers] == [cores[i % len(cores)] for i in range(5)]
    for server in servers:
        command = server.spec.command()
        assert command[-4:] == ["--max-model-len", "2048", "--dtype", "bfloat16"]
        config = json.loads(command[command.index("--ec-transfer-config") + 1])
        extra = config["ec_connector_extra_config"]
        assert extra["region_bytes"] == 1048576
        assert command[command.index("--served-model-name") + 1] == "/models/m"
        key_files = [v for k, v in extra.items() if k.endswith("_file")]
        assert key_files and all(Path(f).is_file() for f in key_files)
    ports = [s.spec.extra_config.pop("listen_port") for s in encoders]
    assert len(set(ports)) == 2 and 0 not in ports
    # Each instance listens on a loopback address of its own, its HTTP server too.
    hosts = [s.spec.extra_config.pop("listen_host") for s in servers]
    assert hosts == [f"127.0.0.{2 + i}" for i in range(5)]
    assert [s.url.split("//")[1].split(":")[0] for s in servers] == hosts
    assert encoders[0].spec.extra_config == encoders[1].spec.extra_config
    producer_public = encoders[0].spec.extra_config["authorized_keys_file"]
    assert pd[0].spec.extra_config["client_secret_key_file"] != producer_public
    # Prefill/decode fetches from the encoders it was launched with, and from no other.
    trusted = [f"tcp://{host}:{port}" for host, port in zip(hosts, ports, strict=False)]
    assert all(s.spec.extra_config["trusted_producers"] == trusted for s in pd)


def test_encoders_advertised_host_is_what_prefill_decode_trusts(tmp_path: Path) -> None:
    extra = '{"listen_host": "0.0.0.0", "advertise_host": "10.1.2.3"}'
    encoders, pd = plan_servers(_options("--ec-extra-config", extra), tmp_path)
    port = encoders[0].spec.extra_config["listen_port"]
    assert pd[0].spec.extra_config["trusted_producers"] == [f"tcp://10.1.2.3:{port}"]
    # Instances sharing an address cannot share an events port: no item events then.
    assert all("events_port" not in s.spec.extra_config for s in [*encoders, *pd])


def test_unknown_encoder_endpoint_leaves_trust_to_the_producer_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, pd = plan_servers(_options("--ec-extra-config", '{"listen_port": 0}'), tmp_path)
    assert "trusted_producers" not in pd[0].spec.extra_config
    assert "trust any producer that authenticates" in capsys.readouterr().err


def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """An instance binds its port after seconds of imports: a port the kernel also gives
    outgoing connections could be taken meanwhile."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", free_port()))
        ports = [free_port() for _ in range(300)]
        assert len(set(ports)) == len(ports)
        assert taken.getsockname()[1] not in ports
        assert not [p for p in ports if low <= p <= high]
        for port in ports[:20]:  # each still bindable now
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    finally:
        taken.close()


def test_a_session_started_from_a_niced_process_takes_only_what_unniced_work_leaves() -> None:
    """Each instance, launch and producer runs in a session of its own (`popen_session`).
    Where the kernel groups sessions (autogroup), a niceness counts only within one, and
    a new session's group starts at 0: a `vllm serve` started from `nice -n 19` took half
    of a core beside un-niced work. Two loops spin on one core, one started so."""
    cpu = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    starter = (
        "import sys, time\n"
        "from ecshare.vllm.servers import popen_session\n"
        f"print(popen_session([sys.executable, '-c', {spin!r}]).pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    niced = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", starter],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    plain = subprocess.Popen([sys.executable, "-c", spin])
    spinner = None
    try:
        assert niced.stdout is not None
        spinner = psutil.Process(int(niced.stdout.readline()))
        assert os.getsid(spinner.pid) == spinner.pid  # a session of its own
        assert spinner.nice() == 19  # its starter's
        time.sleep(0.5)  # both spin on that core by now
        before = [sum(p.cpu_times()[:2]) for p in (spinner, psutil.Process(plain.pid))]
        time.sleep(2.0)
        after = [sum(p.cpu_times()[:2]) for p in (spinner, psutil.Process(plain.pid))]
        niced_s, plain_s = (a - b for a, b in zip(after, before, strict=True))
        # Weights 15 against 1024 (nice 19 against 0), in one session group or two.
        assert niced_s < plain_s / 4, (niced_s, plain_s)
    finally:
        plain.kill()
        if spinner is not None:
            with contextlib.suppress(psutil.Error):
                spinner.kill()
        os.killpg(niced.pid, signal.SIGKILL)
        plain.wait()
        niced.wait()


@pytest.mark.parametrize(
    "argv",
    [("--encoders", "0"), ("--pd", "0"), ("--ec-extra-config", "[1]"), ("--proxy-workers", "0")],
)
def test_bad_launch_options_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _options(*argv)


# --- hardware ---------------------------------------------------------------------------------


def test_cpu_test_settings_apply_only_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*CPU_ENV, *CPU_ENV_DEFAULTS, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    options = _options("--encoders", "2", "--pd", "1")

    encoders, pd = plan_servers(options, tmp_path / "cpu", gpus=None)
    for server in (*encoders, *pd):
        command, env = server.spec.command(), server.spec.env()
        assert _has_run(command, CPU_ARGS)
        assert {k: env[k] for k in CPU_ENV} == CPU_ENV
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(server.spec.core)
        assert {k: env[k] for k in CPU_ENV_DEFAULTS} == CPU_ENV_DEFAULTS
        assert "CUDA_VISIBLE_DEVICES" not in env

    # Three instances on two GPUs: round-robin, and the two that share GPU 0 split it.
    encoders, pd = plan_servers(options, tmp_path / "gpu", gpus=["0", "1"])
    servers = [*encoders, *pd]
    assert [s.spec.env()["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1", "0"]
    for server in servers:
        command, env = server.spec.command(), server.spec.env()
        assert not any(arg in command for arg in ("--dtype", "--max-model-len", "--enforce-eager"))
        assert not set(CPU_ENV) & set(env) and "VLLM_CPU_OMP_THREADS_BIND" not in env
        assert not set(CPU_ENV_DEFAULTS) & set(env)
        utilization = [
            command[i + 1] for i, a in enumerate(command) if a == "--gpu-memory-utilization"
        ]
        assert utilization == (["0.45"] if server.spec.gpus == "0" else [])


def _has_run(command: list[str], run: tuple[str, ...]) -> bool:
    return any(tuple(command[i : i + len(run)]) == run for i in range(len(command)))


def test_gpus_are_found_by_device_node_or_cuda_visible_devices(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert find_gpus({}, tmp_path) == ["0", "1", "10"]
    assert find_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}, tmp_path) == ["3", "1"]
    assert find_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []
    assert find_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, tmp_path) == []
    assert find_gpus({}, tmp_path / "empty") == []


def test_cpu_settings_by_default_only_where_no_gpu_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert gpus_for("auto") == ["2"]
    assert gpus_for("cpu") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus_for("auto") is None
    assert gpus_for("gpu") == []  # vLLM picks
    assert _options("--cpu").device == "cpu" and _options("--gpu").device == "gpu"
    assert _options().device == "auto"


def test_help_lists_every_default_launch_passes() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["launch"].format_help().split())
    for arg in CPU_ARGS:
        assert arg in text, arg
    for key, value in {
        **CPU_ENV,
        **CPU_ENV_DEFAULTS,
        **ENV_DEFAULTS,
    }.items():
        assert f"{key}={value}" in text, key
    for said in ("VLLM_CPU_OMP_THREADS_BIND", "--gpu-memory-utilization", "CUDA_VISIBLE_DEVICES"):
        assert said in text, said


# --- before anything starts -------------------------------------------------------------------


def _launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", "launch", *argv],
        capture_output=True,
        text=True,
        env=env or os.environ.copy(),
        timeout=120,
        check=False,
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port a real socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_every_problem_found_before_start_is_one_line_and_nothing_starts(
    tmp_path: Path, taken_port: int
) -> None:
    key = tmp_path / "api.key"
    key.write_text("secret\n")
    key.chmod(0o644)
    work = tmp_path / "work"
    proc = _launch(
        "--model", str(tmp_path / "no-such-model"),
        "--port", str(taken_port),
        "--ec-extra-config", '{"region_bytes": "1GB"}',
        "--api-key-file", str(key),
        "--workdir", str(work),
    )  # fmt: skip
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    expected = [
        f"ecshare launch: --model {tmp_path / 'no-such-model'}: no such file or directory",
        "ecshare launch: --ec-extra-config: region_bytes: got '1GB', expected a size",
        f"ecshare launch: --port: the proxy cannot listen on 127.0.0.1:{taken_port}: "
        "already in use",
        f"ecshare launch: --api-key-file: '{key}' is accessible to all users (mode 0o644), "
        f"who could act with the secret it holds. Fix it with: chmod 600 {key}",
        "ecshare launch: nothing started",
    ]
    for want in expected:
        assert sum(line.startswith(want) for line in lines) == 1, (want, lines)
    # No instance started: each opens its log before its process starts.
    assert not list(work.glob("*.log")), sorted(work.iterdir())
    assert "starting" not in proc.stdout


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (("--ec-extra-config", "{region_bytes: 1}"), {}, "--ec-extra-config: not JSON"),
        (("--ec-extra-config", '["x"]'), {}, "--ec-extra-config: got '[\"x\"]', expected a JSON"),
        (("--extra-vllm-args", "--x 'y"), {}, "--extra-vllm-args: No closing quotation"),
        (
            ("--api-key-file", "/no/such/key"),
            {},
            "--api-key-file: cannot read '/no/such/key': No such file",
        ),
        (
            (),
            {"ECSHARE_GRANT_LEASE_S": "soon"},
            "ECSHARE_GRANT_LEASE_S: got 'soon', expected float",
        ),
        (
            ("--encoders", "2", "--ec-extra-config", '{"listen_port": 5701}'),
            {},
            "--ec-extra-config: port 5701 is both encoder0's and encoder1's",
        ),
        (("--port-range", "30099-30000"), {}, "--port-range: got '30099-30000', expected"),
        (("--port-range", "80-90"), {}, "--port-range: got '80-90', expected LOW-HIGH within"),
        # Two instances, an encoder's control plane and the item events: 4 ports, not 2.
        (("--port-range", "30000-30001"), {}, "--port-range: no port of 30000-30001 is free"),
    ],
)
def test_a_bad_flag_is_named_and_nothing_starts(
    tmp_path: Path, argv: tuple[str, ...], env: dict[str, str], line: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _launch(
        "--model", str(model), "--port", "0", "--workdir", str(tmp_path / "work"), *argv,
        env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ecshare launch: {line}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "work").glob("*.log"))


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    assert check_model(str(tmp_path), offline=False) == [
        f"--model {tmp_path}: {tmp_path} holds no config.json, so it is not a model"
    ]
    assert check_model("Qwen/Qwen2-VL-2B-Instruct", offline=False) == []  # vLLM fetches it
    assert "not in the Hugging Face cache" in check_model("ecshare-test/absent", offline=True)[0]


def test_a_text_only_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """vLLM serves Qwen2ForCausalLM as text only: it has no encoder whose outputs to share,
    and launch says so before any instance starts (it started both, and the first request
    failed about a minute later)."""

    def model(name: str, architectures: list[str]) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": architectures}))
        return path

    text = model("text", ["Qwen2ForCausalLM"])
    assert check_multimodal(str(text)) == [
        f"--model {text}: vLLM serves Qwen2ForCausalLM as a text-only model, and ecshare "
        "shares the outputs of a multimodal model's encoders (images, video, audio): pick a "
        "model that takes media, e.g. Qwen/Qwen2-VL-2B-Instruct"
    ]
    assert check_multimodal(str(model("vl", ["Qwen2VLForConditionalGeneration"]))) == []
    assert check_multimodal(str(model("llava", ["LlavaForConditionalGeneration"]))) == []
    assert check_multimodal(str(model("own", ["MyOwnForCausalLM"]))) == []  # vLLM will say
    assert check_multimodal(str(model("none", []))) == []
    proc = _launch("--model", str(text), "--port", "0", "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ecshare launch: --model {text}: vLLM serves Qwen2ForCausalLM" in proc.stderr
    assert not list((tmp_path / "work").glob("*.log"))  # no instance started


def test_a_proxy_beyond_loopback_without_an_api_key_is_warned(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ECSHARE_PROXY_API_KEY"}
    proc = _launch("--model", str(tmp_path / "absent"), "--host", "0.0.0.0", "--port", "0", env=env)
    assert proc.returncode == 2
    assert "warning: the proxy listens on 0.0.0.0, beyond loopback, and requires no API key" in (
        proc.stderr
    )
    key = tmp_path / "api.key"
    key.write_text("secret\n")
    key.chmod(0o600)
    proc = _launch(
        "--model", str(tmp_path / "absent"), "--host", "0.0.0.0", "--port", "0",
        "--api-key-file", str(key), env=env,
    )  # fmt: skip
    assert proc.returncode == 2 and "warning" not in proc.stderr, proc.stderr


def test_the_api_key_file_reaches_the_proxy_and_the_curl_example(tmp_path: Path) -> None:
    key = tmp_path / "api.key"
    key.write_text("# tenants\nsecret tenant-a\nother tenant-b\n")
    key.chmod(0o600)
    options = _options("--api-key-file", str(key), "--pd", "2", "--cpu")
    encoders, pd = plan_servers(options, tmp_path)
    problems, config = preflight(options, encoders, pd)
    # Nothing but the model is wrong (no model "m" is on this host).
    assert all(p.startswith("--model m: ") for p in problems), problems
    assert config.api_keys == {"secret": "tenant-a", "other": "tenant-b"}
    assert config.pd_push_names == ("pd0", "pd1")
    # The proxy refuses up front what the instances would refuse: their own limit.
    assert config.limit_mm_per_prompt == {"image": 2, "video": 0}
    line = send_requests_here("http://127.0.0.1:8080", "m", str(key))
    assert "send requests here: http://127.0.0.1:8080/v1/chat/completions" in line
    curl = shlex.split(line.splitlines()[1])
    assert curl[:2] == ["curl", "http://127.0.0.1:8080/v1/chat/completions"]
    # Pasted into a shell, it sends the file's first key (not its tenant, not a comment).
    args = subprocess.run(
        ["bash", "-c", 'curl() { printf "%s\\n" "$@"; }; ' + line.splitlines()[1]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "Authorization: Bearer secret" in args, args
    assert json.loads(curl[curl.index("-d") + 1])["model"] == "m"


def test_an_api_key_file_its_group_can_read_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    key = tmp_path / "api.key"
    key.write_text("secret tenant-a\n")
    key.chmod(0o640)
    options = _options("--api-key-file", str(key), "--cpu")
    encoders, pd = plan_servers(options, tmp_path / "work")
    problems, config = preflight(options, encoders, pd)
    assert [p for p in problems if p.startswith("--api-key-file")] == [
        f"--api-key-file: '{key}' is accessible to its group (mode 0o640), who could act "
        f"with the secret it holds. Fix it with: chmod 600 {key}"
    ]
    assert config is None  # the proxy's own reading refuses it too


def test_every_proxy_launch_starts_keys_tenant_salts_under_one_secret_only_its_owner_reads(
    tmp_path: Path,
) -> None:
    options = _options("--pd", "2", "--cpu")
    encoders, pd = plan_servers(options, tmp_path)
    secret = tmp_path / TENANT_SECRET_NAME
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    config = proxy_config(options, encoders, pd)
    assert config.tenant_secret == secret.read_text().strip()
    assert len(config.tenant_secret) >= 32
    # A second proxy in front of the same launch (`ecshare bench serve`) reads the same file.
    ready = LaunchReady(
        url="http://127.0.0.1:8080",
        model="m",
        encoders=config.encoders,
        prefill_decode=config.prefill_decode,
        workdir=str(tmp_path),
        push_names=config.pd_push_names,
        events_port=config.events_port,
    )
    argv = second_proxy_argv(ready, push=True, limit=None)
    assert argv[argv.index("--tenant-secret-file") + 1] == str(secret)
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    assert config_from_args(parser.parse_args(argv)).tenant_secret == config.tenant_secret
    # Another launch makes another secret.
    plan_servers(options, tmp_path / "other")
    assert (tmp_path / "other" / TENANT_SECRET_NAME).read_text() != secret.read_text()


@pytest.mark.cpu_bound
def test_a_failed_run_keeps_its_logs_and_says_where(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    # vLLM refuses an unknown flag at once: the instance fails after it started.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = _launch(
        "--model", str(model), "--port", "0", "--cpu",
        "--extra-vllm-args=--no-such-vllm-flag", env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    kept = [line for line in proc.stderr.splitlines() if "logs kept in " in line]
    assert len(kept) == 1, proc.stderr
    workdir = Path(kept[0].split("logs kept in ", 1)[1])
    assert workdir.parent == tmp_path
    assert "no-such-vllm-flag" in (workdir / "encoder0.log").read_text()
    assert "starting encoder0 (ec_producer)" in proc.stdout


def test_every_instance_feeds_the_proxys_directory_under_keys_launch_made(tmp_path: Path) -> None:
    options = _options("--encoders", "2", "--pd", "2")
    encoders, pd = plan_servers(options, tmp_path, gpus=None)
    servers = [*encoders, *pd]
    ports = {s.spec.extra_config["events_port"] for s in servers}
    assert len(ports) == 1 and 0 not in ports  # one port: each instance has its own host
    admin = {s.spec.extra_config["admin_keys_file"] for s in servers}
    assert admin == {str(tmp_path / "proxy.key")}
    config = proxy_config(options, encoders, pd)
    assert config.events_port == ports.pop()
    assert config.events_key_file == str(tmp_path / "proxy.key_secret")
    # The feed admits the proxy's key, and each role publishes under its own key.
    proxy_public = load_public_key(str(tmp_path / "proxy.key"))
    assert load_keypair(config.events_key_file).public == proxy_public
    publishes = {
        config.events_encoder_key: encoders[0].spec.extra_config["server_secret_key_file"],
        config.events_pd_key: pd[0].spec.extra_config["client_secret_key_file"],
    }
    for public, secret in publishes.items():
        assert public is not None
        assert load_public_key(public) == load_keypair(secret).public


def test_extra_proxy_args_reach_launchs_proxy_and_a_wrong_one_is_named_before_any_start(
    tmp_path: Path,
) -> None:
    options = _options("--extra-proxy-args", "--max-in-flight-per-pd 4 --pd-slot-wait 5")
    encoders, pd = plan_servers(options, tmp_path / "ok")
    config = proxy_config(options, encoders, pd)
    assert (config.max_in_flight_per_pd, config.pd_slot_wait_s) == (4, 5.0)
    assert config.prefill_decode == tuple(s.url for s in pd)  # launch's own flags kept
    for extra, says in (
        ("--no-such-proxy-flag 1", "not a flag of ecshare proxy: --no-such-proxy-flag 1"),
        ("--max-in-flight-per-pd many", "invalid int value: 'many'"),
        ("--max-in-flight-per-pd -1", "expected >= 1 (or 0: no bound)"),
    ):
        options = _options("--extra-proxy-args", extra)
        encoders, pd = plan_servers(options, tmp_path / str(abs(hash(extra))))
        problems, config = preflight(options, encoders, pd)
        assert config is None
        assert any(p.startswith("--") and says in p for p in problems), problems


def test_instances_take_their_ports_from_the_range_and_launch_says_where_each_listens(
    tmp_path: Path,
) -> None:
    options = _options("--encoders", "2", "--pd", "2", "--port-range", "30200-30299")
    encoders, pd = plan_servers(options, tmp_path, gpus=None)
    servers = [*encoders, *pd]
    ports = [s.spec.port for s in servers]
    ports += [s.spec.extra_config["listen_port"] for s in encoders]
    ports.append(servers[0].spec.extra_config["events_port"])
    assert all(30200 <= port <= 30299 for port in ports), ports
    assert len(set(ports)) == len(ports)
    instances = instance_ports(servers)
    assert list(instances) == ["encoder0", "encoder1", "prefill_decode0", "prefill_decode1"]
    for server in servers:
        ports_of = instances[instance_name(server)]
        host = server.spec.extra_config["listen_host"]
        assert ports_of.url == server.url and ports_of.metrics == server.url + "/metrics"
        assert ports_of.events == f"tcp://{host}:{server.spec.extra_config['events_port']}"
        if server in encoders:
            assert ports_of.control == f"tcp://{host}:{server.spec.extra_config['listen_port']}"
        else:
            assert ports_of.control is None
    lines = where_each_listens("http://127.0.0.1:8080", instances)
    assert lines[0] == "proxy http://127.0.0.1:8080, metrics http://127.0.0.1:8080/metrics"
    assert lines[1].startswith(f"encoder0 {encoders[0].url}, metrics {encoders[0].url}/metrics")
    assert ", control tcp://" in lines[1] and ", control" not in lines[3]


def test_an_instance_that_is_slow_to_load_is_reported_until_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """While an instance loads, launch says every PROGRESS_EVERY_S how long it has waited
    and its log's last line; at --ready-timeout it gives up. The instance here is a real
    process that never answers /health (nothing listens on its port)."""
    monkeypatch.setattr(launch, "PROGRESS_EVERY_S", 0.5)
    options = _options()
    (encoder, *_), _ = plan_servers(options, tmp_path, gpus=None)
    encoder.log_path.write_text("INFO loading weights\nINFO still loading weights 3/7\n")
    encoder.proc = subprocess.Popen(["sleep", "30"])
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            launch._wait_ready(encoder, started, started + 2.0)
    finally:
        encoder.proc.kill()
        encoder.proc.wait()
    said = [line for line in capsys.readouterr().out.splitlines() if "waiting for" in line]
    assert len(said) >= 2, said
    assert said[0].startswith("ecshare launch: waiting for encoder0 (")
    assert said[0].endswith("s of --ready-timeout 2): INFO still loading weights 3/7")


def test_prefill_and_decode_plan_kv_connectors_beside_ecshare(tmp_path: Path) -> None:
    options = _options("--encoders", "2", "--prefill", "2", "--decode", "1")
    assert (options.prefill_decode, options.decode) == (2, 1)
    encoders, pd = plan_servers(options, tmp_path, gpus=None)
    prefill, decode = launch.split_roles(pd)
    assert [instance_name(s) for s in (*prefill, *decode)] == ["prefill0", "prefill1", "decode0"]
    servers = [*encoders, *pd]
    assert len({s.spec.core for s in servers[:2]}) == min(2, len(os.sched_getaffinity(0)))
    for server, role in (
        (prefill[0], "kv_producer"),
        (prefill[1], "kv_producer"),
        (decode[0], "kv_consumer"),
    ):
        command = server.spec.command()
        kv = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == role
        assert kv["kv_buffer_device"] == "cpu"
        assert kv.get("kv_load_failure_policy") == ("recompute" if role == "kv_consumer" else None)
        # ecshare beside it, as a consumer: decode takes media-free requests through it.
        ec = json.loads(command[command.index("--ec-transfer-config") + 1])
        assert ec["ec_role"] == "ec_consumer"
        env = server.spec.env()
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == server.spec.host
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == server.spec.kv_port
    for server in encoders:
        assert "--kv-transfer-config" not in server.spec.command()
    # Each KV side channel, NIXL listener and HTTP port is its own.
    ports = [s.spec.port for s in servers] + [s.spec.kv_port for s in pd]
    assert len(set(ports)) == len(ports)
    # Pushes go to the prefill instances only, and the proxy splits the stages.
    assert [s.spec.extra_config.get("push_name") for s in pd] == ["pd0", "pd1", None]
    assert encoders[0].spec.extra_config["push_targets"] == ["pd0", "pd1"]
    config = proxy_config(options, encoders, pd)
    assert config.prefill_decode == tuple(s.url for s in prefill)
    assert config.pd_push_names == ("pd0", "pd1")
    assert config.decode == (decode[0].url,)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--pd", "1", "--prefill", "1", "--decode", "1"), "not both"),
        (("--prefill", "1"), "go together"),
        (("--decode", "2"), "go together"),
        (("--prefill", "1", "--decode", "0"), "at least 1"),
    ],
)
def test_prefill_and_decode_flags_are_checked(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _options(*argv)


def test_a_second_proxy_in_front_of_a_split_launch_splits_too(tmp_path: Path) -> None:
    options = _options("--prefill", "1", "--decode", "1")
    encoders, pd = plan_servers(options, tmp_path, gpus=None)
    config = proxy_config(options, encoders, pd)
    ready = LaunchReady(
        url="http://127.0.0.1:1",
        model="m",
        encoders=config.encoders,
        prefill_decode=config.prefill_decode,
        decode=config.decode,
        workdir=str(tmp_path),
        push_names=config.pd_push_names,
    )
    argv = second_proxy_argv(ready, push=True, limit=None)
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    second = config_from_args(parser.parse_args(argv), environ={})
    assert second.decode == config.decode and second.prefill_decode == config.prefill_decode
