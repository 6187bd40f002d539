"""`ecshare launch`: N encoders, M prefill/decode instances and the proxy, for one model.

Everything runs on this host.

It generates CURVE keys (one pair shared by the encoders, one by the prefill/decode
instances), gives each encoder a control-plane port of its own and the prefill/decode
instances the list of those endpoints as `trusted_producers` (so that they fetch from
no other producer, whatever a request names). For push (docs/PUSH.md; `--no-push`
turns it off) it names each prefill/decode instance (`push_name` "pd0", "pd1", ...),
which then holds a push session with every encoder from start-up and trusts the
encoders' key to push (its default `push_trusted_keys`), gives the encoders those
names as their `push_targets`, and tells the proxy each instance's name
(`--pd URL=PUSH_NAME`). It starts each `vllm serve` (through
`ecshare.vllm.servers`) with its `--ec-transfer-config` on a free port and its own CPU
core (round-robin over the cores this process may use), waits until every instance
answers /health, then serves the EPD proxy in front of them and prints one ready line
(`ecshare.apps.ready.LaunchReady`, with the proxy URL). `--proxy-workers N` runs the
proxy as N processes on its port (`ecshare.apps.proxy.workers`). SIGINT or SIGTERM, at any
point, stops the proxy and every instance.

The instances' logs and keys live in `--workdir` (a temporary directory, removed at exit,
when none is given). Imports neither vllm nor torch: the instances are child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ecshare.apps.proxy.config import PD_MEDIA
from ecshare.apps.ready import LaunchReady, print_ready
from ecshare.vllm.servers import Keys, ServerSpec, VllmServer, free_port
from ecshare.vllm.settings import PUSH_TARGETS, TRUSTED_PRODUCERS


@dataclass
class LaunchOptions:
    model: str
    encoders: int = 1
    prefill_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    served_model_name: str | None = None
    extra_vllm_args: tuple[str, ...] = ()
    ec_extra_config: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    ready_timeout_s: float = 600.0
    proxy_workers: int = 1
    pd_media: str = "omit"
    push: bool = True


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="model path or name, served by every instance"
    )
    parser.add_argument("--encoders", type=int, default=1, metavar="N", help="encoder instances")
    parser.add_argument("--pd", type=int, default=1, metavar="M", help="prefill/decode instances")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    parser.add_argument("--port", type=int, default=8080, help="proxy port (0: a free one)")
    parser.add_argument(
        "--proxy-workers",
        type=int,
        default=1,
        metavar="N",
        help="proxy processes sharing its port (ecshare proxy --workers)",
    )
    parser.add_argument(
        "--pd-media",
        choices=PD_MEDIA,
        default="omit",
        help="what prefill/decode gets of encoded media (ecshare proxy --pd-media): omit, "
        "its placeholder metadata only; keep, the media as sent (omit)",
    )
    parser.add_argument(
        "--no-push",
        dest="push",
        action="store_false",
        help="encoders do not push items into prefill/decode; it pulls every one",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: --model)"
    )
    parser.add_argument(
        "--extra-vllm-args",
        default="",
        metavar="ARGS",
        help="more `vllm serve` arguments for every instance, as one shell-quoted string; "
        "they come last and override the defaults",
    )
    parser.add_argument(
        "--ec-extra-config",
        default="{}",
        metavar="JSON",
        help="ec_connector_extra_config entries for every instance, e.g. "
        "'{\"region_bytes\": 67108864}'",
    )
    parser.add_argument("--workdir", default=None, help="keys and logs (default: a temp dir)")
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the instances"
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    if args.encoders < 1 or args.pd < 1:
        raise ValueError("--encoders and --pd must be at least 1")
    if args.proxy_workers < 1:
        raise ValueError("--proxy-workers must be at least 1")
    extra = json.loads(args.ec_extra_config)
    if not isinstance(extra, dict):
        raise ValueError("--ec-extra-config must be a JSON object")
    return LaunchOptions(
        model=args.model,
        encoders=args.encoders,
        prefill_decode=args.pd,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        extra_vllm_args=tuple(shlex.split(args.extra_vllm_args)),
        ec_extra_config=extra,
        workdir=Path(args.workdir) if args.workdir else None,
        ready_timeout_s=args.ready_timeout,
        proxy_workers=args.proxy_workers,
        pd_media=args.pd_media,
        push=args.push,
    )


def _cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_servers(
    options: LaunchOptions, workdir: Path
) -> tuple[list[VllmServer], list[VllmServer]]:
    """(encoders, prefill/decode instances), not started: keys in `workdir`, free ports
    (for the encoders' control planes too), cores round-robin, a log per instance, the
    encoders' endpoints as the prefill/decode instances' `trusted_producers`, and, with
    push, each prefill/decode instance's `push_name` (`push_name_of`), the encoders'
    `push_targets`."""
    keys = Keys.generate(workdir)
    cores = _cores()
    name = options.served_model_name or options.model
    model = Path(options.model)

    def server(role: str, index: int, n: int, extra: dict[str, Any]) -> VllmServer:
        spec = ServerSpec(
            model,
            free_port(),
            core=cores[n % len(cores)],
            ec_role=role,
            extra_config={**extra, **options.ec_extra_config},
            served_model_name=name,
            extra_args=options.extra_vllm_args,
        )
        kind = "encoder" if role == "ec_producer" else "prefill_decode"
        return VllmServer(spec, workdir / f"{kind}{index}.log")

    names = [push_name_of(i) for i in range(options.prefill_decode)] if options.push else []
    producer = keys.producer_config()
    if names:
        producer[PUSH_TARGETS] = names
    encoders = [
        server("ec_producer", i, i, {**producer, "listen_port": free_port()})
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
    pd = [
        server(
            "ec_consumer",
            i,
            options.encoders + i,
            {**consumer, "push_name": names[i]} if names else consumer,
        )
        for i in range(options.prefill_decode)
    ]
    return encoders, pd


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
    host = str(extra.get("advertise_host") or extra.get("listen_host") or "127.0.0.1")
    if port == 0 or host in ("0.0.0.0", "::", "*", "[::]"):
        return None
    return f"tcp://{host}:{port}"


class _Stop(Exception):
    """SIGTERM (or SIGINT) while the instances start."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="ecshare-launch-") as tmp:
        yield Path(tmp)


def run_launch(options: LaunchOptions) -> int:
    """Start everything, serve until SIGINT/SIGTERM, stop everything; the exit status."""
    from ecshare.apps.proxy.config import ProxyConfig
    from ecshare.apps.proxy.server import serve_until_signalled
    from ecshare.apps.proxy.workers import supervise

    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    servers: list[VllmServer] = []
    try:
        with _workdir(options.workdir) as workdir:
            try:
                encoders, pd = plan_servers(options, workdir)
                servers = [*encoders, *pd]
                t0 = time.monotonic()
                for server in servers:
                    server.start()
                    print(
                        f"ecshare launch: {server.spec.ec_role} on {server.url} "
                        f"(core {server.spec.core}, log {server.log_path})",
                        flush=True,
                    )
                deadline = t0 + options.ready_timeout_s
                for server in servers:
                    server.wait_ready(max(1.0, deadline - time.monotonic()))
                print(
                    f"ecshare launch: instances ready in {time.monotonic() - t0:.0f} s", flush=True
                )
                config = ProxyConfig(
                    encoders=tuple(s.url for s in encoders),
                    prefill_decode=tuple(s.url for s in pd),
                    pd_push_names=pd_push_names(pd),
                    host=options.host,
                    port=options.port,
                    workers=options.proxy_workers,
                    pd_media=options.pd_media,
                )

                def ready(url: str, *_: object) -> None:
                    print_ready(
                        LaunchReady(
                            url=url,
                            model=options.served_model_name or options.model,
                            encoders=config.encoders,
                            prefill_decode=config.prefill_decode,
                            workdir=str(workdir),
                            push_names=config.pd_push_names,
                        )
                    )

                status = 0
                if config.workers > 1:
                    status = supervise(config, ready)
                else:
                    asyncio.run(serve_until_signalled(config, lambda r: ready(r.url)))
                print("ecshare launch: stopping", flush=True)
                return status
            except _Stop as exc:
                print(f"ecshare launch: {exc}, stopping", flush=True)
                return 0
            except (RuntimeError, TimeoutError, OSError) as exc:
                print(f"ecshare launch: {exc}", file=sys.stderr, flush=True)
                return 1
            finally:
                # No second signal may cut the teardown short and leave instances behind.
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)
                for server in reversed(servers):
                    server.stop()
                if servers:
                    print("ecshare launch: all instances stopped", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
