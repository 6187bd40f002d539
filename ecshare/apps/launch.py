"""`ecshare launch`: N encoders, M prefill/decode instances and the proxy, for one model.

Everything runs on this host. With `--prefill P --decode D` in place of `--pd M`, the
prefill/decode instances are P prefill instances, each running vLLM's NixlConnector as
kv_producer beside ecshare, and D decode instances running it as kv_consumer (with
`kv_load_failure_policy` "recompute") beside ecshare as an ec_consumer; each has a KV
handshake side channel of its own (`VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT`), pushes go to
the prefill instances only, and the proxy splits each request over them
(`ecshare.apps.proxy.handoff`). Below, "prefill/decode instances" are the prefill ones.

It generates CURVE keys (one pair shared by the encoders, one by the prefill/decode
instances), gives each encoder a control-plane port of its own and the prefill/decode
instances the list of those endpoints as `trusted_producers` (so that they fetch from
no other producer, whatever a request names). For push (docs/PUSH.md; `--no-push`
turns it off) it names each prefill/decode instance (`push_name` "pd0", "pd1", ...),
which then holds a push session with every encoder from start-up and trusts the
encoders' key to push (its default `push_trusted_keys`), gives the encoders those
names as their `push_targets`, and tells the proxy each instance's name
(`--pd URL=PUSH_NAME`).

For the proxy's item directory it gives every instance a loopback address of its own
(127.0.0.2, 127.0.0.3, ...: its HTTP server, control plane and item feed listen there)
and one `events_port` shared by all, generates the proxy's CURVE key pair and lists its
public key as each instance's `admin_keys_file` (the keys that may subscribe to the
feed), and starts the proxy with `--events-port`, `--events-key` and the encoders' and
prefill/decode instances' public keys (`proxy_argv`; `second_proxy_argv` gives another
proxy in front of a running launch the same, as `ecshare bench serve` starts one per mode).
It writes a tenant secret (mode 0600) beside the keys and gives every proxy it starts
that file (`--tenant-secret-file`), so that all of them salt a tenant's media alike.

It serves the model on the hardware it finds: one GPU per instance, round-robin over
the NVIDIA GPUs it sees, with vLLM's own defaults; or, with `--cpu` or where it finds
no GPU, the CPU test settings of `ecshare.vllm.servers` (`CPU_ARGS`, `CPU_ENV`), each
instance bound to its own core, with its worker in its engine process on one thread
(`CPU_ENV_DEFAULTS`). `--help` lists every argument and variable it passes.

Before it starts anything it checks the model path, each instance's config (as its
connector will decode it), every port set in advance (the proxy's, and any the extra
config fixes) and the API-key file (launch_checks), and prints one line per problem.
It then starts each `vllm serve` (through `ecshare.vllm.servers`) with its
`--ec-transfer-config` on a free port, prints each instance's progress, waits until
every instance answers /health, serves the EPD proxy in front of them and prints one
ready line (`ecshare.apps.ready.LaunchReady`) and where to send requests, with a curl
example. `--proxy-workers N` runs the proxy as N processes on its port
(`ecshare.apps.proxy.workers`). SIGINT or SIGTERM, at any point, stops the proxy and
every instance.

The instances' logs and keys live in `--workdir` (by default a temporary directory,
removed after a clean stop and kept, with its path printed, after a failure). Imports
neither vllm nor torch: the instances are child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn

from ecshare.apps.launch_checks import (
    check_api_key_file,
    check_configs,
    check_model,
    check_multimodal,
    check_ports,
    find_gpus,
    is_loopback,
)
from ecshare.apps.launch_options import GPU_MEMORY_SHARE as GPU_MEMORY_SHARE
from ecshare.apps.launch_options import Device, LaunchOptions
from ecshare.apps.launch_options import add_launch_arguments as add_launch_arguments
from ecshare.apps.launch_options import options_from_args as options_from_args
from ecshare.apps.proxy.config import API_KEY_ENV
from ecshare.apps.proxy.tenants import new_tenant_secret
from ecshare.apps.ready import InstancePorts, LaunchReady, print_ready
from ecshare.config import Config, ConfigError
from ecshare.config.secret_files import write_secret_file
from ecshare.control import generate_keypair
from ecshare.control.keys import PUBLIC_SUFFIX, SECRET_SUFFIX
from ecshare.vllm.servers import (
    KV_CONSUMER,
    KV_PRODUCER,
    Keys,
    NoFreePort,
    ServerSpec,
    VllmServer,
    free_port,
)
from ecshare.vllm.settings import PUSH_TARGETS, TRUSTED_PRODUCERS


def _cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def gpus_for(device: Device) -> list[str] | None:
    """The GPUs instances run on ([] leaves the choice to vLLM), or None for the CPU
    test settings."""
    if device == "cpu":
        return None
    found = find_gpus()
    if device == "auto" and not found:
        return None
    return found


def plan_servers(
    options: LaunchOptions, workdir: Path, gpus: Sequence[str] | Literal["find"] | None = "find"
) -> tuple[list[VllmServer], list[VllmServer]]:
    """(encoders, prefill/decode instances), not started: keys in `workdir`, free ports
    (for the encoders' control planes too), a log per instance, the encoders' endpoints
    as the prefill/decode instances' `trusted_producers`, and, with push, each
    prefill/decode instance's `push_name` (`push_name_of`), the encoders' `push_targets`.
    Each instance gets a GPU of `gpus` round-robin, or, with None, the CPU test settings
    on a core of its own; by default `gpus_for(options.device)`."""
    if gpus == "find":
        gpus = gpus_for(options.device)
    keys = Keys.generate(workdir)
    proxy_key = generate_keypair(workdir, PROXY_KEY_NAME)
    write_secret_file(workdir / TENANT_SECRET_NAME, new_tenant_secret())
    events: dict[str, Any] = {}
    # Instances made to share an address (--ec-extra-config listen_host) could not share
    # one events port: then no item events, and the proxy routes without a directory.
    if "listen_host" not in options.ec_extra_config:
        events = {
            "events_port": free_port(options.port_range),
            "admin_keys_file": str(proxy_key.public_path),
        }
    cores = _cores()
    name = options.served_model_name or options.model
    model = Path(options.model)
    total = options.encoders + options.prefill_decode + options.decode
    per_gpu = Counter(gpus[n % len(gpus)] for n in range(total)) if gpus else Counter()

    def server(
        role: str, index: int, n: int, extra: dict[str, Any], kv_role: str | None = None
    ) -> VllmServer:
        gpu = gpus[n % len(gpus)] if gpus else None
        share = per_gpu[gpu] if gpu is not None else 1
        host = instance_host(n)
        spec = ServerSpec(
            model,
            free_port(options.port_range),
            host=host,
            core=cores[n % len(cores)],
            ec_role=role,
            extra_config={**extra, "listen_host": host, **events, **options.ec_extra_config},
            served_model_name=name,
            extra_args=options.extra_vllm_args,
            cpu=gpus is None,
            gpus=gpu,
            gpu_memory_utilization=(
                int(GPU_MEMORY_SHARE / share * 100) / 100 if share > 1 else None
            ),
            kv_role=kv_role,
            kv_port=free_port(options.port_range) if kv_role is not None else None,
        )
        kind = _KINDS[kv_role] if role == "ec_consumer" else "encoder"
        return VllmServer(spec, workdir / f"{kind}{index}.log")

    names = [push_name_of(i) for i in range(options.prefill_decode)] if options.push else []
    producer = keys.producer_config()
    if names:
        producer[PUSH_TARGETS] = names
    encoders = [
        server("ec_producer", i, i, {**producer, "listen_port": free_port(options.port_range)})
        for i in range(options.encoders)
    ]
    consumer = keys.consumer_config()
    trusted = [producer_endpoint(s.spec.extra_config) for s in encoders]
    if all(trusted):
        consumer[TRUSTED_PRODUCERS] = trusted
    else:
        print(
            "ecshare launch: an encoder's endpoint is not known in advance (listen_port 0 "
            "or a wildcard host without advertise_host); prefill/decode instances will "
            "trust any producer that authenticates",
            file=sys.stderr,
        )
    split = options.decode > 0
    pd = [
        server(
            "ec_consumer",
            i,
            options.encoders + i,
            {**consumer, "push_name": names[i]} if names else consumer,
            KV_PRODUCER if split else None,
        )
        for i in range(options.prefill_decode)
    ]
    # A decode instance runs ecshare's connector too: it is what lets vLLM take the
    # media-free request, and what fetches the items where the KV cannot be read and it
    # recomputes the prompt. Nothing is pushed to it.
    pd += [
        server(
            "ec_consumer", i, options.encoders + options.prefill_decode + i, consumer, KV_CONSUMER
        )
        for i in range(options.decode)
    ]
    return encoders, pd


# The log stem, and name, of a prefill/decode instance by its KV role.
_KINDS = {None: "prefill_decode", KV_PRODUCER: "prefill", KV_CONSUMER: "decode"}


def split_roles(pd: Sequence[VllmServer]) -> tuple[list[VllmServer], list[VllmServer]]:
    """(prefill/decode or prefill instances, decode instances) of `plan_servers`' second list."""
    decode = [s for s in pd if s.spec.kv_role == KV_CONSUMER]
    return [s for s in pd if s.spec.kv_role != KV_CONSUMER], decode


PROXY_KEY_NAME = "proxy"  # the proxy's key pair in the workdir: proxy.key, proxy.key_secret
# The secret every proxy in front of the instances keys tenant salts under, in the workdir.
TENANT_SECRET_NAME = "tenant_secret"
# While an instance loads, launch says how long it has waited, and the last line of its log,
# this often.
PROGRESS_EVERY_S = 15.0


def instance_host(n: int) -> str:
    """The loopback address launch gives its instance number `n` (encoders first)."""
    return f"127.0.0.{2 + n % 250}"


def push_name_of(index: int) -> str:
    """The push name launch gives its prefill/decode instance number `index`."""
    return f"pd{index}"


def pd_push_names(pd: list[VllmServer]) -> tuple[str, ...]:
    """The prefill/decode instances' push names, in order; () when they take no push."""
    names = tuple(str(s.spec.extra_config.get("push_name") or "") for s in pd)
    return names if all(names) else ()


def producer_endpoint(extra: dict[str, Any]) -> str | None:
    """The endpoint a producer with this `ec_connector_extra_config` advertises, when it is
    known before it starts (a fixed port, a host peers can reach)."""
    port = int(extra.get("listen_port") or 0)
    hosts = {k: extra[k] for k in ("listen_host", "advertise_host") if extra.get(k)}
    try:
        host = Config.from_dict(hosts).advertised_host
    except ConfigError:  # a wildcard listen_host and no advertise_host: peers cannot know
        return None
    if port == 0 or host in ("0.0.0.0", "::", "*", "[::]"):
        return None
    return f"tcp://{host}:{port}"


def instance_name(server: VllmServer) -> str:
    """encoder0, prefill_decode1, ...: the stem of its log."""
    return server.log_path.stem


def proxy_config(options: LaunchOptions, encoders: list[VllmServer], pd: list[VllmServer]) -> Any:
    """The proxy's config, through `ecshare proxy`'s own flags (so that --api-key-file
    means there what it means here), or ConfigError naming the flag."""
    from ecshare.apps.proxy.config import add_proxy_arguments, config_from_args

    first, decode = split_roles(pd)
    argv = proxy_argv(
        [s.url for s in encoders],
        [s.url for s in first],
        pd_push_names(first),
        host=options.host,
        port=options.port,
        workers=options.proxy_workers,
        pd_media=options.pd_media,
        api_key_file=options.api_key_file,
        limit=instances_mm_limit((encoders or pd)[0].spec.command()),
        workdir=pd[0].log_path.parent,  # where plan_servers wrote the keys
        events_port=events_port_of([*encoders, *pd]),
        decode=[s.url for s in decode],
    )
    parser = _ProxyFlags(prog="ecshare launch", add_help=False)
    add_proxy_arguments(parser)
    args, unknown = parser.parse_known_args([*argv, *options.extra_proxy_args])
    if unknown:
        raise ConfigError(
            "--extra-proxy-args",
            f"not a flag of ecshare proxy: {shlex.join(unknown)} (see ecshare proxy --help)",
        )
    return config_from_args(args)


class _ProxyFlags(argparse.ArgumentParser):
    """`ecshare proxy`'s flags, read for launch: a bad value is a ConfigError naming
    --extra-proxy-args (launch's own flags give none), not an exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError("--extra-proxy-args", message)


def proxy_argv(
    encoders: Sequence[str],
    pd: Sequence[str],
    push_names: Sequence[str],
    *,
    host: str,
    port: int,
    workers: int,
    pd_media: str,
    api_key_file: str | None,
    limit: str | None,
    workdir: Path,
    events_port: int | None,
    decode: Sequence[str] = (),
) -> list[str]:
    """The `ecshare proxy` flags of launch's proxy, in front of instances at these URLs
    (`push_names`: () without push; with `decode`, `pd` are prefill instances), with the
    keys and the tenant secret launch wrote in `workdir`."""
    names = tuple(push_names) or ("",) * len(pd)
    argv = [
        "--encoder", *encoders,
        "--prefill" if decode else "--pd",
        *(f"{u}={n}" if n else u for u, n in zip(pd, names, strict=True)),
        *(("--decode", *decode) if decode else ()),
        "--host", host, "--port", str(port),
        "--workers", str(workers), "--pd-media", pd_media,
    ]  # fmt: skip
    if api_key_file is not None:
        argv += ["--api-key-file", api_key_file]
    if limit is not None:
        # The proxy refuses up front what the instances would refuse after an encoder call.
        argv += ["--limit-mm-per-prompt", limit]
    if events_port is not None:
        # Keys.generate's names: encoders publish under the producer's key, the
        # prefill/decode instances under the consumer's.
        argv += [
            "--events-port", str(events_port),
            "--events-key", str(workdir / f"{PROXY_KEY_NAME}{SECRET_SUFFIX}"),
            "--events-encoder-key", str(workdir / f"producer{PUBLIC_SUFFIX}"),
            "--events-pd-key", str(workdir / f"consumer{PUBLIC_SUFFIX}"),
        ]  # fmt: skip
    # One secret for every proxy in front of these instances, so that a tenant's salt
    # (under --tenant-isolation) is the same whichever proxy it comes through.
    argv += ["--tenant-secret-file", str(workdir / TENANT_SECRET_NAME)]
    return argv


def second_proxy_argv(ready: LaunchReady, *, push: bool, limit: str | None) -> list[str]:
    """The flags of one more `ecshare proxy` in front of a running launch's instances, on
    a free port of 127.0.0.1, one worker, media left out: launch's own, with its push
    names where `push` (without them it asks the encoders for no push, as launch's
    proxy does with --no-push)."""
    return proxy_argv(
        ready.encoders,
        ready.prefill_decode,
        ready.push_names if push else (),
        host="127.0.0.1",
        port=0,
        workers=1,
        pd_media="omit",
        api_key_file=None,
        limit=limit,
        workdir=Path(ready.workdir),
        events_port=ready.events_port,
        decode=ready.decode,
    )


def events_port_of(servers: Sequence[VllmServer]) -> int | None:
    """The `events_port` every one of `servers` publishes on, or None where they do not
    share one (set apart by --ec-extra-config, or unset)."""
    ports = {s.spec.extra_config.get("events_port") for s in servers}
    port = ports.pop() if len(ports) == 1 else None
    return port if isinstance(port, int) and port > 0 else None


def instances_mm_limit(command: list[str]) -> str | None:
    """The `--limit-mm-per-prompt` JSON an instance's command line ends up with (the last
    one given wins, as in vLLM's parser), or None for vLLM's default."""
    value = None
    for i, arg in enumerate(command):
        if arg == "--limit-mm-per-prompt" and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith("--limit-mm-per-prompt="):
            value = arg.split("=", 1)[1]
    return value


def preflight(
    options: LaunchOptions, encoders: list[VllmServer], pd: list[VllmServer]
) -> tuple[list[str], Any]:
    """(every problem found before anything starts, one line each; the proxy's config)."""
    servers = [*encoders, *pd]
    offline = servers[0].spec.env().get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    problems = check_model(options.model, offline) or check_multimodal(options.model)
    problems += check_configs({instance_name(s): s.spec.extra_config for s in servers})
    fixed = [("the proxy", options.host, options.port, "--port")]
    for s in servers:
        extra = s.spec.extra_config
        host = str(extra.get("listen_host") or "127.0.0.1")
        if s in encoders and "listen_port" in options.ec_extra_config:
            fixed.append((instance_name(s), host, _int(extra["listen_port"]), "--ec-extra-config"))
        if extra.get("metrics_port"):
            fixed.append((instance_name(s), host, _int(extra["metrics_port"]), "--ec-extra-config"))
    problems += check_ports(fixed)
    problems += check_api_key_file(options.api_key_file)
    config = None
    try:
        config = proxy_config(options, encoders, pd)
    except ConfigError as exc:
        if not any(p.startswith(exc.key or "--") for p in problems):
            problems.append(f"{exc.key}: {exc.detail}" if exc.key else str(exc))
    return problems, config


def _wait_ready(server: VllmServer, t0: float, deadline: float) -> None:
    """Wait for `server` to answer /health, saying every `PROGRESS_EVERY_S` how long it has
    taken and the last line of its log (vLLM prints nothing of ours while it loads)."""
    while True:
        left = deadline - time.monotonic()
        try:
            server.wait_ready(max(1.0, min(left, PROGRESS_EVERY_S)))
            return
        except TimeoutError:
            if left <= PROGRESS_EVERY_S:
                raise
        _say(
            f"waiting for {instance_name(server)} ({time.monotonic() - t0:.0f} s of "
            f"--ready-timeout {deadline - t0:.0f}): {last_log_line(server)}"
        )


def last_log_line(server: VllmServer, width: int = 160) -> str:
    """The last line `server` logged, cut to `width`; what is there where it logged none."""
    lines = [line.strip() for line in server.log_tail(4000).splitlines() if line.strip()]
    if not lines:
        return "nothing in its log yet"
    last = lines[-1]
    return last if len(last) <= width else last[: width - 3] + "..."


def instance_ports(servers: Sequence[VllmServer]) -> dict[str, InstancePorts]:
    """Where each instance listens, by name: vLLM's API and /metrics, an encoder's control
    plane and every instance's item events, as its config sets them."""
    out = {}
    for server in servers:
        extra = server.spec.extra_config
        host = str(extra.get("listen_host") or "127.0.0.1")
        control = extra.get("listen_port") if server.spec.ec_role == "ec_producer" else None
        events = extra.get("events_port")
        out[instance_name(server)] = InstancePorts(
            url=server.url,
            metrics=server.url + "/metrics",
            control=f"tcp://{host}:{control}" if control else None,
            events=f"tcp://{host}:{events}" if events else None,
        )
    return out


def where_each_listens(url: str, instances: Mapping[str, InstancePorts]) -> list[str]:
    """The lines that say where the proxy and each instance listen, and their /metrics."""
    lines = [f"proxy {url}, metrics {url}/metrics"]
    for name, ports in instances.items():
        line = f"{name} {ports.url}, metrics {ports.metrics}"
        if ports.control:
            line += f", control {ports.control}"
        if ports.events:
            line += f", item events {ports.events}"
        lines.append(line)
    return lines


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def send_requests_here(url: str, model: str, api_key_file: str | None) -> str:
    """The lines that tell a person where to send requests, with a curl example."""
    # The file's first key (a line is `KEY` or `KEY TENANT`, `#` starts a comment).
    first_key = f"awk '!/^#/ && NF {{print $1; exit}}' {shlex.quote(api_key_file or '')}"
    auth = f' -H "Authorization: Bearer $({first_key})"' if api_key_file else ""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    )
    return (
        f"ecshare launch: send requests here: {url}/v1/chat/completions (OpenAI API), e.g.\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(body)}"
    )


class _Stop(Exception):
    """SIGTERM (or SIGINT) while the instances start."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _say(text: str, *, err: bool = False) -> None:
    print(f"ecshare launch: {text}", file=sys.stderr if err else sys.stdout, flush=True)


def run_launch(options: LaunchOptions) -> int:
    """Check, start everything, serve until SIGINT/SIGTERM, stop everything; the exit
    status (2: a problem found before anything started)."""
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    temporary = options.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ecshare-launch-")) if temporary else options.workdir
    assert workdir is not None
    servers: list[VllmServer] = []
    status = 1
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        status = _run(options, workdir, servers)
        return status
    except _Stop as exc:
        _say(f"{exc}, stopping")
        status = 0
        return status
    except (RuntimeError, TimeoutError, OSError) as exc:
        _say(str(exc), err=True)
        status = 1
        return status
    finally:
        # No second signal may cut the teardown short and leave instances behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for server in reversed(servers):
            server.stop()
        if servers:
            _say("all instances stopped")
        if status == 1:
            _say(f"logs kept in {workdir}", err=True)
        elif temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(options: LaunchOptions, workdir: Path, servers: list[VllmServer]) -> int:
    from ecshare.apps.proxy.server import serve_until_signalled
    from ecshare.apps.proxy.workers import supervise

    try:
        encoders, pd = plan_servers(options, workdir)
    except NoFreePort as exc:
        _say(f"--port-range: {exc}", err=True)
        _say("nothing started", err=True)
        return 2
    if not is_loopback(options.host) and not (options.api_key_file or os.environ.get(API_KEY_ENV)):
        _say(
            f"warning: the proxy listens on {options.host}, beyond loopback, and requires no "
            f"API key: anyone who reaches port {options.port} can use the model; give "
            "--api-key-file",
            err=True,
        )
    problems, config = preflight(options, encoders, pd)
    if problems:
        for problem in problems:
            _say(problem, err=True)
        _say("nothing started", err=True)
        return 2
    gpus = sorted({s.spec.gpus for s in (*encoders, *pd) if s.spec.gpus is not None})
    if encoders[0].spec.cpu:
        where = "the CPU test settings (see --help)"
    elif gpus:
        where = "GPU " + ", ".join(gpus)
    else:
        where = "the devices vLLM picks (no NVIDIA GPU found)"
    first, decode = split_roles(pd)
    if decode:
        kinds = f"{len(first)} prefill and {len(decode)} decode instance(s)"
    else:
        kinds = f"{len(pd)} prefill/decode instance(s)"
    _say(f"{len(encoders)} encoder(s) and {kinds} on {where}")
    t0 = time.monotonic()
    for server in (*encoders, *pd):
        servers.append(server)
        server.start()
        on = f"GPU {server.spec.gpus}" if server.spec.gpus else f"core {server.spec.core}"
        _say(
            f"starting {instance_name(server)} ({server.spec.ec_role}) on {server.url}, "
            f"{on}, log {server.log_path}"
        )
    deadline = t0 + options.ready_timeout_s
    for server in servers:
        _wait_ready(server, t0, deadline)
        _say(f"{instance_name(server)} ready after {time.monotonic() - t0:.0f} s")
    model = options.served_model_name or options.model
    instances = instance_ports(servers)

    def ready(url: str, *_: object) -> None:
        print_ready(
            LaunchReady(
                url=url,
                model=model,
                encoders=config.encoders,
                prefill_decode=config.prefill_decode,
                decode=config.decode,
                workdir=str(workdir),
                push_names=config.pd_push_names,
                events_port=config.events_port,
                metrics=url + "/metrics",
                instances=instances,
            )
        )
        for line in where_each_listens(url, instances):
            _say(line)
        print(send_requests_here(url, model, options.api_key_file), flush=True)

    status = 0
    if config.workers > 1:
        status = supervise(config, ready)
    else:
        asyncio.run(serve_until_signalled(config, lambda r: ready(r.url)))
    _say("stopping")
    return status
