"""``GET /metrics`` of ``kvstore serve``: Prometheus text exposition via prometheus_client.

Counters and gauges are read at scrape time from :meth:`PersistentPromptCache.stats`
(the same numbers as ``GET /kvstore/stats``) by a custom collector, so nothing is
counted twice; restore latency is a real histogram observed at each store fetch.
Labels are fixed sets (``tier``): never a salt, a prompt or a model path.
"""

from typing import Any, Callable, Dict, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Restores take ~1 ms (a few nodes) to seconds (32K tokens from a cold page cache).
RESTORE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TIERS = ("ram", "disk", "remote")


class ServeMetrics:
    """The registry behind ``GET /metrics`` of one prompt cache.

    Args:
        stats: Returns the prompt cache's ``stats()`` dict (read at each scrape).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], Dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.restore_seconds = Histogram(
            "kvstore_restore_seconds",
            "Time of a store fetch that restored KV (disk or remote tier), seconds",
            buckets=RESTORE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StatsCollector(stats))

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


class _StatsCollector:
    """Counters and gauges of a ``PersistentPromptCache.stats()`` dict."""

    def __init__(self, stats: Callable[[], Dict[str, Any]]):
        self._stats = stats

    def describe(self):
        return []  # names are known only from a scrape; registered unchecked

    def collect(self) -> Iterator:
        s = self._stats()
        stores = [x for x in s.get("stores", []) if "error" not in x]

        def counter(name, doc, value):
            yield CounterMetricFamily(name, doc, value=value)

        def gauge(name, doc, value):
            yield GaugeMetricFamily(name, doc, value=value)

        def store_sum(key):
            return sum(x.get(key) or 0 for x in stores)

        yield from counter(
            "kvstore_requests",
            "Prompt cache lookups (one per generation request)",
            s["requests"],
        )
        lookups = CounterMetricFamily(
            "kvstore_lookups",
            "Prompt cache lookups by the tier that served the reused prefix",
            labels=["tier"],
        )
        for tier in TIERS + ("miss",):
            key = "misses" if tier == "miss" else f"{tier}_hits"
            lookups.add_metric([tier], s[key])
        yield lookups
        reused = CounterMetricFamily(
            "kvstore_tokens_reused",
            "Prompt tokens taken from a cache instead of computed, by tier",
            labels=["tier"],
        )
        for tier in TIERS:
            reused.add_metric([tier], s[f"tokens_reused_{tier}"])
        yield reused
        yield from counter(
            "kvstore_tokens_computed",
            "Prompt tokens left to the model after the lookup",
            s["tokens_computed"],
        )
        yield from counter(
            "kvstore_tokens_requested", "Prompt tokens looked up", s["tokens_requested"]
        )
        yield from counter("kvstore_saves", "Caches queued for the store", s["saves"])
        yield from counter(
            "kvstore_saves_skipped",
            "Caches not stored (layout unknown, salt not attributable, errors)",
            s["saves_skipped"],
        )
        yield from counter(
            "kvstore_store_errors",
            "Store operations that failed (logged; the request went on)",
            s["store_errors"],
        )
        yield from counter(
            "kvstore_rejected_requests",
            "Requests refused with a 400 for their cache salt",
            s.get("rejected_requests", 0),
        )
        yield from gauge(
            "kvstore_write_queue_bytes",
            "Bytes of saves waiting for the background writer",
            store_sum("pending_write_bytes"),
        )
        yield from gauge(
            "kvstore_write_queue_depth",
            "Jobs waiting for the background writer",
            store_sum("pending_write_jobs"),
        )
        yield from counter(
            "kvstore_writes_dropped",
            "Saves dropped because too many bytes were waiting for the disk",
            store_sum("writes_dropped"),
        )
        yield from counter(
            "kvstore_writes_failed",
            "Background writes that failed (logged and counted)",
            store_sum("writes_failed"),
        )
        yield from counter(
            "kvstore_corrupt_nodes",
            "Broken node files or records found (a miss, quarantined)",
            store_sum("corrupt"),
        )
        yield from gauge(
            "kvstore_store_bytes",
            "Bytes of node files of the served model's namespace",
            store_sum("bytes_on_disk"),
        )
        yield from gauge(
            "kvstore_store_nodes",
            "Nodes of the served model's namespace",
            store_sum("nodes"),
        )
        yield from gauge(
            "kvstore_store_tokens",
            "Tokens stored for the served model's namespace",
            store_sum("stored_tokens"),
        )
        yield from gauge(
            "kvstore_store_all_bytes",
            "Bytes of node files of every namespace in the store directory",
            max((x.get("store_bytes_on_disk") or 0 for x in stores), default=0),
        )
        yield from gauge(
            "kvstore_ram_tier_bytes",
            "Bytes in the store's RAM tier",
            store_sum("ram_bytes"),
        )
        yield from gauge(
            "kvstore_lru_bytes",
            "Bytes of mlx-lm's RAM prompt cache in front of the store",
            s["ram_bytes"],
        )
        yield from gauge(
            "kvstore_lru_sequences",
            "Sequences in mlx-lm's RAM prompt cache",
            s["ram_sequences"],
        )
