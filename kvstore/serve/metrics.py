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
        yield from _by_tier(s)
        for name, kind, doc, key in SERVER_METRICS:
            yield _FAMILIES[kind](name, doc, value=s[key])
        for name, kind, doc, key in STORE_METRICS:
            value = sum(x.get(key) or 0 for x in stores)
            yield _FAMILIES[kind](name, doc, value=value)
        yield GaugeMetricFamily(
            "kvstore_store_all_bytes",
            "Bytes of node files of every namespace in the store directory",
            value=max((x.get("store_bytes_on_disk") or 0 for x in stores), default=0),
        )


def _by_tier(s: Dict[str, Any]) -> Iterator:
    """Lookups and reused tokens labelled by the tier that served them."""
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


_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

# (name, kind, help, key of the prompt cache's stats()).
SERVER_METRICS = (
    (
        "kvstore_requests",
        "counter",
        "Prompt cache lookups (one per generation request)",
        "requests",
    ),
    (
        "kvstore_tokens_computed",
        "counter",
        "Prompt tokens left to the model after the lookup",
        "tokens_computed",
    ),
    (
        "kvstore_tokens_requested",
        "counter",
        "Prompt tokens looked up",
        "tokens_requested",
    ),
    ("kvstore_saves", "counter", "Caches queued for the store", "saves"),
    (
        "kvstore_saves_skipped",
        "counter",
        "Caches not stored (layout unknown, salt not attributable, errors)",
        "saves_skipped",
    ),
    (
        "kvstore_saves_deferred",
        "counter",
        "Saves that waited for the background writer to have room",
        "saves_deferred",
    ),
    (
        "kvstore_saves_held",
        "counter",
        "Saves that waited for the generation loop to rest before copying KV",
        "saves_held",
    ),
    (
        "kvstore_saves_queued",
        "gauge",
        "Saves queued, not yet handed to the background writer",
        "saves_queued",
    ),
    (
        "kvstore_saves_merged",
        "counter",
        "Queued saves covered by a later save of the same prompt",
        "saves_merged",
    ),
    (
        "kvstore_saves_kept_evicted",
        "counter",
        "Deferred saves that kept their KV after RAM evicted their prefix",
        "saves_kept_evicted",
    ),
    (
        "kvstore_saves_lost",
        "counter",
        "Deferred saves whose prefix left RAM before the writer had room",
        "saves_lost",
    ),
    (
        "kvstore_restores_prefetched",
        "counter",
        "Restores started when their request arrived and taken by its lookup",
        "restores_prefetched",
    ),
    (
        "kvstore_prefilled_instead",
        "counter",
        "Returning users prefilled because the restores queued before them would "
        "have kept them waiting longer",
        "prefilled_instead",
    ),
    (
        "kvstore_restores_shared",
        "counter",
        "Prefetched restores that copied a shared prefix from another request's",
        "restores_shared",
    ),
    (
        "kvstore_store_errors",
        "counter",
        "Store operations that failed (logged; the request went on)",
        "store_errors",
    ),
    (
        "kvstore_rejected_requests",
        "counter",
        "Requests refused with a 400 for their cache salt",
        "rejected_requests",
    ),
    (
        "kvstore_lru_bytes",
        "gauge",
        "Bytes of mlx-lm's RAM prompt cache in front of the store",
        "ram_bytes",
    ),
    (
        "kvstore_lru_sequences",
        "gauge",
        "Sequences in mlx-lm's RAM prompt cache",
        "ram_sequences",
    ),
)

# (name, kind, help, key of each store's stats, summed over the stores).
STORE_METRICS = (
    (
        "kvstore_write_queue_bytes",
        "gauge",
        "Bytes of saves waiting for the background writer",
        "pending_write_bytes",
    ),
    (
        "kvstore_write_queue_depth",
        "gauge",
        "Jobs waiting for the background writer",
        "pending_write_jobs",
    ),
    (
        "kvstore_writes_dropped",
        "counter",
        "Saves dropped because too many bytes were waiting for the disk",
        "writes_dropped",
    ),
    (
        "kvstore_writes_failed",
        "counter",
        "Background writes that failed (logged and counted)",
        "writes_failed",
    ),
    (
        "kvstore_restores_chosen",
        "counter",
        "Stored prefixes restored: reading them was faster than prefilling them",
        "restores_chosen",
    ),
    (
        "kvstore_recomputes_chosen",
        "counter",
        "Stored prefixes left to the model: prefilling them was faster (restore=auto)",
        "recomputes_chosen",
    ),
    (
        "kvstore_restore_seconds_saved",
        "counter",
        "Prefill seconds the restores saved, by the measured prefill rate",
        "restore_seconds_saved",
    ),
    (
        "kvstore_corrupt_nodes",
        "counter",
        "Broken node files or records found (a miss, quarantined)",
        "corrupt",
    ),
    (
        "kvstore_store_bytes",
        "gauge",
        "Bytes of node files of the served model's namespace",
        "bytes_on_disk",
    ),
    (
        "kvstore_store_nodes",
        "gauge",
        "Nodes of the served model's namespace",
        "nodes",
    ),
    (
        "kvstore_store_tokens",
        "gauge",
        "Tokens stored for the served model's namespace",
        "stored_tokens",
    ),
    (
        "kvstore_ram_tier_bytes",
        "gauge",
        "Bytes in the store's RAM tier",
        "ram_bytes",
    ),
)
