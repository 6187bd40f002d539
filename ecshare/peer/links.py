"""The consumer's pool of links to producers, and what it says of itself in a Hello.

`LinkPool` keeps at most `max_peer_links` links (`ecshare.peer.link`), made on
demand: a new one evicts the least recently used link that nothing is busy on
(no fetch, no fenced read, no push reservation), and none is made when every
link is busy. Idle links are closed, except where producers push here (idle is
their normal state then). A consumer's memory layout goes in a Hello only to a
producer whose key it pinned and allows to push; to anyone else, the agent's
name and nothing more (invariant 5).
"""

from __future__ import annotations

from collections.abc import Callable

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.control import ClientPool
from ecshare.peer.dataplane import announced
from ecshare.peer.inbox import PushLink
from ecshare.peer.link import PeerLink
from ecshare.transport.base import DataTransport, PeerInfo


class LinkPool:
    """Network thread only; `links` may be copied from any thread (one step)."""

    def __init__(
        self,
        config: Config,
        transport: DataTransport,
        *,
        name: str,
        fingerprint: str,
        server_key: bytes | None,
        push_keys: frozenset[bytes],
        count: Callable[[str], None],
        busy: Callable[[], set[str]],
        ended: Callable[[PeerLink], None],
        retire: Callable[[str], None],
    ) -> None:
        """`busy()`: the endpoints something still needs a link to. `ended` and
        `retire`: as `PeerLink` takes them."""
        self._config = config
        self._transport = transport
        self._name = name
        self._fingerprint = fingerprint
        self._server_key = server_key
        self._push_keys = push_keys
        self._count = count
        self._busy = busy
        self._ended = ended
        self._retire = retire
        self.links: dict[str, PeerLink] = {}
        self.pool: ClientPool | None = None  # made on the network thread, at its start

    def get(self, endpoint: str) -> PeerLink | None:
        return self.links.get(endpoint)

    def link(self, endpoint: str) -> PeerLink | None:
        """The link to `endpoint`, made if need be; None when the bound leaves no room."""
        link = self.links.get(endpoint)
        if link is None and len(self.links) >= self._config.max_peer_links:
            busy = self._busy() - {endpoint}
            idle = [x for x in self.links.values() if x.endpoint not in busy]
            if not idle:
                return None
            self.drop(min(idle, key=lambda x: x.last_used), "peer_links_evicted")
        if link is None:
            assert self.pool is not None
            link = PeerLink(
                endpoint,
                config=self._config,
                pool=self.pool,
                transport=self._transport,
                hello=self.hello,
                count=self._count,
                ended=self._ended,
                retire=self._retire,
            )
            self.links[endpoint] = link
        return link

    def drop(self, link: PeerLink, counter: str) -> None:
        link.flush_releases()
        link.close()
        del self.links[link.endpoint]
        self._count(counter)

    def close_idle(self, now: float) -> None:
        if self._config.push_name:
            return  # producers push over these sessions: idle is their normal state
        idle_s = self._config.peer_link_idle_s
        stale = [
            link for link in self.links.values() if now - max(link.last_used, link.created) > idle_s
        ]
        if not stale:
            return
        busy = self._busy()
        for link in stale:
            if link.endpoint not in busy:
                self.drop(link, "peer_links_closed_idle")

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        if self.pool is not None:
            self.pool.close_all()

    # -- what this consumer says of itself -------------------------------------------------

    def push_allowed(self) -> bool:
        """Producers on our links may push here. The pool pins one producer key for
        every endpoint, so the answer is the same for each link."""
        if not self._config.push_name:
            return False
        return self._server_key is None or self._server_key in self._push_keys

    def hello(self, session_id: str) -> p.Hello:
        info = self._transport.local_info()
        if self.push_allowed():
            return p.Hello(
                versions=list(p.SUPPORTED_VERSIONS),
                session_id=session_id,
                client_name=self._name,
                fingerprint=self._fingerprint,
                capabilities=self._capabilities(push=True),
                data_plane=announced(info),
                push_name=self._config.push_name or "",
            )
        return p.Hello(
            versions=list(p.SUPPORTED_VERSIONS),
            session_id=session_id,
            client_name=self._name,
            fingerprint=self._fingerprint,
            capabilities=self._capabilities(push=False),
            data_plane=announced(info, layout=False),
        )

    def _capabilities(self, *, push: bool) -> list[str]:
        return [
            c
            for c in p.LOCAL_CAPABILITIES
            if (push or c != p.CAP_PUSH)
            and (self._config.direct_reads or c != p.CAP_READ_DIRECT)
            and ((push and self._config.push_credit_bytes > 0) or c != p.CAP_PUSH_CREDIT)
        ]

    def push_link(self, link: PeerLink) -> PushLink:
        """What the inbox needs of `link`."""
        return PushLink(
            endpoint=link.endpoint,
            session_id=link.session_id,
            agent=link.agent,
            peer=link.peer_info or PeerInfo(self._transport.kind, "-", b"", 0, 0),
            allowed=self.push_allowed() and link.pushes,
        )
