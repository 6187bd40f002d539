"""The item directory's promise, on any delivery of a backend's events: it never says a
backend holds an item that the backend's latest incarnation seen did not hold at the
latest sequence number seen (lost, reordered, duplicated and stale-incarnation messages
included), and it is exact again once a snapshot arrives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.peer.items import (
    FeedMessage,
    ItemEvent,
    ItemHeartbeat,
    ItemSnapshot,
    decode,
    encode,
)

HASHES = ("a", "b", "c", "d")
BACKENDS = ("http://e1:1", "http://pd1:2")


@dataclass(frozen=True)
class Sent:
    backend: str
    message: FeedMessage


class Instance:
    """What a real feed publishes, and the truth to check the directory against."""

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self.held: dict[str, int] = {}
        self.seq = 0
        self.states: list[frozenset[str]] = [frozenset()]  # after each seq

    def op(self, mm_hash: str) -> FeedMessage | None:
        kind: Literal["stored", "evicted"]
        if mm_hash in self.held:
            del self.held[mm_hash]
            kind = "evicted"
        else:
            self.held[mm_hash] = len(mm_hash)
            kind = "stored"
        self.seq += 1
        self.states.append(frozenset(self.held))
        return ItemEvent(self.incarnation, self.seq, kind, mm_hash, len(mm_hash))

    def snapshot(self) -> ItemSnapshot:
        return ItemSnapshot(self.incarnation, self.seq, tuple(self.held.items()))

    def heartbeat(self) -> ItemHeartbeat:
        return ItemHeartbeat(self.incarnation, self.seq)


# One step of a backend's life: toggle an item, a snapshot, a heartbeat, a restart.
steps = st.lists(
    st.tuples(
        st.sampled_from(BACKENDS),
        st.one_of(
            st.sampled_from(HASHES),
            st.sampled_from(("<snapshot>", "<heartbeat>", "<restart>")),
        ),
    ),
    min_size=1,
    max_size=40,
)


def publish(plan: list[tuple[str, str]]) -> tuple[list[Sent], dict[tuple[str, int], Instance]]:
    """The messages a run of `plan` sends, in order, and every incarnation's truth."""
    incarnations = {b: Instance(100) for b in BACKENDS}
    every = {(b, i.incarnation): i for b, i in incarnations.items()}
    # What a subscription gets first.
    sent = [Sent(b, i.snapshot()) for b, i in incarnations.items()]
    for backend, step in plan:
        instance = incarnations[backend]
        if step == "<restart>":
            instance = incarnations[backend] = Instance(instance.incarnation + 1)
            every[(backend, instance.incarnation)] = instance
            message: FeedMessage | None = instance.snapshot()
        elif step == "<snapshot>":
            message = instance.snapshot()
        elif step == "<heartbeat>":
            message = instance.heartbeat()
        else:
            message = instance.op(step)
        assert message is not None
        sent.append(Sent(backend, message))
    return sent, every


FAULTS = ("deliver", "deliver", "deliver", "lose", "repeat", "swap")


@st.composite
def deliveries(draw: st.DrawFn, n: int) -> list[int]:
    """Indices of sent messages in delivery order: mostly in order with faults (lost,
    repeated, swapped with the next), or any order at all."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(st.integers(0, n - 1), max_size=3 * n))
    order: list[int] = []
    held: int | None = None
    for index in range(n):
        fault = draw(st.sampled_from(FAULTS))
        if fault == "lose":
            continue
        if fault == "swap" and held is None:
            held = index
            continue
        order += [index, index] if fault == "repeat" else [index]
        if held is not None:
            order.append(held)
            held = None
    return order


def check_never_claims_what_is_gone(
    directory: ItemDirectory, delivered: list[Sent], every: dict[tuple[str, int], Instance]
) -> None:
    for backend in BACKENDS:
        mine = [s.message for s in delivered if s.backend == backend]
        claimed = {h for h in HASHES if backend in directory.holders(h)}
        assert directory.held_count(backend, HASHES) == len(claimed)
        if not mine:
            assert claimed == set()
            continue
        latest = max(m.incarnation for m in mine)
        seen = max(m.seq for m in mine if m.incarnation == latest)
        truth = every[(backend, latest)].states[seen]
        assert claimed <= truth, (backend, latest, seen, claimed, truth)


@settings(max_examples=300, deadline=None)
@given(plan=steps, data=st.data())
def test_directory_never_claims_an_item_its_latest_incarnation_no_longer_holds(
    plan: list[tuple[str, str]], data: st.DataObject
) -> None:
    """Delivery is any sequence of the sent messages: lost, reordered, repeated."""
    sent, every = publish(plan)
    order = data.draw(deliveries(len(sent)), label="delivery")
    directory = ItemDirectory()
    for backend in BACKENDS:
        directory.watch(backend, encoder=backend.startswith("http://e"))
    delivered: list[Sent] = []
    for now, index in enumerate(order):
        delivered.append(sent[index])
        directory.apply(sent[index].backend, sent[index].message, float(now))
        check_never_claims_what_is_gone(directory, delivered, every)


@settings(max_examples=200, deadline=None)
@given(plan=steps, lost=st.sets(st.integers(0, 39)))
def test_a_snapshot_after_lost_events_makes_the_directory_exact(
    plan: list[tuple[str, str]], lost: set[int]
) -> None:
    """In order, with some messages lost: once each backend's final snapshot arrives, the
    directory says exactly what each backend's last incarnation holds."""
    sent, every = publish(plan)
    directory = ItemDirectory()
    for backend in BACKENDS:
        directory.watch(backend, encoder=False)
    asked = set()
    for index, s in enumerate(sent):
        if index - len(BACKENDS) not in lost and directory.apply(s.backend, s.message, 0.0):
            asked.add(s.backend)
    for backend in BACKENDS:
        last = max((i for (b, _), i in every.items() if b == backend), key=lambda i: i.incarnation)
        directory.apply(backend, last.snapshot(), 1.0)
        assert directory.synced(backend)
        assert {h for h in HASHES if backend in directory.holders(h)} == set(last.held)


