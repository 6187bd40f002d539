"""What a client may put in a chat request's content parts, checked before any instance sees it.

Every content part is read as vLLM 0.32 reads it (vllm/renderers/chat_utils.py,
`_parse_chat_message_content_mm_part`): by its `type`, unless the part has no `type` or
has a `uuid`, in which case by the first media field it carries (`image_url`,
`image_embeds`, ...), whatever its `type` says. So a part typed `text` that carries a
`uuid` and an `image_embeds` field is an embedding here, as it is there.

The rules, each refusal a 4xx that names the field and the option, counted by reason
(`rejected_total{reason}`):

* **Client embeddings** (`image_embeds`, `audio_embeds`, `video_embeds`,
  `prompt_embeds`): refused (`client_embeds`) unless `--allow-client-embeds`. An
  embedding part carries a tensor or, metadata only, a key: the one would be stored
  under a key others use, the other would load whatever the region holds under it.
* **Client uuids**: vLLM takes a part's `uuid` as the item's cache key, so a client that
  names another item's key gets its media served for that item everywhere the entry is
  shared. `--client-uuids refuse` (the default) refuses them (`client_uuid`); `strip`
  drops them (counted in `client_uuids_total{action="stripped"}`); `tenant` rewrites each
  to a key of the client's tenant (`tenants.scoped_uuid`), so a tenant can still refer to
  an item it sent before and to no one else's. A uuid longer than `--max-uuid-chars`, or
  not a string, is refused in every mode (`bad_uuid`).
* **With tenant isolation**, a client's own `media_io_kwargs` or `mm_processor_kwargs`
  (`client_mm_kwargs`): the proxy salts `media_io_kwargs` itself (`tenants`), which the
  instances accept only with `--trust-request-mm-kwargs`; the client's are refused as
  vLLM refuses them without it.
* **Media items per request**: at most `--limit-mm-per-prompt` per modality (vLLM's flag
  and default; give the proxy what the instances are given), every occurrence counted as
  vLLM counts them, a client's embedding part (`image_embeds`, ...) with its modality's
  media; refused (`too_many_parts`) before any encoder is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.errors import ProxyError
from ecshare.apps.proxy.tenants import SALT_FIELD, new_tenant_secret, scoped_uuid, tenant_salt

# vLLM's media part kinds, in the order it looks for their fields when it infers a kind.
_INFERRED_ORDER = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
# Each media kind's modality, as vLLM's per-prompt limits and media_io_kwargs name them.
MODALITY = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# Each raw media part kind the proxy sends on, and the pre-computed-embedding part that
# stands for its item when prefill/decode gets it as metadata only (`media`).
EMBEDS_PART = {
    "image_url": "image_embeds",
    "video_url": "video_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
}
# The content parts that run through (or feed) an encoder: the raw media kinds above, and
# a client's `image_embeds` where clients are trusted with embeddings.
MEDIA_PART_TYPES = frozenset({*EMBEDS_PART, "image_embeds"})
# Per-request options vLLM hashes into an item's key (and refuses unless trusted).
HASHED_WITH_UUID = ("mm_processor_kwargs", "media_io_kwargs")
EMBEDS = frozenset({"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"})
# vLLM's limit for a modality that `--limit-mm-per-prompt` does not name.
VLLM_DEFAULT_LIMIT = 999


@dataclass(frozen=True)
class PartRules:
    """The proxy's rules for content parts (see the module docstring)."""

    client_uuids: str = "refuse"
    max_uuid_chars: int = 256
    allow_client_embeds: bool = False
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)
    # What tenant salts are keyed under (`tenants.tenant_salt`): the config's, else one of
    # this process's own (`ecshare proxy` gives its workers one before they start).
    tenant_secret: str = field(default_factory=new_tenant_secret, repr=False)

    @classmethod
    def of(cls, config: ProxyConfig) -> PartRules:
        given = {} if config.tenant_secret is None else {"tenant_secret": config.tenant_secret}
        return cls(
            client_uuids=config.client_uuids,
            max_uuid_chars=config.max_uuid_chars,
            allow_client_embeds=config.allow_client_embeds,
            limit_mm_per_prompt=dict(config.limit_mm_per_prompt),
            **given,
        )

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, VLLM_DEFAULT_LIMIT)

    def salt(self, tenant: str) -> str:
        """`tenant`'s salt under this proxy's tenant secret (see `tenants`)."""
        return tenant_salt(self.tenant_secret, tenant)


@dataclass
class Checked:
    """A request after the rules: its body (the one given when nothing changed)."""

    body: dict[str, Any]
    changed: bool = False
    stripped: int = 0
    scoped: int = 0
    modalities: set[str] = field(default_factory=set)  # of parts with raw media


