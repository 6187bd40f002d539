"""Tenants: who a request is from, and the keys that bind its media items to it.

**The key file** (`--api-key-file`) has one API key a line, optionally followed by the
tenant it belongs to; blank lines and lines starting with `#` are skipped:

    # key                              tenant
    3f9c0c7e5b6a4d1e8a27c4b0d9e1f2a3   team-a
    a7d1e09b44c2480f9e3b5c6d7e8f9a0b   team-b
    5c2e7f1a0b9d4c3e8f6a1b2c3d4e5f60

A key alone (the old one-key file, or `ECSHARE_PROXY_API_KEY`) belongs to the tenant
`default`. Without any key every request is the tenant `default`'s and no key is asked.
A key is looked up by its SHA-256 digest, so the time a lookup takes says nothing about
how close a wrong key came. A key file its group or other users can read is refused
(`ecshare.config.secret_files`).

**Client uuids scoped to a tenant** (`--client-uuids tenant`). vLLM 0.32 takes a media
part's `uuid` verbatim as the item's mm_hash (vllm/multimodal/processing/inputs.py,
`ProcessorInputs.get_mm_hashes`, when the request has no `mm_processor_kwargs` or
`media_io_kwargs`; with them it hashes the uuid together with those). The proxy rewrites
each uuid to `scoped_uuid(tenant, uuid)`, a SHA-256 digest of both under a domain tag,
before any instance sees the request, and sends the same rewritten part to the encoders
and to prefill/decode, so their keys agree. One tenant's uuid therefore never names
another tenant's item, nor an item keyed by content: reaching either would take a
SHA-256 preimage.

**No entry shared between tenants** (`--tenant-isolation`). Without uuids, vLLM keys an
item by `blake3(model id, the decoded media, hash factors)`, where the hash factors are
the request's `mm_processor_kwargs` and the modality's `media_io_kwargs`
(`MultiModalHasher.hash_kwargs`); vLLM's `cache_salt` enters only the prefix-cache block
hashes, never the mm_hash. So the proxy salts the hash factors: it sets
`media_io_kwargs[modality]["ecshare_tenant"] = tenant_salt(secret, tenant)` for every modality
whose media a request carries (a client's own `media_io_kwargs` and
`mm_processor_kwargs` are refused, `parts`). The instances must accept per-request
kwargs (`vllm serve --trust-request-mm-kwargs`). vLLM's media loaders keep unknown
`media_io_kwargs` to themselves (`ImageMediaIO(**kwargs)` stores them), and the hash
covers them, so each tenant's key for the same content differs, at
the encoder and on prefill/decode alike (they are sent the same salted request). A part
sent to prefill/decode as its metadata only carries the encoder's (salted) mm_hash as
its uuid and no salt for its modality, so that vLLM takes that uuid verbatim (push and
pull alike). The same request always salts the same way, so a tenant still hits its own
entries; another tenant's hit on them, and the timing that would tell of it, is gone.

**The salt is keyed.** `tenant_salt` is an HMAC-SHA256 of the tenant's name under the
proxy's tenant secret (`--tenant-secret-file`), not a digest of the name alone: whoever
can put `media_io_kwargs` on an instance (a client that reaches one directly) could
otherwise compute a named tenant's salt and address its entries. Without the file the
proxy makes a secret at start, one for all its workers (`workers.run_proxy`); two
proxies in front of the same instances need the same file, or each keys a tenant's
entries apart from the other's.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

from ecshare.config import ConfigError
from ecshare.config.secret_files import check_secret_file

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SALT_FIELD = "ecshare_tenant"
_UUID_TAG = b"ecshare-client-uuid\x00"
_SALT_TAG = b"ecshare-tenant-salt\x00"


def read_key_file(path: str) -> dict[str, str]:
    """The keys of an API-key file (see the module docstring), each to its tenant; a file
    others may read is refused (`ecshare.config.secret_files`)."""
    check_secret_file(path, "--api-key-file")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("--api-key-file", f"cannot read {path!r}: {exc.strerror}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ConfigError(
                "--api-key-file",
                f"{path!r} line {number}: expected `KEY` or `KEY TENANT`, got {len(fields)} fields",
            )
        key, tenant = fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT
        if key in keys:
            raise ConfigError("--api-key-file", f"{path!r} line {number}: a key given twice")
        keys[key] = tenant
    if not keys:
        raise ConfigError("--api-key-file", f"{path!r} is empty")
    check_tenants(keys)
    return keys


def check_tenants(keys: Mapping[str, str]) -> None:
    """Raise `ConfigError` unless every key is one word and every tenant a valid name."""
    for key, tenant in keys.items():
        if not key or key != key.strip() or len(key.split()) != 1:
            raise ConfigError("--api-key-file", "an API key must be one word, not empty")
        if not TENANT_NAME.fullmatch(tenant):
            raise ConfigError(
                "--api-key-file",
                f"got tenant {tenant!r}, expected 1-64 of A-Z a-z 0-9 . _ -, "
                "not starting with . _ -",
            )


class Keyring:
    """The API keys a proxy accepts, each to its tenant; empty: no key is asked."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._tenants = {_digest(key): tenant for key, tenant in keys.items()}

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def tenant(self, authorization: str) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header's key; None if it names none."""
        token = bearer_token(authorization)
        if token is None:
            return None
        # Looked up by digest: how long a lookup takes depends on the digest, which tells
        # nothing of the keys.
        return self._tenants.get(_digest(token))


def bearer_token(authorization: str) -> str | None:
    """The KEY of an `Authorization: Bearer KEY` header; None for any other header."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def holds_key(authorization: str, key: str) -> bool:
    """Whether an `Authorization: Bearer KEY` header carries `key` (the admin key), compared
    in constant time."""
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


def scoped_uuid(tenant: str, uuid: str) -> str:
    """The key a tenant's client uuid becomes: the same tenant and uuid, the same key."""
    digest = hashlib.sha256(_UUID_TAG + tenant.encode() + b"\x00" + uuid.encode())
    return digest.hexdigest()


def tenant_salt(secret: str, tenant: str) -> str:
    """What `media_io_kwargs[...]["ecshare_tenant"]` is set to for `tenant`'s requests: an
    HMAC of the tenant's name under the proxy's tenant secret, so that no one without the
    secret can compute (and send) another tenant's salt."""
    mac = hmac.new(secret.encode(), _SALT_TAG + tenant.encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def new_tenant_secret() -> str:
    """A fresh tenant secret (64 hex characters)."""
    return secrets.token_hex(32)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
