"""Start and stop `vllm serve` processes that run the ECShare connector, on one host.

Used by `ecshare demo --epd` and the end-to-end tests: the command line and
environment of an encoder (ec_producer), a prefill/decode instance
(ec_consumer) or a plain instance, each bound to its own CPU core; readiness;
shutdown of the whole process group; and the connector's counters, read from
the instance's Prometheus endpoint. It starts vLLM as a child process and
imports neither vllm nor torch itself.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

from ecshare.control import generate_keypair

SERVED_MODEL_NAME = "tiny"
METRIC_PREFIX = "vllm:ecshare_"


@dataclass(frozen=True)
class Keys:
    """CURVE key files for one producer and one consumer."""

    producer_secret: Path
    producer_public: Path
    consumer_secret: Path
    consumer_public: Path

    @classmethod
    def generate(cls, directory: Path) -> Keys:
        producer = generate_keypair(directory, "producer")
        consumer = generate_keypair(directory, "consumer")
        return cls(
            Path(producer.secret_path),
            Path(producer.public_path),
            Path(consumer.secret_path),
            Path(consumer.public_path),
        )

    def producer_config(self) -> dict[str, Any]:
        return {
            "server_secret_key_file": str(self.producer_secret),
            "authorized_keys_file": str(self.consumer_public),
        }

    def consumer_config(self) -> dict[str, Any]:
        return {
            "client_secret_key_file": str(self.consumer_secret),
            "server_public_key_file": str(self.producer_public),
        }


# `vllm serve` arguments of the CPU test settings: what the tests, the demo and
# `ecshare launch --cpu` run a small model with on a CPU host (float32, a short context,
# few sequences, no CUDA graphs, two images and no video per prompt).
CPU_ARGS: tuple[str, ...] = (
    "--dtype", "float32", "--max-model-len", "1024",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
    "--enforce-eager", "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
)  # fmt: skip
# Their environment, beside VLLM_CPU_OMP_THREADS_BIND (the instance's core): the CPU
# platform and a 1 GiB KV cache; and, unless the environment says otherwise, no model hub,
# and the worker inside the engine process on one OpenMP thread (it has one core). vLLM's
# multiprocess executor keeps its worker spinning for a second after every step, and
# starts a third process that imports torch and vLLM again (docs/VLLM.md, "CPU per
# request").
CPU_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
CPU_ENV_DEFAULTS: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
}
# An instance's `extra_env` for vLLM's own multiprocess executor on CPU: its worker in a
# process of its own, as vLLM runs it by default there and under tensor parallelism.
WORKER_PROCESS_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# The environment of every instance, unless already set: no usage report, and UCX on the
# loopback device (every instance of one `ServerSpec` host shares this host).
ENV_DEFAULTS: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1", "UCX_NET_DEVICES": "lo"}


KV_PRODUCER = "kv_producer"
KV_CONSUMER = "kv_consumer"


def kv_transfer_config(kv_role: str, cpu: bool) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for a prefill (`KV_PRODUCER`) or decode
    (`KV_CONSUMER`) instance: its NixlConnector, KV buffers in CPU memory on the CPU
    platform, and on decode KV it cannot read recomputed rather than failed."""
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu" if cpu else "cuda",
    }
    if kv_role == KV_CONSUMER:
        config["kv_load_failure_policy"] = "recompute"
    return config


@dataclass
class ServerSpec:
    """One `vllm serve` instance. `ec_role` None means a plain instance, no connector.

    `cpu` applies the CPU test settings (`CPU_ARGS`, `CPU_ENV`, bound to `core`);
    without it the instance gets only its model, name, port and connector, and vLLM's own
    defaults for everything else, on the GPUs `gpus` names (CUDA_VISIBLE_DEVICES)."""

    model: Path
    port: int
    core: int
    ec_role: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    python: str = sys.executable
    served_model_name: str = SERVED_MODEL_NAME
    # Appended last, so that they override the defaults above (argparse keeps the last value).
    extra_args: tuple[str, ...] = ()
    # Over the environment below (a test's fault injection, say).
    extra_env: dict[str, str] = field(default_factory=dict)
    cpu: bool = True
    gpus: str | None = None
    # Set where instances share a GPU, so that each takes its part of the memory.
    gpu_memory_utilization: float | None = None
    # A loopback address of its own lets instances of one host use the same port for
    # something (their item feeds, `ecshare launch`).
    host: str = "127.0.0.1"
    # A network namespace to run in (`ip netns exec`, which also shows UCX that
    # namespace's devices under /sys): a host of its own on one machine.
    netns: str | None = None
    # vLLM's KV connector (NixlConnector) beside ecshare's, for split prefill and decode:
    # "kv_producer" (a prefill instance) or "kv_consumer" (a decode one, which recomputes
    # what it cannot read), its handshake side channel on `host`:`kv_port`.
    kv_role: str | None = None
    kv_port: int | None = None

    def command(self) -> list[str]:
        cmd = [
            *(("ip", "netns", "exec", self.netns) if self.netns is not None else ()),
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(self.port),
        ]  # fmt: skip
        if self.cpu:
            cmd += CPU_ARGS
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.ec_role is not None:
            config = {
                "ec_connector": "ECShareConnector",  # registered by ecshare.vllm.plugin
                "ec_role": self.ec_role,
                "ec_connector_extra_config": self.extra_config,
            }
            cmd += ["--ec-transfer-config", json.dumps(config)]
        if self.kv_role is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.kv_role, self.cpu))]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = {**ENV_DEFAULTS, **(CPU_ENV_DEFAULTS if self.cpu else {}), **os.environ}
        if self.cpu:
            env.update(CPU_ENV, VLLM_CPU_OMP_THREADS_BIND=str(self.core))
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        if self.kv_role is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
            if self.kv_port is not None:
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.kv_port)
        return {**env, **self.extra_env}


