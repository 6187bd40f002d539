"""The `ecshare chaos` command line: arguments, and the run it starts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import msgspec

from ecshare.apps.bench.synthetic import parse_size, parse_spec


def _faults(text: str) -> tuple[str, ...] | None:
    from ecshare.apps.chaos.options import FAULT_KINDS, PUSH_KINDS

    if text in ("", "none"):
        return ()
    if text == "all":
        return None  # every kind the run can strike: the push kinds too, with --push
    kinds = tuple(k.strip() for k in text.split(","))
    known = (*FAULT_KINDS, *PUSH_KINDS)
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault kind {unknown[0]!r}: choose from {', '.join(known)}, all, none"
        )
    return kinds


def _transport(text: str) -> str:
    from ecshare.apps.chaos.options import UCX_TRANSPORTS

    if text not in UCX_TRANSPORTS:
        raise argparse.ArgumentTypeError(
            f"unknown UCX transport {text!r}: choose from {', '.join(UCX_TRANSPORTS)} "
            "(cma: UCX's own choice on one host, cross-memory attach; tcp: UCX_TLS=tcp)"
        )
    return text


def _spec(text: str) -> str:
    try:
        parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of fetch batches, 0 to 1, got {text}")
    return value


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    from ecshare.apps.chaos.options import SOAK_STRETCH

    parser.add_argument(
        "--fetches", type=_positive(int), default=2000, help="fetches to attempt (default 2000)"
    )
    parser.add_argument(
        "--soak",
        type=_positive(float),
        default=0.0,
        metavar="SECONDS",
        help="instead: sustained fetches without faults for SECONDS, sampling RSS and region usage",
    )
    parser.add_argument(
        "--soak-fetches",
        type=_positive(int),
        default=None,
        metavar="N",
        help=f"a soak runs on past SECONDS (to at most {SOAK_STRETCH:g} times it) until N "
        "fetches were attempted after its warm-up: a leak per fetch needs enough to be seen",
    )
    parser.add_argument("--producers", type=_positive(int), default=2)
    parser.add_argument("--consumers", type=_positive(int), default=3)
    parser.add_argument("--seed", type=int, default=None, help="replay a run (printed by each run)")
    parser.add_argument(
        "--faults",
        type=_faults,
        default=None,
        help="comma-separated fault kinds, 'all' (default) or 'none'",
    )
    parser.add_argument(
        "--fault-interval",
        type=_positive(float),
        default=1.5,
        metavar="SECONDS",
        help="mean time between injected faults",
    )
    parser.add_argument(
        "--working-set",
        type=_spec,
        default="64KiB:96,1MiB:24,4MiB:2",
        metavar="SPEC",
        help="each producer's entries, as SIZE:COUNT pairs",
    )
    parser.add_argument(
        "--producer-region",
        type=_size,
        default="16MiB",
        help="producer region size; smaller than the working set means eviction pressure",
    )
    parser.add_argument("--consumer-region", type=_size, default="64MiB")
    parser.add_argument(
        "--grace",
        type=_positive(float),
        default=2.0,
        metavar="SECONDS",
        help="how far past its deadline a fetch may settle before it counts as late",
    )
    parser.add_argument(
        "--netem",
        default="",
        metavar="'NETEM ARGS'",
        help="run inside a network namespace whose loopback has this tc netem qdisc, "
        "e.g. 'delay 5ms 2ms loss 1%%' (needs CAP_NET_ADMIN and sch_netem)",
    )
    parser.add_argument("--netem-applied", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ucx-tls",
        type=_transport,
        default="cma",
        metavar="{cma,tcp}",
        help="the UCX transport NIXL reads over: cma (default; on one host UCX reads by "
        "cross-memory attach, inside the read call) or tcp (asynchronous reads that move "
        "as the producer progresses)",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="run every node in a network namespace of its own, joined by veth to a bridge, "
        "so that reads cross a network stack (needs --ucx-tls tcp, root and iproute2)",
    )
    parser.add_argument(
        "--large-read",
        type=_size,
        default="4MiB",
        metavar="SIZE",
        help="the faults aimed at reads in flight wait for a read at least this large "
        "(the working set must hold such items)",
    )
    parser.add_argument(
        "--push",
        type=_share,
        default=0.0,
        metavar="SHARE",
        help="push traffic: this share of fetch batches (0 to 1) is also pushed by a "
        "producer to the consumer, and 'all' faults include those aimed at pushes",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="every node's heartbeat timeout (default 1 s); longer than a producer's "
        "restart, consumers see a killed producer's session replaced, not failed (faults "
        "timed past it, such as freeze_consumer_mid_read, then outlast --grace)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--verbose-children",
        action="store_true",
        help="let children log warnings (peer failures are expected under faults)",
    )


def run_chaos_command(args: argparse.Namespace) -> int:
    from ecshare.apps.chaos.harness import FAULT_KINDS, ChaosOptions, run_chaos
    from ecshare.apps.chaos.hosts import HostsUnavailable
    from ecshare.apps.chaos.netns import NetemUnavailable, run_in_netem_namespace
    from ecshare.apps.chaos.options import PUSH_KINDS
    from ecshare.apps.chaos.report import print_report

    if args.netem and args.netns:
        print(
            "ecshare chaos: --netem and --netns cannot be combined: netem shapes one "
            "namespace's loopback, --netns gives every node a namespace of its own",
            file=sys.stderr,
        )
        return 2
    if args.netem and not args.netem_applied:
        try:
            return run_in_netem_namespace(_as_argv(args), args.netem, timeout_s=None)
        except NetemUnavailable as exc:
            print(f"ecshare chaos: --netem: {exc}", file=sys.stderr)
            return 2
    soak = args.soak
    every = (*FAULT_KINDS, *PUSH_KINDS) if args.push else FAULT_KINDS
    faults = args.faults if args.faults is not None else (() if soak else every)
    try:
        options = ChaosOptions(
            fetches=args.fetches,
            soak_s=soak,
            soak_fetches=args.soak_fetches or 0,
            producers=args.producers,
            consumers=args.consumers,
            seed=args.seed,
            faults=faults,
            fault_interval_s=args.fault_interval,
            working_set=args.working_set,
            producer_region_bytes=args.producer_region,
            consumer_region_bytes=args.consumer_region,
            grace_s=args.grace,
            netem=args.netem_applied,
            ucx_tls=args.ucx_tls,
            netns=args.netns,
            large_read_bytes=args.large_read,
            verbose=args.verbose_children,
            push=args.push,
            heartbeat_timeout_s=args.heartbeat_timeout or 0.0,
        )
    except ValueError as exc:
        print(f"ecshare chaos: {exc}", file=sys.stderr)
        return 2
    if soak:
        # A soak measures steady state: the control plane is left alone too.
        options.control_delay_prob = options.control_cut_prob = 0.0
    try:
        report = run_chaos(options)
    except HostsUnavailable as exc:
        print(f"ecshare chaos: --netns: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print_report(report)
    return 0 if report.ok else 1


def _as_argv(args: argparse.Namespace) -> list[str]:
    """The same run's arguments again, for the copy of this command inside the namespace."""
    out = [
        "--fetches", str(args.fetches),
        "--producers", str(args.producers),
        "--consumers", str(args.consumers),
        "--fault-interval", str(args.fault_interval),
        "--working-set", args.working_set,
        "--producer-region", str(args.producer_region),
        "--consumer-region", str(args.consumer_region),
        "--grace", str(args.grace),
        "--ucx-tls", args.ucx_tls,
        "--large-read", str(args.large_read),
        "--push", str(args.push),
    ]  # fmt: skip
    if args.soak:
        out += ["--soak", str(args.soak)]
    if args.soak_fetches:
        out += ["--soak-fetches", str(args.soak_fetches)]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    if args.faults is not None:
        out += ["--faults", ",".join(args.faults) or "none"]
    if args.heartbeat_timeout is not None:
        out += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    if args.json:
        out.append("--json")
    if args.verbose_children:
        out.append("--verbose-children")
    return out
