"""`ecshare launch`'s options: its flags, their help (which lists every argument and
variable launch passes to an instance, read from `ecshare.vllm.servers`), and
`LaunchOptions`, which they decode into, each bad value a ValueError naming its flag."""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ecshare.apps.proxy.config import API_KEY_ENV, PD_MEDIA
from ecshare.vllm.servers import CPU_ARGS, CPU_ENV, CPU_ENV_DEFAULTS, ENV_DEFAULTS

Device = Literal["auto", "cpu", "gpu"]
# The share of a GPU's memory vLLM takes by default, split between instances on one GPU.
GPU_MEMORY_SHARE = 0.9


@dataclass
class LaunchOptions:
    model: str
    encoders: int = 1
    prefill_decode: int = 1  # with decode > 0: prefill instances (--prefill)
    decode: int = 0  # decode instances (--decode), each prefill's KV read by vLLM's connector
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
    device: Device = "auto"
    api_key_file: str | None = None
    extra_proxy_args: tuple[str, ...] = ()
    port_range: tuple[int, int] | None = None  # the instances' ports: LOW, HIGH


def _epilog() -> str:
    indent = " " * 11
    cpu_args = textwrap.fill(
        shlex.join(CPU_ARGS),
        88,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
    )
    cpu_env = textwrap.fill(
        " ".join(f"{k}={v}" for k, v in CPU_ENV.items())
        + " VLLM_CPU_OMP_THREADS_BIND=(its own core, round-robin), and "
        + " ".join(f"{k}={v}" for k, v in CPU_ENV_DEFAULTS.items())
        + " where not already set",
        88,
        initial_indent=indent,
        subsequent_indent=indent,
    )
    always = " ".join(f"{k}={v}" for k, v in ENV_DEFAULTS.items())
    return f"""\
What each instance is given:
  python -m vllm.entrypoints.openai.api_server --model MODEL --served-model-name NAME
    --host 127.0.0.1 --port (a free port) --ec-transfer-config (ECShareConnector, its
    role, generated keys, trusted_producers/push_targets/push_name, a listen_port per
    encoder; --ec-extra-config entries over these), then --extra-vllm-args, which
    override all.
  Environment, where not already set: {always}.

Hardware (default: --gpu where an NVIDIA GPU is found, by CUDA_VISIBLE_DEVICES or
/dev/nvidiaN; else --cpu):
  --gpu  one GPU per instance, round-robin (CUDA_VISIBLE_DEVICES); where K instances
         share a GPU, --gpu-memory-utilization {GPU_MEMORY_SHARE}/K; vLLM's defaults
         for all else.
  --cpu  the CPU test settings, for small models:
{cpu_args}
         environment:
{cpu_env}.

Before starting anything it checks the model path, each instance's config, the ports
set in advance (--port, and any the extra config fixes) and --api-key-file, and prints
one line per problem. Logs, keys and the proxies' tenant secret are in --workdir: a
temporary directory by default, removed after a clean stop and kept (its path printed)
after a failure."""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.add_argument(
        "--model", required=True, help="model directory or hub name, served by every instance"
    )
    parser.add_argument(
        "--encoders", type=int, default=1, metavar="N", help="encoder instances (1)"
    )
    parser.add_argument(
        "--pd", type=int, default=None, metavar="M", help="prefill/decode instances (1)"
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="P",
        help="prefill instances, in place of --pd: each request is prefilled on one and "
        "decoded on a --decode instance, its KV passed by vLLM's NixlConnector (E->P->D)",
    )
    parser.add_argument(
        "--decode", type=int, default=None, metavar="D", help="decode instances, with --prefill"
    )
    hardware = parser.add_mutually_exclusive_group()
    hardware.add_argument(
        "--cpu",
        dest="device",
        action="store_const",
        const="cpu",
        default="auto",
        help="the CPU test settings (below), even where a GPU is found",
    )
    hardware.add_argument(
        "--gpu",
        dest="device",
        action="store_const",
        const="gpu",
        help="vLLM's own defaults on the GPUs found (below), even where none is found",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the proxy listens on (127.0.0.1); the instances listen on 127.0.0.1",
    )
    parser.add_argument(
        "--port", type=int, default=8080, help="proxy port, 0 for a free one (8080)"
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="the proxy requires this file's key as `Authorization: Bearer` on /v1/* "
        f"(ecshare proxy --api-key-file; else ${API_KEY_ENV}); only its owner may read it "
        "(chmod 600). Without one, launch warns when --host is beyond loopback",
    )
    parser.add_argument(
        "--proxy-workers",
        type=int,
        default=1,
        metavar="N",
        help="proxy processes sharing its port (ecshare proxy --workers) (1)",
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
        "--port-range",
        default=None,
        metavar="LOW-HIGH",
        help="the ports the instances take (vLLM's API, encoders' control planes, item "
        "events), e.g. 30000-30099, for a firewall that opens only those (default: free "
        "ports from 20000 up, outside the kernel's ephemeral range)",
    )
    parser.add_argument(
        "--extra-proxy-args",
        default="",
        metavar="ARGS",
        help="more `ecshare proxy` flags for launch's proxy, as one shell-quoted string, e.g. "
        "'--max-in-flight-per-pd 4'; they come after launch's own, and a flag given twice "
        "takes the later",
    )
    parser.add_argument(
        "--ec-extra-config",
        default="{}",
        metavar="JSON",
        help="ec_connector_extra_config entries for every instance (docs/CONFIG.md), e.g. "
        '\'{"region_bytes": "2GiB"}\'',
    )
    parser.add_argument("--workdir", default=None, help="keys and logs (default: a temp dir)")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="longest wait for the instances to answer /health (600)",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The options of parsed flags, or ValueError naming the flag."""
    split = args.prefill is not None or args.decode is not None
    if split and args.pd is not None:
        raise ValueError("give --pd M (combined instances) or --prefill P --decode D, not both")
    if split and (args.prefill is None or args.decode is None):
        raise ValueError("--prefill P and --decode D go together")
    first = (args.prefill if split else args.pd) or 0
    if args.pd is None and not split:
        first = 1
    if args.encoders < 1 or first < 1 or (split and args.decode < 1):
        flags = "--prefill and --decode" if split else "--pd"
        raise ValueError(f"--encoders and {flags} must be at least 1")
    if args.proxy_workers < 1:
        raise ValueError("--proxy-workers must be at least 1")
    try:
        extra = json.loads(args.ec_extra_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--ec-extra-config: not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ValueError(
            f"--ec-extra-config: got {args.ec_extra_config!r}, expected a JSON object of "
            'config keys, e.g. \'{"region_bytes": "2GiB"}\''
        )
    try:
        extra_args = tuple(shlex.split(args.extra_vllm_args))
    except ValueError as exc:
        raise ValueError(f"--extra-vllm-args: {exc}") from None
    try:
        proxy_args = tuple(shlex.split(args.extra_proxy_args))
    except ValueError as exc:
        raise ValueError(f"--extra-proxy-args: {exc}") from None
    port_range = _port_range(args.port_range) if args.port_range else None
    return LaunchOptions(
        model=args.model,
        encoders=args.encoders,
        prefill_decode=first,
        decode=args.decode if split else 0,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        extra_vllm_args=extra_args,
        ec_extra_config=extra,
        workdir=Path(args.workdir) if args.workdir else None,
        ready_timeout_s=args.ready_timeout,
        proxy_workers=args.proxy_workers,
        pd_media=args.pd_media,
        push=args.push,
        device=args.device,
        api_key_file=args.api_key_file,
        extra_proxy_args=proxy_args,
        port_range=port_range,
    )


def _port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        first = last = -1
    if not sep or not 1024 <= first <= last <= 65535:
        raise ValueError(
            f"--port-range: got {text!r}, expected LOW-HIGH within 1024-65535, e.g. 30000-30099"
        )
    return first, last