class VllmServer:
    """A running `vllm serve` process group; `stop()` ends all of it."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.url = f"http://{spec.host}:{spec.port}"
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServer:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        # Its own session: the API server, engine core and worker are one process
        # group that stop() can end together, even if the API server dies first.
        self.proc = popen_session(
            self.spec.command(),
            env=self.spec.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm on port {self.spec.port} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm on port {self.spec.port} not ready:\n" + self.log_tail())

    def metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """This instance's samples starting with `prefix` (see `read_metrics`)."""
        return read_metrics(self.url, prefix)

    def log_tail(self, nbytes: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
            # The engine core and workers may outlive the API server.
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_metrics(base_url: str, prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """Counter, gauge and histogram sum/count samples whose name starts with `prefix`,
    summed over their labels, keyed by the name without the prefix."""
    out: dict[str, float] = {}
    for name, _, value in _samples(base_url, prefix):
        out[name] = out.get(name, 0.0) + value
    return out


def read_by_label(
    base_url: str, name: str, label: str, prefix: str = METRIC_PREFIX
) -> dict[str, float]:
    """The samples of `name` (without the prefix) summed per value of `label`, e.g.
    `read_by_label(url, "exposed_latency_seconds_count", "mode")` -> {"pushed": 2.0, ...}."""
    out: dict[str, float] = {}
    for found, labels, value in _samples(base_url, prefix):
        if found == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def _samples(base_url: str, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    """(name without the prefix, labels, value) of the instance's samples under `prefix`."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    # Prometheus adds *_created timestamps and cumulative *_bucket samples per label.
    return [
        (sample.name[len(prefix) :], sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefix) and not sample.name.endswith(("_created", "_bucket"))
    ]


def start_all(servers: list[VllmServer], timeout_s: float = 240.0) -> None:
    """Start `servers` together and wait until all are ready; on any failure, stop them all."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise


def post_chat(base_url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST a chat completion, the answer as JSON."""
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        answer: dict[str, Any] = json.load(resp)
        return answer


def popen_session(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **kwargs)` in a session of its own (one process group, for
    ending it whole), weighed by the scheduler no higher than this process (`niceness`).

    Linux with autogroups (`/proc/sys/kernel/sched_autogroup_enabled`) shares the
    CPU between sessions first and weighs a niceness only within its session, and a new
    session's group starts at niceness 0: a `vllm serve` started from `nice -n 19`
    would otherwise take as much CPU as the un-niced work beside it."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    set_session_niceness(proc.pid, niceness())
    return proc


def niceness() -> int:
    """This process's niceness as the scheduler weighs it: its own, or its session's
    (autogroup's) where that is higher."""
    return max(os.getpriority(os.PRIO_PROCESS, 0), _session_niceness(os.getpid()))


def set_session_niceness(pid: int, nice: int) -> None:
    """Weigh the session that process `pid` belongs to at niceness `nice` against other
    sessions, where the kernel groups sessions so (else nothing to do: each process's
    own niceness is what counts). A process may raise it, and lower it to 0."""
    if nice == _session_niceness(pid):
        return
    with contextlib.suppress(OSError):  # no autogroups in this kernel, or pid gone
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _session_niceness(pid: int) -> int:
    """The niceness of `pid`'s session group ("/autogroup-12 nice 0"); 0 where none."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# Ports free_port() has handed out in this process: not handed out twice.
_HANDED_OUT: set[int] = set()
LOWEST_FREE_PORT = 20000


class NoFreePort(RuntimeError):
    """No port of the range asked for is free."""


def free_port(within: tuple[int, int] | None = None) -> int:
    """A TCP port free now on 127.0.0.1, for a process that binds it later, outside the
    kernel's ephemeral range: a `vllm serve` binds its port after seconds of imports, and
    any connection made meanwhile on this host takes its local port from that range (a
    start-up once failed so, "Address already in use"). Never one this process handed
    out before. Where no such port is free, one the kernel picks. `within` (LOW, HIGH):
    one of those ports, whatever the ephemeral range, or `NoFreePort`."""
    if within is not None:
        first, last = within
        candidates = random.sample(range(first, last + 1), last - first + 1)
    else:
        low, high = _ephemeral_range()
        ports = [p for p in range(LOWEST_FREE_PORT, 65536) if not low <= p <= high]
        candidates = random.sample(ports, min(len(ports), 200))
    for port in candidates:
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)
            return port
    if within is not None:
        raise NoFreePort(f"no port of {first}-{last} is free (or not already given out)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        found: int = sock.getsockname()[1]
        return found


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def ensure_tiny_model(directory: Path, python: str = sys.executable) -> Path:
    """The tiny random Qwen2-VL in `directory`, built first (in a child process) if needed."""
    from ecshare.vllm.tiny_model import is_built

    directory = directory.absolute()
    if not is_built(directory):
        # A child process, so that this one never loads torch and transformers.
        subprocess.run(
            [python, "-m", "ecshare.vllm.tiny_model", str(directory)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return directory


def random_image_url(seed: int, width: int = 112, height: int = 84) -> str:
    """A PNG of random pixels as a data URL (112x84 gives 12 image tokens on the tiny model).

    A new seed is a new image, so that no instance's in-memory encoder cache
    already holds it. Written by hand (RGB, 8 bits, no filter) to need no imaging library.
    """
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_request(
    image_urls: list[str], text: str = "Describe the image.", max_tokens: int = 16
) -> dict[str, Any]:
    """A greedy chat completion asking for the generated token ids as well."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": url}} for url in image_urls
    ]
    content.append({"type": "text", "text": text})
    return {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "return_token_ids": True,
    }
