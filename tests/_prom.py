"""Reading Prometheus metrics the way a scraper does (for the metrics tests)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample at ``/metrics``, by sample name: (labels, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    found = [v for ls, v in samples[name] if all(ls.get(k) == v2 for k, v2 in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]
