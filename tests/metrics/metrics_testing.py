"""Scraping a real metrics endpoint, parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from ecshare.vllm.servers import free_port as free_port

Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def exposition(url: str) -> str:
    """The endpoint's page as Prometheus reads it: the text exposition format."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text: str = resp.read().decode("utf-8")
        return text


def parse(text: str) -> Scrape:
    """Every sample of an exposition, by (sample name, labels)."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def scrape(url: str) -> Scrape:
    """Every sample of the endpoint, by (sample name, labels)."""
    return parse(exposition(url))


def value(samples: Scrape, name: str, **labels: str) -> float:
    """One sample's value; a missing sample fails the test with what is there."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        there = sorted(f"{n}{dict(lbl)}" for n, lbl in samples if n == name)
        raise AssertionError(f"no sample {name}{labels}; {name} has {there}")
    return samples[key]


def scrape_until(url: str, predicate: Callable[[Scrape], bool], timeout_s: float = 10.0) -> Scrape:
    """Scrape until `predicate` holds (the producer counts a release a moment after
    the consumer sends it); the last scrape either way, for the assertions to name."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if predicate(samples) or time.monotonic() >= deadline:
            return samples
        time.sleep(0.05)


def refused(url: str) -> bool:
    """True when nothing listens on the endpoint any more."""
    try:
        urllib.request.urlopen(url, timeout=2)
    except OSError:
        return True
    return False