def part_kind(part: Mapping[str, Any]) -> str | None:
    """The media kind vLLM reads `part` as, or None for a part that is not media."""
    kind = part.get("type")
    if part.get("uuid") is None and kind is not None:
        return kind if isinstance(kind, str) and (kind in MODALITY or kind in EMBEDS) else None
    return next((k for k in _INFERRED_ORDER if k in part), None)


def check_parts(body: dict[str, Any], rules: PartRules, tenant: str) -> Checked:
    """`body` under `rules` for a client of `tenant`; raises `ProxyError` (with its reason)
    for a part the rules refuse."""
    checked = Checked(body)
    messages = body.get("messages")
    if isinstance(body.get("prompt_embeds"), (str, list)) and not rules.allow_client_embeds:
        raise _embeds_refused("the request's `prompt_embeds`")
    if not isinstance(messages, list):
        return checked
    counts: dict[str, int] = {}
    copied: list[Any] | None = None
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for c, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part_kind(part)
            where = f"messages[{m}].content[{c}]"
            if kind in EMBEDS and not rules.allow_client_embeds:
                raise _embeds_refused(f"{where} (`{kind}`)")
            modality = MODALITY.get(kind or "")
            if modality is not None:
                counts[modality] = counts.get(modality, 0) + 1
                if kind not in EMBEDS:
                    checked.modalities.add(modality)
            new = _with_uuid_rules(part, rules, tenant, where, checked)
            if new is part:
                continue
            if copied is None:
                copied = list(messages)
            if copied[m] is messages[m]:
                copied[m] = {**message, "content": list(content)}
            copied[m]["content"][c] = new
    for modality, count in counts.items():
        limit = rules.limit(modality)
        if count > limit:
            raise ProxyError(
                400,
                f"the request has {count} {modality} items, more than the {limit} allowed "
                "per request (the proxy's --limit-mm-per-prompt)",
                reason="too_many_parts",
            )
    if copied is not None:
        checked.body = {**body, "messages": copied}
        checked.changed = True
    return checked


def _with_uuid_rules(
    part: dict[str, Any], rules: PartRules, tenant: str, where: str, checked: Checked
) -> dict[str, Any]:
    uuid = part.get("uuid")
    if uuid is None:
        return part
    if not isinstance(uuid, str) or not uuid or len(uuid) > rules.max_uuid_chars:
        raise ProxyError(
            400,
            f"{where}.uuid must be a string of 1 to {rules.max_uuid_chars} characters "
            "(the proxy's --max-uuid-chars)",
            reason="bad_uuid",
        )
    if rules.client_uuids == "refuse":
        raise ProxyError(
            400,
            f"{where}.uuid: this proxy does not accept client uuids on media parts (a uuid "
            "names a cache entry other requests share); send the media without it, or have "
            "the operator set --client-uuids tenant (or strip)",
            reason="client_uuid",
        )
    if rules.client_uuids == "strip":
        checked.stripped += 1
        return {k: v for k, v in part.items() if k != "uuid"}
    checked.scoped += 1
    return {**part, "uuid": scoped_uuid(tenant, uuid)}


def media_modalities(body: Mapping[str, Any]) -> set[str]:
    """The modalities of the parts of `body` that carry raw media (not embeddings)."""
    found: set[str] = set()
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part_kind(part) if isinstance(part, dict) else None
            if kind is not None and kind not in EMBEDS and kind in MODALITY:
                found.add(MODALITY[kind])
    return found


def salted(body: dict[str, Any], modalities: set[str], salt: str) -> dict[str, Any]:
    """`body` with a tenant's `salt` (`PartRules.salt`) as the media_io_kwargs of each of
    `modalities` (see `tenants`); `body` itself when there is none. A client's own
    `media_io_kwargs` or `mm_processor_kwargs` are refused (`client_mm_kwargs`): the
    instances trust per-request kwargs (`--trust-request-mm-kwargs`) for the salt's sake,
    and the proxy refuses the client's as vLLM would have."""
    for option in HASHED_WITH_UUID:
        if body.get(option):
            raise ProxyError(
                400,
                f"{option}: with --tenant-isolation the proxy sets per-request media "
                "options itself, and refuses a client's (as vLLM does without "
                "--trust-request-mm-kwargs)",
                reason="client_mm_kwargs",
            )
    if not modalities:
        return body
    kwargs = {SALT_FIELD: salt}
    return {**body, "media_io_kwargs": {modality: kwargs for modality in sorted(modalities)}}


def _embeds_refused(what: str) -> ProxyError:
    return ProxyError(
        400,
        f"{what}: this proxy does not accept embeddings from clients (they would be stored "
        "or looked up under keys other requests share); send the media instead, or have the "
        "operator trust every client with them (--allow-client-embeds)",
        reason="client_embeds",
    )
