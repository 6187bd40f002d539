"""Media-free prefill/decode: the request with each encoded media part as its metadata only.

An encoder's `ec_transfer_params` carry, for each item, the placeholder `metadata` that
sizes it in the prompt (for Qwen2-VL an image's `image_grid_thw`). vLLM's EC consumer
accepts a pre-computed-embedding part that carries only those fields, and takes the
embedding itself from its connector; so each media part whose item has that metadata is
sent to prefill/decode as

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 6, 8]}, "uuid": MM_HASH}

(`video_embeds` and `audio_embeds` likewise). The `uuid` makes the instance key the item
by the encoder's mm_hash, which its params name. Prefill/decode then never downloads,
decodes or processes the media.

A part keeps its media when:

* its item has no metadata in the params (the model declares none for the modality, or
  the encoder no longer had the processed item) or no mm_hash could be matched to it;
* the request sets `mm_processor_kwargs` or `media_io_kwargs`: vLLM hashes those with a
  `uuid`, so the item would not be keyed by the encoder's mm_hash;
* another part of the same modality keeps its media: vLLM refuses a request that mixes
  raw media and embedding parts of one modality (400, "Mixing raw image and embedding
  inputs is not allowed"), so one image whose encoder call failed keeps every image of
  the request whole (the params still let prefill/decode fetch those that were encoded).

If prefill/decode then fails the request (the fetch of an item failed, and it has nothing
to encode it from), `forward` sends it once more with the original media, which takes the
instance's local-encode fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ecshare.apps.proxy.fanout import JSON, Encoded, MediaScan
from ecshare.apps.proxy.parts import EMBEDS_PART, HASHED_WITH_UUID
from ecshare.protocol import TransferParam


@dataclass
class Rendered:
    """A request as prefill/decode gets it in media-free mode."""

    body: JSON  # with the replaced parts (the original body when none was replaced)
    omitted: int  # media parts sent as metadata only
    kept: int  # media parts sent as they came


def media_free(body: Mapping[str, Any], scan: MediaScan, encoded: Encoded) -> Rendered:
    """`body` with every media part that can go as its metadata replaced by it."""
    if any(body.get(option) for option in HASHED_WITH_UUID):
        return Rendered(dict(body), 0, len(scan.where))
    stand_ins = [
        _stand_in(part, mm_hash, encoded.params)
        for part, mm_hash in zip(scan.parts, encoded.hashes, strict=True)
    ]
    whole = {  # modalities with a part that keeps its media: all of theirs keep it
        EMBEDS_PART.get(part.get("type", ""))
        for part, stand_in in zip(scan.parts, stand_ins, strict=True)
        if stand_in is None
    }
    stand_ins = [
        None if EMBEDS_PART.get(part.get("type", "")) in whole else stand_in
        for part, stand_in in zip(scan.parts, stand_ins, strict=True)
    ]
    messages: list[Any] = body["messages"]
    copied: list[Any] = list(messages)
    omitted = 0
    for m, c, index in scan.where:
        stand_in = stand_ins[index]
        if stand_in is None:
            continue
        if copied[m] is messages[m]:
            copied[m] = {**messages[m], "content": list(messages[m]["content"])}
        copied[m]["content"][c] = stand_in
        omitted += 1
    if not omitted:
        return Rendered(dict(body), 0, len(scan.where))
    return Rendered({**body, "messages": copied}, omitted, len(scan.where) - omitted)


def _stand_in(part: JSON, mm_hash: str | None, params: Mapping[str, TransferParam]) -> JSON | None:
    """The metadata-only part for `part`, or None where it must keep its media."""
    kind = EMBEDS_PART.get(part.get("type", ""))
    if kind is None or mm_hash is None:
        return None
    where = params.get(mm_hash)
    metadata = where.metadata if where is not None else None
    if not metadata:
        return None
    if not all(_numbers(value) for value in metadata.values()):
        return None  # vLLM accepts only numeric arrays for metadata
    return {"type": kind, kind: metadata, "uuid": mm_hash}


def _numbers(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(v) is int or type(v) is float for v in value)
    )
