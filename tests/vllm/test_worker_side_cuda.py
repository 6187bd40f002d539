"""The worker side's CUDA path: a device tensor saved through pinned host memory, and a
region entry loaded back onto the device.

These run only where CUDA is present (`torch.cuda.is_available()`); here, on CPU, they
are skipped as "no GPU here", a skip tests/skips_allowed.txt allows. The CPU path is
covered by the scheduler tests (tests/vllm/conftest.py builds a CPU WorkerSide).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ecshare.store import Region
from ecshare.vllm.ops import LoadOp, SaveOp, StepPlan
from ecshare.vllm.worker_side import WorkerSide

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"),
]

DEVICE = "cuda:0"
# An embedding that spans two extents apart, as blocks of a region lie.
SHAPE = (33, 40)
NBYTES = 33 * 40 * 2  # bf16
EXTENTS = ((0, 1024), (8192, NBYTES - 1024))


@pytest.fixture
def region() -> Iterator[Region]:
    r = Region.create(1 << 20, name="ecshare-cuda-test", prefault=False)
    yield r
    r.close()


def host_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def region_bytes(region: Region) -> bytes:
    return b"".join(region.array[o : o + n].tobytes() for o, n in EXTENTS)


def test_a_device_tensor_is_saved_byte_exact_through_pinned_memory(region: Region) -> None:
    # Not contiguous on the device: the save makes it so before its copy to the host.
    tensor = torch.randn(SHAPE[1], SHAPE[0], device=DEVICE, dtype=torch.bfloat16).t()
    worker = WorkerSide(DEVICE)
    op = SaveOp(grant="g1", mm_hash="h", extents=EXTENTS, nbytes=NBYTES)
    worker.bind(StepPlan(region=region.handle, saves={"h": op}))
    try:
        worker.save({"h": tensor}, "h")
        report = worker.finish_step()
    finally:
        worker.clear()
        worker.close()

    assert report is not None and report.saved == {"g1": ("bfloat16", SHAPE)}, report
    assert not report.save_failed
    assert region_bytes(region) == host_bytes(tensor)


def test_a_region_entry_is_loaded_onto_the_device_and_owes_the_region_nothing(
    region: Region,
) -> None:
    expected = torch.randn(SHAPE, dtype=torch.bfloat16)
    flat = expected.reshape(-1).view(torch.uint8).numpy()
    pos = 0
    for offset, length in EXTENTS:
        region.array[offset : offset + length] = flat[pos : pos + length]
        pos += length
    worker = WorkerSide(DEVICE)
    op = LoadOp("g2", "h", EXTENTS, NBYTES, "bfloat16", SHAPE)
    worker.bind(StepPlan(region=region.handle, loads=[op]))
    cache: dict[str, torch.Tensor] = {}
    try:
        worker.load(cache)
        # The blocks may be reused as soon as load returns: the copy in flight must not
        # read them any more.
        for offset, length in EXTENTS:
            region.array[offset : offset + length] = np.full(length, 0xFF, dtype=np.uint8)
        torch.cuda.synchronize()
        report = worker.finish_step()
    finally:
        worker.clear()
        worker.close()

    loaded = cache["h"]
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    assert tuple(loaded.shape) == SHAPE
    assert torch.equal(loaded.cpu(), expected)
    assert report is not None and report.loaded == {"g2"} and not report.load_failed
