"""`ecshare proxy` (`run_proxy`), and with `--workers N`, N proxy processes serving one port.

One Python process answers a few thousand requests a second at most, whatever the machine.
Each worker is a whole proxy (its own event loop, backend pools, health checks and
upstream connections) listening on the same address with SO_REUSEPORT, so the kernel
spreads connections across them and the proxy can use N cores. The supervisor, this
module's `supervise`:

* reserves the port first (bound with SO_REUSEPORT, never listening), so that port 0 names
  one port for all workers and a taken port fails at once with a clear message;
* makes the tenant secret where tenant isolation needs one and none is given, so that
  every worker salts a tenant's media alike (`ecshare.apps.proxy.tenants`);
* gives the workers one Prometheus multiprocess directory, so that `/metrics` on any of
  them reports the totals of all (`ecshare.apps.proxy.metrics`);
* passes each worker the configuration on its standard input, never on its command line,
  where the API key would show in `ps`;
* keeps one channel to each worker, a Unix socket pair that worker alone inherits
  (`_Hub`, a thread of its own, on `ecshare.apps.proxy.shared.Coordinator`): through it
  the workers share the registered members and their encodes in flight;
* prints one ready line once every worker listens;
* restarts a worker that dies, and gives up (exit 1) when they die faster than they start;
* stops every worker on SIGINT or SIGTERM, and removes the metrics directory.

A worker ends with its supervisor even when the supervisor is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import msgspec

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.discovery import MAX_MEMBERS_PER_ROLE
from ecshare.apps.proxy.metrics import MULTIPROC_DIR_ENV
from ecshare.apps.proxy.server import cannot_listen, proxy_ready, serve_worker
from ecshare.apps.proxy.shared import (
    MAX_TO_SUPERVISOR_BYTES,
    Coordinator,
    FrameError,
    ToWorker,
    decode_to_supervisor,
    frame,
    split_frames,
)
from ecshare.apps.proxy.tenants import new_tenant_secret
from ecshare.apps.ready import ProxyReady, parse_ready, print_ready

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# More restarts than this within the window: the workers die as fast as they start.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# A worker that takes in nothing of its channel for this long is dropped from it (and ends).
CHANNEL_SEND_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


class WorkerFailed(RuntimeError):
    """A worker could not start, or workers keep dying."""


def run_proxy(config: ProxyConfig) -> int:
    """Serve until SIGINT or SIGTERM; the `ecshare proxy` command: one process
    (`ecshare.apps.proxy.server.serve_worker`), or `config.workers` under `supervise`."""
    if not config.keys() and config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "serving on %s without an API key: anyone who can connect may use it and read "
            "its /metrics, which name the backends",
            config.host,
        )
    if config.workers > 1:
        return supervise(config)
    return serve_worker(config, reuse_port=False)


class _Worker:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pidfd = os.pidfd_open(proc.pid)
        self.ready: ProxyReady | None = None

    def close(self) -> None:
        os.close(self.pidfd)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


Announce = Callable[[str, tuple[int, ...]], None]


def supervise(config: ProxyConfig, announce: Announce | None = None) -> int:
    """Run `config.workers` proxy processes on one port until SIGINT or SIGTERM.

    Once every worker listens, `announce(url, worker_pids)` is called; without it, the
    proxy's ready line is printed.
    """
    try:
        reserved = _reserve(config.host, config.port)
    except OSError as exc:
        return cannot_listen(config, exc)
    shared = tempfile.mkdtemp(prefix="ecshare-proxy-metrics-")
    worker_config = msgspec.structs.replace(
        config, port=reserved.getsockname()[1], tenant_secret=_tenant_secret(config)
    )
    hub = _Hub()
    pool = _Pool(worker_config, shared, announce, hub)
    hub.start()
    try:
        with reserved, _signals() as wakeup:
            return pool.run(wakeup)
    except WorkerFailed as exc:
        print(f"ecshare proxy: {exc}", file=sys.stderr)
        return 1
    finally:
        pool.stop_all()
        hub.stop()
        shutil.rmtree(shared, ignore_errors=True)


def _tenant_secret(config: ProxyConfig) -> str | None:
    """The config's tenant secret; with tenant isolation and none given, one made here,
    before any worker starts, so that every worker (restarted ones too) keys each tenant's
    salt alike: with one secret each, a tenant's requests would miss its own entries
    whenever another worker took them."""
    if config.tenant_secret is None and config.tenant_isolation:
        return new_tenant_secret()
    return config.tenant_secret


class _Pool:
    def __init__(
        self, config: ProxyConfig, shared_dir: str, announce: Announce | None, hub: _Hub
    ) -> None:
        self.config = config
        self.shared_dir = shared_dir
        self.announce = announce
        self.hub = hub
        self.workers: list[_Worker] = []
        self._restarts: deque[float] = deque()

    def run(self, wakeup: int) -> int:
        for _ in range(self.config.workers):
            self.workers.append(self._spawn())
        for worker in self.workers:
            self._wait_ready(worker, wakeup)
        first = self.workers[0].ready
        assert first is not None
        pids = tuple(w.proc.pid for w in self.workers)
        if self.announce is not None:
            self.announce(first.url, pids)
        else:
            print_ready(proxy_ready(self.config, first.url, first.loop, pids))
        while True:
            dead = self._wait_event(wakeup)
            if dead is None:
                return 0  # SIGINT or SIGTERM
            self._replace(dead, wakeup)

    def _spawn(self) -> _Worker:
        env = {**os.environ, MULTIPROC_DIR_ENV: self.shared_dir}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-m", __name__, "--parent", str(os.getpid())]
        argv += ["--channel", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.hub.attach(ours)
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(msgspec.json.encode(self.config))
        return _Worker(proc)

    def _wait_ready(self, worker: _Worker, wakeup: int) -> None:
        """Read the worker's ready line; WorkerFailed if it exits or stays silent."""
        assert worker.proc.stdout is not None
        out = worker.proc.stdout.fileno()
        deadline = time.monotonic() + START_TIMEOUT_S
        got = b""
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            sel.register(wakeup, selectors.EVENT_READ)
            while not got.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailed(f"worker {worker.proc.pid} not ready in {START_TIMEOUT_S}s")
                events = sel.select(left)
                if any(key.fd == wakeup for key, _ in events):
                    raise WorkerFailed("stopped by a signal while the workers started")
                if events:
                    chunk = os.read(out, 4096)
                    if not chunk:
                        code = worker.proc.wait()
                        raise WorkerFailed(f"worker {worker.proc.pid} exited ({code}) at start")
                    got += chunk
        line = got.decode(errors="replace").strip()
        worker.ready = parse_ready(line, ProxyReady)
        if worker.ready is None:
            raise WorkerFailed(f"worker {worker.proc.pid} printed {line!r}, not its ready line")

    def _wait_event(self, wakeup: int) -> _Worker | None:
        """Block until a worker exits (it is returned) or a stop signal arrives (None)."""
        with selectors.DefaultSelector() as sel:
            sel.register(wakeup, selectors.EVENT_READ)
            for worker in self.workers:
                sel.register(worker.pidfd, selectors.EVENT_READ, worker)
            while True:
                for key, _ in sel.select():
                    if key.fd == wakeup:
                        return None
                    dead: _Worker = key.data
                    return dead

    def _replace(self, dead: _Worker, wakeup: int) -> None:
        from prometheus_client import multiprocess

        code = dead.proc.wait()
        self.workers.remove(dead)
        dead.close()
        # Its live gauges (in flight, worker_up) end with it; its counters stay in the totals.
        multiprocess.mark_process_dead(dead.proc.pid, self.shared_dir)
        now = time.monotonic()
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > MAX_RESTARTS:
            raise WorkerFailed(
                f"workers died {len(self._restarts)} times in {RESTART_WINDOW_S:.0f}s "
                f"(the last, {dead.proc.pid}, with exit status {code}); giving up"
            )
        log.warning("proxy worker %d exited with status %s; starting another", dead.proc.pid, code)
        worker = self._spawn()
        self.workers.append(worker)
        self._wait_ready(worker, wakeup)

    def stop_all(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("proxy worker %d ignored SIGTERM; killing it", worker.proc.pid)
                worker.proc.kill()
                worker.proc.wait()
            worker.close()
        self.workers.clear()


class _Hub(threading.Thread):
    """The supervisor's ends of the workers' channels, served on a thread of their own so
    that they are answered while the main thread waits on workers (starting one takes
    seconds): a `Coordinator` with the sockets around it. It blocks in `select` when idle."""

    def __init__(self) -> None:
        super().__init__(name="ecshare-proxy hub", daemon=True)
        self._core = Coordinator(max_per_role=MAX_MEMBERS_PER_ROLE)
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._arriving: list[socket.socket] = []
        self._channels: dict[int, tuple[socket.socket, bytearray]] = {}
        self._ids = 0
        self._stopping = False
        self.bad_frames = 0

    def attach(self, sock: socket.socket) -> None:
        """Serve a new worker's channel (from any thread)."""
        with self._lock:
            self._arriving.append(sock)
        self._wake_write.send(b"\0")

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake_write.send(b"\0")
        if self.is_alive():
            self.join(STOP_TIMEOUT_S)
        for sock, _ in self._channels.values():
            sock.close()
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()

    def run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_read.recv(4096)
                    with self._lock:
                        if self._stopping:
                            return
                        arriving, self._arriving = self._arriving, []
                    for sock in arriving:
                        self._open(sock)
                else:
                    self._readable(key.data)

    def _open(self, sock: socket.socket) -> None:
        self._ids += 1
        worker = self._ids
        sock.settimeout(CHANNEL_SEND_TIMEOUT_S)
        self._channels[worker] = (sock, bytearray())
        self._selector.register(sock, selectors.EVENT_READ, worker)
        self._send(self._core.attach(worker))

    def _readable(self, worker: int) -> None:
        channel = self._channels.get(worker)
        if channel is None:
            return
        sock, buffer = channel
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._close(worker)
            return
        buffer += chunk
        try:
            for body in split_frames(buffer, MAX_TO_SUPERVISOR_BYTES):
                self._send(self._core.receive(worker, decode_to_supervisor(body)))
        except FrameError as exc:
            self.bad_frames += 1
            log.error("proxy worker channel %d: %s; dropping the channel", worker, exc)
            self._close(worker)

    def _send(self, out: list[tuple[int, ToWorker]]) -> None:
        for worker, message in out:
            channel = self._channels.get(worker)
            if channel is None:
                continue
            try:
                channel[0].sendall(frame(message))
            except OSError as exc:  # gone, or not reading: it ends, and is replaced
                log.warning("proxy worker channel %d: %s; dropping the channel", worker, exc)
                self._close(worker)

    def _close(self, worker: int) -> None:
        channel = self._channels.pop(worker, None)
        if channel is None:
            return
        self._selector.unregister(channel[0])
        channel[0].close()
        self._send(self._core.detach(worker))


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and not listening: it holds the port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _signals() -> Iterator[int]:
    """SIGINT and SIGTERM make the yielded descriptor readable (and raise nothing)."""
    read_end, write_end = socket.socketpair()
    read_end.setblocking(False)
    write_end.setblocking(False)
    previous_fd = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield read_end.fileno()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        read_end.close()
        write_end.close()


def _end_with_parent(parent: int) -> bool:
    """Have the kernel SIGTERM this process when `parent` dies; False if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("PR_SET_PDEATHSIG failed (errno %d)", ctypes.get_errno())
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    """One worker: the configuration comes on standard input, as JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--channel", type=int, required=True, help="the channel's descriptor")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=args.channel)
    if not _end_with_parent(args.parent):
        return 1
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ProxyConfig)
    return serve_worker(config, reuse_port=True, channel=channel)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raise SystemExit(main())
