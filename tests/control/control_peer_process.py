"""A control-plane peer in its own process, for tests that cross a process boundary.

python control_peer_process.py serve --secret-file F --authorized F [--port N]
    Prints {"endpoint": ..., "port": ...} on one line, then answers Hello with a
    Welcome whose server_name is the User-Id it saw, and Heartbeat with
    HeartbeatAck, until stdin closes.

python control_peer_process.py call --endpoint E [--server-key K --secret-file F]
    Sends a Hello with a ControlClient, waits for a reply, prints one JSON line:
    {"state", "failure", "error", "reply"}.

python control_peer_process.py raw --endpoint E
    A bare NULL-mechanism DEALER (no ecshare code): sends a valid Hello frame and
    prints {"frames": n}, how many frames came back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec
import zmq
from control_testing import FAST

from ecshare import protocol as p
from ecshare.control import (
    AuthenticationFailed,
    ControlClient,
    ControlServer,
    load_authorized_keys,
    load_keypair,
    load_public_key,
)

HELLO = p.Hello(versions=[2], session_id="s-1", client_name="test-consumer", fingerprint="fp")


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> None:
    if args.insecure:
        server = ControlServer(keys=None, insecure=True, port=args.port, settings=FAST)
    else:
        server = ControlServer(
            keys=load_keypair(args.secret_file),
            authorized=load_authorized_keys(args.authorized),
            port=args.port,
            settings=FAST,
        )
    _emit({"endpoint": server.endpoint, "port": server.port})
    poller = zmq.Poller()
    for sock in server.pollables:
        poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if sys.stdin.fileno() in ready and not sys.stdin.readline():
                return  # the test is done with us
            while (inbound := server.recv(0)) is not None:
                message = inbound.message
                if isinstance(message, p.Hello):
                    server.send(
                        inbound.peer,
                        p.Welcome(
                            version=1,
                            session_id=message.session_id,
                            server_name=inbound.user or "anonymous",
                            lease_ms=1000,
                            heartbeat_ms=200,
                            max_batch_items=8,
                            data_plane=p.DataPlaneInfo(kind="test", agent_name="producer"),
                        ),
                    )
                elif isinstance(message, p.Heartbeat):
                    server.send(inbound.peer, p.HeartbeatAck())
    finally:
        server.close()


def call(args: argparse.Namespace) -> None:
    if args.insecure:
        client = ControlClient(args.endpoint, server_public_key=None, keys=None, insecure=True)
    else:
        client = ControlClient(
            args.endpoint,
            server_public_key=load_public_key(args.server_key),
            keys=load_keypair(args.secret_file),
            settings=FAST,
        )
    client.send(HELLO)
    deadline = time.monotonic() + args.timeout_ms / 1000
    reply: p.Message | None = None
    error = None
    while reply is None and time.monotonic() < deadline:
        reply = client.recv(50)
        try:
            client.check()
        except AuthenticationFailed as exc:
            error = str(exc)
            break
    if reply is not None:
        # The state comes from the client's monitor thread, which may lag the first reply.
        client.wait_ready(5_000)
    _emit(
        {
            "state": client.state.value,
            "failure": client.failure,
            "error": error,
            "reply": None if reply is None else json.loads(msgspec.json.encode(reply)),
        }
    )
    client.close()


def raw(args: argparse.Namespace) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)
    sock.send(p.encode(HELLO))
    frames = 0
    deadline = time.monotonic() + args.timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            sock.recv()
            frames += 1
    _emit({"frames": frames})
    sock.close(0)
    context.term()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("serve", "call", "raw"))
    parser.add_argument("--endpoint")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server-key")
    parser.add_argument("--secret-file")
    parser.add_argument("--authorized")
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--timeout-ms", type=int, default=3000)
    args = parser.parse_args()
    {"serve": serve, "call": call, "raw": raw}[args.mode](args)


if __name__ == "__main__":
    main()
