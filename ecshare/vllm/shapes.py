"""What the model computes for each media item, and whether an entry or a param matches it.

The engine's placeholder for an item says how many embeddings the model will
read (`get_num_embeds()`); the encoder output is that many rows of the model's
output width, in the model's dtype. An entry of any other shape, whoever
claimed what, is never handed to the model: its params are refused before a
fetch, and an entry found or fetched with another shape is removed.

`Expectations` keeps what the live requests expect of each mm_hash, so that
`has_cache_item`, which is given an mm_hash alone, can check the entry too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ecshare.store import Entry, dtype_itemsize
from ecshare.vllm.ops import TransferParam

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec

Shape = tuple[tuple[int, ...], str]  # (shape, dtype) of an encoder output


def torch_dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: str) -> int:
    """The bytes of one element of `dtype`, from the store's one table
    (`ecshare.store.dtypes`); ValueError for a dtype the store does not hold."""
    size = dtype_itemsize(dtype)
    if size is None:
        raise ValueError(f"{dtype!r} is not a dtype ecshare stores")
    return size


class Expectations:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self._vllm_config = vllm_config
        self.dtype = torch_dtype_name(vllm_config.model_config.dtype)
        itemsize(self.dtype)  # a dtype of unknown size fails here, not on the first request
        self._by_hash: dict[str, Shape] = {}
        self._refs: dict[str, int] = {}

    def of(self, feature: MultiModalFeatureSpec) -> Shape:
        """The (shape, dtype) of the encoder output for `feature`."""
        num_embeds = int(feature.mm_position.get_num_embeds())
        return (num_embeds, self._output_width(feature.modality)), self.dtype

    def nbytes(self, shape: Shape) -> int:
        rows, width = shape[0]
        return rows * width * itemsize(shape[1])

    def _output_width(self, modality: str) -> int:
        widths = getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", {})
        if widths and modality in widths:
            return int(widths[modality])
        return int(self._vllm_config.model_config.get_hidden_size())

    # -- what live requests expect -----------------------------------------------------------

    def add(self, feature: MultiModalFeatureSpec) -> None:
        h = feature.identifier
        self._by_hash[h] = self.of(feature)
        self._refs[h] = self._refs.get(h, 0) + 1

    def discard(self, feature: MultiModalFeatureSpec) -> None:
        h = feature.identifier
        refs = self._refs.get(h, 0) - 1
        if refs > 0:
            self._refs[h] = refs
        else:
            self._refs.pop(h, None)
            self._by_hash.pop(h, None)

    def unfit(self, h: str, entry: Entry) -> str | None:
        """Why `entry` cannot be the encoder output a live request expects for `h`, or None.

        Called on the consumer's thread too; reads one dict entry, which the GIL makes whole.
        """
        expected = self._by_hash.get(h)
        found = (tuple(entry.meta.shape), entry.meta.dtype)
        if expected is None or found == expected:
            return None
        want = f"{expected[1]}{list(expected[0])}"
        return f"holds {found[1]}{list(found[0])}, the model expects {want}"

    def unfit_param(self, param: TransferParam, feature: MultiModalFeatureSpec) -> str | None:
        """Why `param` cannot describe the encoder output of `feature`, or None."""
        expected = self.of(feature)
        shape, dtype = expected
        if (tuple(param.shape), param.dtype) != expected or param.nbytes != self.nbytes(expected):
            return (
                f"params name {param.dtype}{list(param.shape)} ({param.nbytes} bytes), "
                f"the model expects {dtype}{list(shape)}"
            )
        return None
