"""Placeholder metadata: what lets a prefill/decode instance admit an item without its media.

How many tokens an item takes in the prompt is set by a few processed fields, which the
model's data parser declares per modality (vLLM's `MultiModalDataParser.embedding_fields`,
role "metadata"): for Qwen2-VL an image's `image_grid_thw`. An encoder publishes them in
each item's `ec_transfer_params`, in the shape vLLM's own EC connectors use, so that vLLM's
EPD tooling and `ecshare proxy` read them alike:

    {mm_hash: {...where to fetch it..., "modality": "image",
               "metadata": {"image_grid_thw": [1, 6, 8]}, "item_indices": [0]}}

`modality` comes with where to fetch it (`ecshare.protocol.TransferParam`; vLLM 0.34's
helper adds the same, 0.32's does not). `item_indices` are the item's positions in the request's
`mm_features` (a repeated item has several). `metadata` is empty where the model declares
no fields for the modality, or where the encoder no longer holds the processed item (a
cache hit): that item can only be sent with its media. The fields are sizes, never
addresses or layout.

On the consuming side a request may then carry an item as metadata only (vLLM's EC
consumer accepts that, `allow_missing_mm_embeddings`). Such an item has no input to encode
from, so if its fetch fails the request must fail: `carries_input` tells the two apart.

The fields are read through vLLM's own `PlaceholderMetadataResolver`, the declaration its
consumer-side parser requires, so producer and consumer cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec


class Placeholders:
    """The placeholder fields of one model, per modality (resolved once each)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._resolver = PlaceholderMetadataResolver(model_config)

    def fields(self, modality: str) -> set[str]:
        """The fields that size `modality`'s placeholder; empty: it needs its media."""
        return self._resolver.fields_for(modality)

    def item_params(self, features: list[MultiModalFeatureSpec]) -> dict[str, dict[str, Any]]:
        """`metadata` and `item_indices` of each item of a request, keyed by mm_hash."""
        return collect_ec_item_metadata(features, self._resolver)

    def carries_input(self, feature: MultiModalFeatureSpec) -> bool:
        """Whether the request brought something the engine can encode (or use) for the
        item: its media, or embeddings, beyond the placeholder metadata."""
        data = feature.data
        if data is None:
            return False
        metadata = self.fields(feature.modality)
        return any(v.data is not None for k, v in data.items() if k not in metadata)
