"""The `ecshare` command and its subcommands; `ecshare --help` lists every one."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from ecshare.config import ConfigError, add_config_arguments, load_config

# Re-exported: callers that start `ecshare serve` look for its ready line by this prefix.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecshare",
        description="Share multimodal encoder outputs between vLLM instances.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`ecshare COMMAND --help` tells more of each; docs/ holds the rest.",
    )
    parser.add_argument("--version", action="version", version=f"ecshare {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    serve = sub.add_parser("serve", help="run a producer with synthetic or file-loaded entries")
    serve.add_argument(
        "--synthetic",
        default="",
        metavar="SPEC",
        help="entries to create, as SIZE:COUNT pairs, e.g. '64KiB:4,4MiB:2'",
    )
    serve.add_argument(
        "--load",
        nargs="*",
        default=[],
        metavar="FILE.npy",
        help="entries to load from .npy files (mm_hash = file stem)",
    )
    serve.add_argument(
        "--fingerprint",
        default="ecshare-synthetic",
        help="compatibility fingerprint consumers must present",
    )
    serve.add_argument(
        "--entry-checksums", action="store_true", help="record an xxh3-64 checksum with every entry"
    )
    add_config_arguments(serve)

    fetch = sub.add_parser("fetch", help="fetch entries from a producer")
    fetch.add_argument("address", help="producer endpoint, e.g. tcp://127.0.0.1:5555")
    fetch.add_argument("hashes", nargs="+", metavar="MM_HASH")
    fetch.add_argument("--fingerprint", default="ecshare-synthetic")
    fetch.add_argument(
        "--verify-synthetic",
        action="store_true",
        help="check fetched bytes against `serve --synthetic` content",
    )
    fetch.add_argument("--timeout", type=float, default=30.0, help="seconds to wait in all")
    fetch.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_arguments(fetch)

    keys = sub.add_parser("keys", help="CURVE key management")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser("generate", help="write a key pair (NAME.key, NAME.key_secret)")
    gen.add_argument("directory")
    gen.add_argument("--name", default="ecshare")
    gen.add_argument("--force", action="store_true", help="overwrite existing files")

    demo = sub.add_parser("demo", help="two processes on 127.0.0.1 move entries through the stack")
    demo.add_argument(
        "--epd",
        action="store_true",
        help="run vLLM as an encoder and a prefill/decode instance sharing through ecshare "
        "(needs vllm and nixl)",
    )

    from ecshare.apps.proxy.config import add_proxy_arguments

    proxy = sub.add_parser("proxy", help="the EPD HTTP proxy: encoders first, then prefill/decode")
    add_proxy_arguments(proxy)

    from ecshare.apps.launch import add_launch_arguments

    launch = sub.add_parser(
        "launch",
        help="start N encoder and M prefill/decode vLLM instances and the proxy, on this host",
    )
    add_launch_arguments(launch)

    from ecshare.apps.ops.doctor import add_doctor_arguments
    from ecshare.apps.ops.status_query import add_status_arguments

    doctor = sub.add_parser("doctor", help="check this machine and config; say how to fix them")
    add_doctor_arguments(doctor)
    status = sub.add_parser("status", help="ask a running producer (as an admin key) what it holds")
    add_status_arguments(status)

    from ecshare.apps.bench.commands import add_bench_arguments

    bench = sub.add_parser("bench", help="measure ecshare against baselines; report, compare")
    add_bench_arguments(bench)
    from ecshare.apps.bench.media_ttft import add_media_ttft_parser

    add_media_ttft_parser(bench)
    from ecshare.apps.bench.serve import add_serve_parser

    add_serve_parser(bench)

    from ecshare.apps.chaos.command import add_chaos_arguments

    chaos = sub.add_parser(
        "chaos",
        help="fetches between producer and consumer processes under injected faults "
        "(or --soak SECONDS), then check nothing was lost, leaked or hung",
    )
    add_chaos_arguments(chaos)
    return parser


def _version() -> str:
    """The installed distribution's version (the package root is above this layer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ecshare")
    except PackageNotFoundError:
        return "(not installed)"


# Optional dependencies, and the extra of this package that installs each.
_EXTRAS = {
    "aiohttp": "proxy",
    "psutil": "chaos",
    "rich": "bench",
    "matplotlib": "bench",
    "nixl": "nixl",
    "vllm": "vllm",
    "torch": "vllm",
}


