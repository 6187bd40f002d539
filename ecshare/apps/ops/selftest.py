"""A loopback NIXL self-test: two agents, two regions, one READ, every byte checked.

Runs as a child process (`python -m ecshare.apps.ops.selftest [BYTES]`) so that a
data plane that hangs or crashes cannot take the doctor with it. It uses the
same `NixlTransport` and `Region` as a real producer and consumer, with
the UCX_TLS / UCX_NET_DEVICES the doctor derives from the config, as a node would,
and prints one JSON line: bytes moved, whether they matched, and the best
throughput of a few READs.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import msgspec
import numpy as np

# A READ that takes longer than this is reported as stuck, not waited for.
_READ_TIMEOUT_S = 20.0
_REPEATS = 3


class SelfTestResult(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    nbytes: int
    reads: int = 0
    verified: bool = False
    best_gb_per_s: float = 0.0
    error: str = ""


def run(nbytes: int, ucx_env: dict[str, str]) -> SelfTestResult:
    from ecshare.store import Region
    from ecshare.transport.base import ReadState, Segment
    from ecshare.transport.nixl import NixlTransport

    tag = uuid.uuid4().hex[:8]
    src = Region.create(nbytes, name="ecshare-selftest-src", prefault=True)
    dst = Region.create(nbytes, name="ecshare-selftest-dst", prefault=True)
    target = reader = None
    try:
        target = NixlTransport(f"ecshare-selftest-target-{tag}", ucx_env=ucx_env)
        reader = NixlTransport(f"ecshare-selftest-reader-{tag}", ucx_env=ucx_env)
        target.register(src.address, src.size)
        reader.register(dst.address, dst.size)
        pattern = np.random.default_rng(int(tag, 16)).integers(0, 256, nbytes, dtype=np.uint8)
        src.array[:nbytes] = pattern
        peer = reader.add_peer(target.local_info())
        best = 0.0
        for i in range(_REPEATS):
            dst.array[:nbytes] = 0
            started = time.perf_counter()
            handle = reader.read(peer, [Segment(0, 0, nbytes)])
            while (status := reader.poll(handle)).state is ReadState.PENDING:
                target.progress()  # TCP moves only as the target progresses
                if time.perf_counter() - started > _READ_TIMEOUT_S:
                    reader.release(handle)
                    return SelfTestResult(
                        ok=False,
                        nbytes=nbytes,
                        reads=i,
                        error=f"READ of {nbytes} bytes still pending after {_READ_TIMEOUT_S} s",
                    )
            elapsed = time.perf_counter() - started
            reader.release(handle)
            if status.state is not ReadState.DONE:
                kind = status.failure.value if status.failure else "failed"
                return SelfTestResult(
                    ok=False, nbytes=nbytes, reads=i, error=f"READ {kind}: {status.detail}"
                )
            if not np.array_equal(dst.array[:nbytes], pattern):
                return SelfTestResult(
                    ok=False,
                    nbytes=nbytes,
                    reads=i + 1,
                    error="READ reported done, but the bytes differ from the source",
                )
            best = max(best, nbytes / elapsed / 1e9)
        return SelfTestResult(
            ok=True, nbytes=nbytes, reads=_REPEATS, verified=True, best_gb_per_s=round(best, 3)
        )
    finally:
        for transport in (reader, target):
            if transport is not None:
                transport.close()
        dst.close()
        src.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m ecshare.apps.ops.selftest")
    parser.add_argument("nbytes", type=int, nargs="?", default=16 << 20)
    args = parser.parse_args()
    try:
        # UCX_TLS and UCX_NET_DEVICES come from the environment the doctor built.
        result = run(args.nbytes, {})
    except Exception as exc:  # reported as the check's finding, not a traceback
        result = SelfTestResult(ok=False, nbytes=args.nbytes, error=f"{type(exc).__name__}: {exc}")
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    sys.stdout.flush()
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
