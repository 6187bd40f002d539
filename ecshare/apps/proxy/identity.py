"""Content identity: which item a media part is, from its bytes, without decoding them.

A media part's **content key** is a SHA-256 digest of everything that decides the item's
mm_hash at an instance, with the media itself entered as the SHA-256 digest of its bytes:

* the request's `model`;
* the part as the proxy sends it on, its media replaced by that digest: its kind, a
  client uuid the way the proxy's `--client-uuids` mode left it (stripped, or scoped to
  the client's tenant), any other field;
* the request's `mm_processor_kwargs` and `media_io_kwargs`, canonically (keys sorted):
  with `--tenant-isolation` these carry the tenant's salt (`tenants`), so the same bytes
  sent by two tenants have two keys, as they have two mm_hashes at the instances.

Only media the request itself carries has a key: inline data (a `data:` URL, an
`input_audio` part). The content behind an http/https URL can change while the URL stays
(the staleness users hit upstream, vLLM #55439), so a URL part has no key unless the
operator opts into trusting a URL for `--url-ttl` seconds; any other part (a file URL,
client embeddings) has none. A part without a key is encoded every time.

`KnownItems` maps a content key to the item the encoder reported for it (its mm_hash and
`TransferParam`), bounded, least recently used first out. A key binds only what the
encoder computed from those very bytes under those very options, so a hit can never name
an embedding that was computed from other media (DESIGN invariant 10); whether some
instance still holds the item is the directory's word, not this map's, and a stale hint
costs an encode, never a wrong embedding.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ecshare.apps.proxy.parts import HASHED_WITH_UUID
from ecshare.protocol import TransferParam

_TAG = "ecshare-content-key-v1"
_ENCODE = msgspec.json.Encoder(order="sorted")
# Where each kind of part keeps its media, and whether that is a URL.
_URL_KINDS = ("image_url", "video_url", "audio_url")


def content_key(
    part: Mapping[str, Any], body: Mapping[str, Any], url_ttl_s: float = 0.0
) -> str | None:
    """The content key of media `part` of request `body` (see the module docstring), or
    None where the part has none: a URL without `url_ttl_s`, embeddings, anything else."""
    kind = part.get("type")
    media: str | None = None
    if kind in _URL_KINDS:
        where = part.get(kind)
        url = where.get("url") if isinstance(where, dict) else where
        if not isinstance(url, str):
            return None
        if url.startswith("data:") or (url_ttl_s > 0 and url.startswith(("http://", "https://"))):
            media = url
        if media is None:
            return None
        field = {**where, "url": _digest(media)} if isinstance(where, dict) else _digest(media)
    elif kind == "input_audio":
        where = part.get(kind)
        data = where.get("data") if isinstance(where, dict) else None
        if not isinstance(data, str) or not isinstance(where, dict):
            return None
        field = {**where, "data": _digest(data)}
    else:
        return None
    described = {**part, kind: field}
    options = [body.get(option) for option in HASHED_WITH_UUID]
    blob = _ENCODE.encode([_TAG, body.get("model"), described, options])
    return hashlib.sha256(blob).hexdigest()


def is_remote(part: Mapping[str, Any]) -> bool:
    """Whether a part's media is fetched from a URL by the instance (its key expires)."""
    kind = part.get("type")
    where = part.get(kind) if isinstance(kind, str) else None
    url = where.get("url") if isinstance(where, dict) else where
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Known:
    """The item an encoder reported for a content key, and until when it may be trusted."""

    mm_hash: str
    param: TransferParam  # without `pushed_to`: a push happens once, for its own request
    expires: float = math.inf


def _uncounted(_outcome: str) -> None:
    return None


class KnownItems:
    """Content keys to the items encoders reported for them: at most `capacity`, the least
    recently used dropped first. Each lookup and drop is told to `count` by its outcome:
    hit, miss, expired, evicted, stale."""

    def __init__(self, capacity: int, count: Callable[[str], None] = _uncounted) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._items: OrderedDict[str, Known] = OrderedDict()
        self._count = count

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, now: float) -> Known | None:
        known = self._items.get(key)
        if known is None:
            self._count("miss")
            return None
        if known.expires <= now:
            del self._items[key]
            self._count("expired")
            return None
        self._items.move_to_end(key)
        self._count("hit")
        return known

    def put(self, key: str, mm_hash: str, param: TransferParam, expires: float = math.inf) -> None:
        if param.pushed_to:
            param = msgspec.structs.replace(param, pushed_to=())
        self._items[key] = Known(mm_hash, param, expires)
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)
            self._count("evicted")

    def stale(self, key: str, mm_hash: str) -> None:
        """Forget `key` (if it still names `mm_hash`): using it failed at prefill/decode."""
        known = self._items.get(key)
        if known is not None and known.mm_hash == mm_hash:
            del self._items[key]
            self._count("stale")
