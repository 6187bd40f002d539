"""CURVE client authentication: an allow-list of public keys, enforced over ZAP.

libzmq performs the CURVE handshake, then asks a ZAP handler (RFC 27) on
`inproc://zeromq.zap.01` of the socket's context whether to admit the client.
This module runs that handler: a small thread per `zmq.Context`, with one
`AllowList` per server socket, told apart by the socket's ZAP domain. It
answers with the client's Z85 public key as User-Id, which libzmq attaches to
every message of that connection (`frame.get("User-Id")`), so a session can be
bound to an authenticated identity rather than to a routing id the client chose.

Why not `zmq.auth.thread.ThreadAuthenticator`: it runs an asyncio loop per
authenticator and binds the single ZAP endpoint of its context, so two servers
in one context (tests, or a process with two roles) could not each have their
own allow-list. The protocol is small enough to answer directly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Final

import zmq
from zmq.utils import z85

from ecshare.control.errors import ControlConfigError
from ecshare.control.waker import Waker

log = logging.getLogger(__name__)

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"
_CURVE_KEY_BYTES: Final = 32
# A refused key is logged at WARNING at most this often, so that a misconfigured
# consumer retrying in a loop does not flood the log.
_WARN_EVERY_S: Final = 60.0
_WARNED_KEYS_MAX: Final = 1024

# Why a handshake was refused, as metrics label it.
KEY_NOT_AUTHORIZED: Final = "key_not_authorized"  # a valid CURVE key not on the allow-list
NOT_CURVE: Final = "not_curve"  # the client did not use CURVE (NULL or PLAIN)
BAD_CREDENTIALS: Final = "bad_credentials"  # CURVE credentials of the wrong shape
REFUSAL_REASONS: Final = (KEY_NOT_AUTHORIZED, NOT_CURVE, BAD_CREDENTIALS)


class AllowList:
    """The client keys one server admits, with thread-safe handshake counters."""

    def __init__(self, keys: frozenset[bytes], *, server: str) -> None:
        self.keys = keys
        self.server = server
        self._lock = threading.Lock()
        self._accepted = 0
        self._rejected = 0
        # Refusals by reason (REFUSAL_REASONS), for metrics; every key exists from the start.
        self._refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self._warned: dict[bytes, float] = {}

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def rejected(self) -> int:
        return self._rejected

    def refused_by_reason(self) -> dict[str, int]:
        """Refused handshakes per reason (see REFUSAL_REASONS); a copy, for any thread."""
        with self._lock:
            return dict(self._refused)

    def admits(self, client_key: bytes, address: str) -> bool:
        """Whether `client_key` (Z85) may connect; counts and logs the decision."""
        admitted = client_key in self.keys
        with self._lock:
            if admitted:
                self._accepted += 1
            else:
                self._rejected += 1
                self._refused[KEY_NOT_AUTHORIZED] += 1
                loud = self._should_warn(client_key)
        if admitted:
            log.debug("%s: admitted CURVE client %s from %s", self.server, client_key, address)
        else:
            # Public keys are not secret; naming the refused one is what lets an
            # operator fix the allow-list.
            log.log(
                logging.WARNING if loud else logging.DEBUG,
                "%s: refused CURVE client key %s from %s: not on the allow-list",
                self.server,
                client_key.decode("ascii"),
                address,
            )
        return admitted

    def refuse(self, reason: str, detail: str, address: str) -> None:
        """Count a handshake refused before its key could be checked (`reason`: REFUSAL_REASONS)."""
        with self._lock:
            self._rejected += 1
            self._refused[reason] += 1
        log.warning("%s: refused a client from %s: %s", self.server, address, detail)

    def _should_warn(self, client_key: bytes) -> bool:
        now = time.monotonic()
        last = self._warned.get(client_key)
        if last is not None and now - last < _WARN_EVERY_S:
            return False
        if len(self._warned) >= _WARNED_KEYS_MAX:
            self._warned.clear()
        self._warned[client_key] = now
        return True


class ZapRegistration:
    """An allow-list installed for one server socket; `close()` removes it."""

    def __init__(self, service: _ZapService, domain: str, allow_list: AllowList) -> None:
        self.domain = domain
        self.allow_list = allow_list
        self._service: _ZapService | None = service

    def close(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            _release(service, self.domain)


def register_allow_list(
    context: zmq.Context[zmq.Socket[bytes]], allow_list: AllowList
) -> ZapRegistration:
    """Check CURVE clients of sockets whose ZAP domain is the returned `domain`.

    Starts the context's ZAP handler on first use. Set `sock.zap_domain` before
    binding, so that no handshake can happen before the allow-list applies.
    """
    domain = f"ecshare-{uuid.uuid4().hex}"
    with _registry_lock:
        service = _services.get(id(context))
        if service is None:
            service = _ZapService(context)
            _services[id(context)] = service
        service.domains[domain] = allow_list
    return ZapRegistration(service, domain, allow_list)


_registry_lock = threading.Lock()
_services: dict[int, _ZapService] = {}


def _release(service: _ZapService, domain: str) -> None:
    with _registry_lock:
        service.domains.pop(domain, None)
        if service.domains:
            return
        _services.pop(id(service.context), None)
        # Stopped under the lock, so that a new registration for this context never
        # races the old handler for the ZAP endpoint.
        service.stop()


class _ZapService(threading.Thread):
    """Answers ZAP requests for every registered domain of one context."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        super().__init__(name="ecshare-zap", daemon=True)
        self.context = context
        # Written under _registry_lock; read here without it, one dict lookup at a
        # time, which the GIL keeps consistent.
        self.domains: dict[str, AllowList] = {}
        self._socket: zmq.Socket[bytes] = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            # Bound here, on the caller's thread, so that the endpoint exists before
            # any server socket of this context binds.
            self._socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            raise ControlConfigError(
                f"another ZAP handler already serves this zmq context ({exc}); give the "
                "control server a zmq context of its own"
            ) from None
        self._waker = Waker()
        self._stopping = False
        self.start()

    def stop(self) -> None:
        self._stopping = True
        self._waker.wake()
        self.join(timeout=5.0)
        self._waker.close()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        try:
            while not self._stopping:
                ready = dict(poller.poll())
                if self._waker.fileno() in ready or self._waker in ready:
                    self._waker.clear()
                if self._socket in ready:
                    request = self._socket.recv_multipart()
                    self._socket.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        except Exception:
            # Closing the endpoint below makes handshakes fail closed (ZAP_ENFORCE_DOMAIN).
            log.exception("ZAP handler failed; CURVE clients can no longer be admitted")
        finally:
            # Unbound first: closing alone frees the endpoint later, when libzmq reaps the
            # socket, and a handler registered for this context meanwhile would find it
            # taken (once in 500 back-to-back registrations here).
            with contextlib.suppress(zmq.ZMQError):
                self._socket.unbind(ZAP_ENDPOINT)
            self._socket.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return _reply(request_id, b"400", b"malformed ZAP request")
        _, request_id, domain, address, _identity, mechanism, *credentials = request
        peer = address.decode("utf-8", "replace")
        allow_list = self.domains.get(domain.decode("utf-8", "replace"))
        if allow_list is None:
            if mechanism == b"NULL" and not domain:
                # Some other, unauthenticated socket of this context: libzmq's classic
                # NULL behaviour is to admit, and it is not ours to police.
                return _reply(request_id, b"200", b"OK")
            log.warning("ZAP request for unknown domain %r from %s refused", domain, peer)
            return _reply(request_id, b"400", b"unknown ZAP domain")
        if mechanism != b"CURVE" or len(credentials) != 1:
            allow_list.refuse(NOT_CURVE, f"mechanism {mechanism!r}, CURVE required", peer)
            return _reply(request_id, b"400", b"CURVE required")
        if len(credentials[0]) != _CURVE_KEY_BYTES:
            allow_list.refuse(BAD_CREDENTIALS, "malformed CURVE credentials", peer)
            return _reply(request_id, b"400", b"malformed CURVE credentials")
        client_key = z85.encode(credentials[0])
        if allow_list.admits(client_key, peer):
            return _reply(request_id, b"200", b"OK", user_id=client_key)
        return _reply(request_id, b"400", b"client key not on the allow-list")


def _reply(request_id: bytes, status: bytes, text: bytes, user_id: bytes = b"") -> list[bytes]:
    return [_ZAP_VERSION, request_id, status, text, user_id, b""]