# Flags whose value may be 40 characters of Z85, an alphabet that holds "-": a key
# that starts with "-" would read to argparse as the next flag, so it is glued on.
_KEY_FLAGS = frozenset({"--events-encoder-key", "--events-pd-key", "--server-key"})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse `ecshare` arguments; a key flag takes the next word whatever it starts with."""
    words = list(sys.argv[1:] if argv is None else argv)
    glued: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word in _KEY_FLAGS and index + 1 < len(words):
            glued.append(f"{word}={words[index + 1]}")
            index += 2
            continue
        glued.append(word)
        index += 1
    return build_parser().parse_args(glued)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ecshare.control import ControlConfigError

    try:
        return _dispatch(args)
    except (ConfigError, ControlConfigError) as exc:  # a key file is configuration too
        print(f"ecshare: configuration error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if package not in _EXTRAS:
            raise
        print(
            f"ecshare {args.command}: needs the Python package {package!r}, which is not "
            f"installed (pip install 'ecshare[{_EXTRAS[package]}]')",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:
        # The reader of our output went away (`ecshare doctor | head`): nothing is
        # wrong here. Python's own advice: point stdout at /dev/null, so that the
        # flush at exit does not raise again, and exit as a shell does on SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "fetch":
        return _fetch(args)
    if args.command == "keys":
        from ecshare.control import generate_keypair

        files = generate_keypair(args.directory, args.name, force=args.force)
        print(f"public key: {files.public_path}\nsecret key: {files.secret_path}")
        return 0
    if args.command == "demo" and args.epd:
        from ecshare.apps.epd_demo import run_epd_demo

        return run_epd_demo()
    if args.command == "launch":
        from ecshare.apps.launch import options_from_args, run_launch

        try:
            options = options_from_args(args)
        except ValueError as exc:
            print(f"ecshare launch: {exc}", file=sys.stderr)
            return 2
        return run_launch(options)
    if args.command == "demo":
        from ecshare.apps.demo import run_demo

        return run_demo()
    if args.command == "doctor":
        from ecshare.apps.ops.doctor import run_doctor

        return run_doctor(args)
    if args.command == "status":
        from ecshare.apps.ops.status_query import run_status

        return run_status(args)
    if args.command == "proxy":
        from ecshare.apps.proxy.config import config_from_args
        from ecshare.apps.proxy.workers import run_proxy

        return run_proxy(config_from_args(args))
    if args.command == "chaos":
        from ecshare.apps.chaos.command import run_chaos_command

        return run_chaos_command(args)
    if args.command == "bench" and args.bench_command == "media-ttft":
        from ecshare.apps.bench.media_ttft import run_media_ttft_bench

        return run_media_ttft_bench(args)
    if args.command == "bench" and args.bench_command == "serve":
        from ecshare.apps.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.command == "bench":
        from ecshare.apps.bench.commands import run_bench

        return run_bench(args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import numpy as np

    from ecshare.apps.bench.synthetic import fill_synthetic
    from ecshare.apps.ready import ProducerReady, ServedEntry, print_ready
    from ecshare.peer import Node, start_producer

    config = load_config(cli=args)
    node = Node.create(config, "producer")
    entries = fill_synthetic(node.store, args.synthetic, checksum=args.entry_checksums)
    for path in args.load:
        array = np.load(path, allow_pickle=False)
        h = Path(path).stem
        node.store.put(h, array, checksum=args.entry_checksums)
        entries.append({"mm_hash": h, "nbytes": int(array.nbytes)})
    producer = start_producer(node, fingerprint=args.fingerprint)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # One line tells a supervising process where we are and what we hold.
    served = tuple(ServedEntry(str(e["mm_hash"]), int(e["nbytes"])) for e in entries)
    print_ready(ProducerReady(producer.address, served, producer.metrics_url))
    try:
        while not stop.wait(0.5):
            pass
    finally:
        producer.stop()
        node.close()
    return 0


def _fetch(args: argparse.Namespace) -> int:
    import numpy as np

    from ecshare.apps.bench.synthetic import synthetic_bytes
    from ecshare.peer import FetchFailed, Node, start_consumer

    config = load_config(cli=args)
    node = Node.create(config, "consumer")
    consumer = start_consumer(node, fingerprint=args.fingerprint)
    rows = []
    failed = 0
    try:
        started = time.monotonic()
        futures = consumer.fetch(args.hashes, [args.address])
        for h, future in zip(args.hashes, futures, strict=True):
            remaining = max(0.0, args.timeout - (time.monotonic() - started))
            try:
                result = future.result(timeout=remaining)
            except FetchFailed as exc:
                failed += 1
                rows.append(
                    {"mm_hash": h, "ok": False, "reason": exc.reason.value, "detail": exc.detail}
                )
                continue
            row = {
                "mm_hash": h,
                "ok": True,
                "nbytes": result.nbytes,
                "latency_ms": round(result.latency_s * 1000, 3),
            }
            if args.verify_synthetic:
                got = node.store.read(h).reshape(-1).view(np.uint8)
                row["verified"] = bool(np.array_equal(got, synthetic_bytes(h, result.nbytes)))
                failed += 0 if row["verified"] else 1
            rows.append(row)
    finally:
        consumer.stop()
        node.close()
    if args.json:
        print(json.dumps({"results": rows}))
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