def test_a_gap_asks_for_a_snapshot_and_drops_the_picture_until_it_comes() -> None:
    directory = ItemDirectory()
    directory.watch("pd", encoder=False)
    assert not directory.apply("pd", ItemSnapshot(7, 0, ()), 0.0)
    assert not directory.apply("pd", ItemEvent(7, 1, "stored", "x", 10), 0.0)
    assert directory.holders("x") == {"pd"}
    assert directory.apply("pd", ItemEvent(7, 3, "stored", "y", 10), 0.0)  # #2 lost
    assert directory.holders("x") == frozenset()
    assert directory.stats()["gaps"] == 1
    # A snapshot older than what was seen would bring back what #2 may have evicted.
    assert directory.apply("pd", ItemSnapshot(7, 2, (("x", 10),)), 0.0)
    assert directory.holders("x") == frozenset()
    assert not directory.apply("pd", ItemSnapshot(7, 3, (("y", 10),)), 0.0)
    assert directory.holders("y") == {"pd"} and directory.holders("x") == frozenset()


def test_a_restarted_instance_drops_everything_its_old_incarnation_said() -> None:
    directory = ItemDirectory()
    directory.watch("enc", encoder=True)
    directory.apply("enc", ItemSnapshot(1, 5, (("x", 1), ("y", 1))), 0.0)
    assert directory.holders("x") == {"enc"} and directory.is_encoder("enc")
    assert directory.apply("enc", ItemHeartbeat(2, 0), 1.0)  # new incarnation: resync
    assert directory.held_count("enc", ["x", "y"]) == 0
    directory.apply("enc", ItemSnapshot(2, 0, ()), 1.0)
    # The old incarnation's words, late, change nothing.
    directory.apply("enc", ItemEvent(1, 6, "stored", "z", 1), 2.0)
    directory.apply("enc", ItemSnapshot(1, 6, (("x", 1),)), 2.0)
    assert directory.held_count("enc", ["x", "y", "z"]) == 0
    assert directory.stats()["stale_incarnation"] == 2
    assert directory.stats()["restarts"] == 1


def test_a_silent_backend_is_forgotten_after_its_timeout() -> None:
    directory = ItemDirectory()
    directory.watch("pd", encoder=False)
    directory.apply("pd", ItemSnapshot(1, 0, (("x", 1),)), 10.0)
    assert directory.expire(now=12.0, timeout_s=5.0) == []
    assert directory.holders("x") == {"pd"}
    assert directory.expire(now=15.5, timeout_s=5.0) == ["pd"]
    assert directory.holders("x") == frozenset()
    assert directory.stats()["expired"] == 1


def test_a_departed_backend_is_forgotten_and_its_messages_dropped() -> None:
    directory = ItemDirectory()
    directory.watch("pd", encoder=False)
    directory.apply("pd", ItemSnapshot(1, 0, (("x", 1),)), 0.0)
    directory.unwatch("pd")
    assert directory.holders("x") == frozenset()
    directory.apply("pd", ItemEvent(1, 1, "stored", "y", 1), 0.0)
    assert directory.holders("y") == frozenset()
    assert directory.stats()["unknown_backend"] == 1
    assert directory.watched() == []


def test_forget_drops_a_backends_items_until_its_next_snapshot() -> None:
    directory = ItemDirectory()
    directory.watch("pd", encoder=False)
    directory.apply("pd", ItemSnapshot(1, 0, (("x", 1),)), 0.0)
    directory.forget("pd")
    assert directory.holders("x") == frozenset()
    assert directory.apply("pd", ItemEvent(1, 1, "stored", "y", 1), 0.0)
    assert directory.holders("y") == frozenset()
    directory.apply("pd", ItemSnapshot(1, 1, (("x", 1), ("y", 1))), 0.0)
    assert directory.held_count("pd", ["x", "y"]) == 2


def test_the_cap_bounds_entries_and_drops_the_oldest_first() -> None:
    directory = ItemDirectory(max_items=3)
    for backend in ("a", "b"):
        directory.watch(backend, encoder=False)
        directory.apply(backend, ItemSnapshot(1, 0, ()), 0.0)
    for seq, h in enumerate(("h1", "h2", "h3"), start=1):
        directory.apply("a", ItemEvent(1, seq, "stored", h, 1), 0.0)
    directory.apply("b", ItemEvent(1, 1, "stored", "h1", 1), 0.0)
    directory.apply("b", ItemEvent(1, 2, "stored", "h4", 1), 0.0)
    assert directory.stats()["entries"] == 3
    assert directory.stats()["capped"] == 2
    assert directory.holders("h1") == {"b"}
    assert directory.holders("h2") == frozenset()
    assert directory.held_count("a", ["h1", "h2", "h3"]) == 1
    assert directory.held_bytes("b", ["h1", "h4"]) == 2


def test_the_wire_refuses_what_is_not_a_feed_message() -> None:
    import msgspec
    import pytest

    message = ItemEvent(1, 2, "stored", "x", 3)
    assert decode(encode(message)) == message
    for bad in (b"", b"\x93\x01\x02\x03", encode(ItemEvent(1, 2, "stored", "x" * 600, 3))):
        with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
            decode(bad)
