"""The reuse workload of ``ecshare bench serve``: multi-turn image chats, no I/O.

A workload is a list of chat turns in the order they are sent, with their arrival times.
Its guarantees, each a test (tests/bench/test_bench_serve.py):

* Deterministic: the same `WorkloadSpec` gives the same requests and times.
* A turn resends its chat's whole history, as OpenAI chat clients do: every earlier user
  message with its images, and a fixed assistant answer between them; it may add one new
  image to its own message. So the images of turn t are those of turn t-1 and maybe one
  more, and a chat never holds more than `turns` images.
* Reuse: a media part is a *repeat* when the cluster was sent that image before (by an
  earlier request in send order), a *first sighting* otherwise. The share of repeats over
  all media parts follows `reuse`: a controller picks, turn by turn, whether to add a new
  image, a popular one already seen or nothing (a new image added at turn t of T counts
  1 first sighting and T-t repeats, as the later turns resend it), so the share ends
  within a few parts of the target. Every first turn carries an image, and resends make
  low targets unreachable: about 0.43 is the least for 4 turns of at most 4 images.
* Popularity: an added image that repeats one seen before is drawn from the images seen
  so far with Zipf weights (rank r, by first sighting, weighs r**-zipf).

Image content ids are run-independent; `image_seed` maps one to the pixels of a run, so
that two runs of one workload send the same pattern over disjoint images.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ChatTurn", "Workload", "WorkloadSpec", "build_workload", "image_seed", "messages"]

Arrivals = Literal["poisson", "constant"]


@dataclass(frozen=True)
class WorkloadSpec:
    chats: int = 16
    turns: int = 4
    reuse: float = 0.5  # target share of media parts that repeat an image already sent
    zipf: float = 1.1  # popularity exponent of repeated images
    active_chats: int = 4  # chats in progress at once, their turns interleaved
    rate: float = 1.0  # offered requests per second
    arrivals: Arrivals = "poisson"
    seed: int = 0
    max_images: int = 4  # per request (the instances' --limit-mm-per-prompt)
    max_new: int = 3  # images one turn may add

    def problems(self) -> list[str]:
        """What is wrong with these values, one line each (empty when they are usable)."""
        out = []
        if self.chats < 1 or self.turns < 1 or self.active_chats < 1:
            out.append("chats, turns and active chats must each be at least 1")
        if self.max_images < 1 or self.max_new < 1:
            out.append("max images and max new images per turn must each be at least 1")
        if not 0.0 <= self.reuse < 1.0:
            out.append(f"reuse {self.reuse} is not in [0, 1)")
        if not 0.0 <= self.zipf <= 10.0:
            out.append(f"zipf exponent {self.zipf} is not in [0, 10]")
        if not 0.0 < self.rate <= 1000.0:
            out.append(f"rate {self.rate} is not in (0, 1000] requests per second")
        if self.arrivals not in ("poisson", "constant"):
            out.append(f"arrivals {self.arrivals!r} is neither poisson nor constant")
        return out


@dataclass(frozen=True)
class ChatTurn:
    """One request: turn `turn` (0-based) of chat `chat`."""

    chat: int
    turn: int
    # The chat's images so far, each (content id, the turn that added it), in order.
    images: tuple[tuple[int, int], ...]
    first_sightings: int  # of this request's media parts: 0 or 1
    at_s: float  # offered arrival time, from the run's start

    @property
    def image_ids(self) -> tuple[int, ...]:
        return tuple(image for image, _ in self.images)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: tuple[ChatTurn, ...]  # in send order

    @property
    def media_parts(self) -> int:
        return sum(len(r.images) for r in self.requests)

    @property
    def first_sightings(self) -> int:
        return sum(r.first_sightings for r in self.requests)

    @property
    def reuse(self) -> float:
        """The achieved share of media parts that repeat an image sent before."""
        parts = self.media_parts
        return 1.0 - self.first_sightings / parts if parts else 0.0

    @property
    def distinct_images(self) -> int:
        return len({i for r in self.requests for i in r.image_ids})


def build_workload(spec: WorkloadSpec) -> Workload:
    """The requests of `spec`, in send order (see the module's docstring)."""
    if problems := spec.problems():
        raise ValueError("; ".join(problems))
    rng = random.Random(f"ecshare-bench-serve/{spec.seed}")
    order = _send_order(spec)
    held: dict[int, list[tuple[int, int]]] = {c: [] for c in range(spec.chats)}
    seen: list[int] = []  # content ids by first sighting: index = popularity rank - 1
    parts = repeats = 0  # committed: an added image counts its later resends at once
    requests = []
    at = 0.0
    for n, (chat, turn) in enumerate(order):
        if n:
            at += rng.expovariate(spec.rate) if spec.arrivals == "poisson" else 1.0 / spec.rate
        images = held[chat]
        future = spec.turns - turn  # the parts an image added now will make, with resends
        first = added = 0
        while len(images) < spec.max_images and added < spec.max_new:
            behind = parts > 0 and repeats / parts > spec.reuse  # too few first sightings
            if behind and turn > 0 and future > 1 and (future - 1) / future >= spec.reuse:
                break  # a new image now would resend too often: wait for a later turn
            popular = (
                None if behind else _draw_popular(rng, seen, {i for i, _ in images}, spec.zipf)
            )
            if popular is None:
                images.append((len(seen), turn))
                seen.append(len(seen))
                parts, repeats, first = parts + future, repeats + future - 1, first + 1
            else:
                images.append((popular, turn))
                parts, repeats = parts + future, repeats + future
            added += 1
            if not behind or turn == 0 or future > 1:
                break  # one image a turn, but a last turn may catch up with several
        requests.append(ChatTurn(chat, turn, tuple(images), first, round(at, 6)))
    return Workload(spec, tuple(requests))


def _send_order(spec: WorkloadSpec) -> list[tuple[int, int]]:
    """(chat, turn) pairs: `active_chats` chats at a time, one turn each in turn; a chat
    that ends hands its place to the next one."""
    slots: list[tuple[int, int] | None] = [
        (c, 0) for c in range(min(spec.active_chats, spec.chats))
    ]
    following = len(slots)
    order = []
    while any(s is not None for s in slots):
        for k, slot in enumerate(slots):
            if slot is None:
                continue
            chat, turn = slot
            order.append(slot)
            if turn + 1 < spec.turns:
                slots[k] = (chat, turn + 1)
            elif following < spec.chats:
                slots[k] = (following, 0)
                following += 1
            else:
                slots[k] = None
    return order


def _draw_popular(
    rng: random.Random, seen: list[int], held: set[int], exponent: float
) -> int | None:
    """An image seen before and not in `held`, by Zipf weight of its rank; None if none."""
    candidates = [image for image in seen if image not in held]
    if not candidates:
        return None
    weights = [(rank + 1) ** -exponent for rank, image in enumerate(seen) if image not in held]
    return rng.choices(candidates, weights)[0]


def image_seed(seed: int, run: str, image: int) -> int:
    """The pixel seed of content id `image` in run `run`: runs never share an image."""
    digest = hashlib.sha256(f"{seed}/{run}/{image}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def messages(turn: ChatTurn, image_url: dict[int, str]) -> list[dict[str, Any]]:
    """The OpenAI chat messages of `turn`: every earlier user message with the images it
    added and a fixed assistant answer after it, then this turn's message."""
    out: list[dict[str, Any]] = []
    for t in range(turn.turn + 1):
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": image_url[image]}}
            for image, added in turn.images
            if added == t
        ]
        content.append({"type": "text", "text": f"Turn {t + 1}: what changed in the picture?"})
        out.append({"role": "user", "content": content})
        if t < turn.turn:
            out.append({"role": "assistant", "content": f"Answer {t + 1}: nothing much."})
    return out
