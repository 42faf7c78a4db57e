"""Prometheus metrics of a `PersistentPromptCache` and its store, for `kvstore serve`'s `/metrics`.

Each `ServerMetrics` has its own `CollectorRegistry` (two servers in one process never share
counters). Counters and gauges are read at scrape time from the adapter's and the store's own
counts, so nothing is counted twice; the two histograms are observed after every fetch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstore.records import CHECKPOINT, CHUNK, TAIL
from kvstore.serve.promptcache import PersistentPromptCache

#: How long a scrape waits for the index (busy with another process's transaction) before it
#: leaves the disk gauges out.
READ_TIMEOUT_S = 10.0
#: Tenants given a series of their own in /metrics (the biggest on disk); the rest are "other".
TENANT_SERIES = 100

FETCH_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RESTORED_TOKENS_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 32768, 65536, 131072)


class ServerMetrics:
    """`render()` gives `(body, content type)` of the Prometheus text format.

    With `waiting` (an object whose `count` is the requests not started yet), the two gauges the
    Gateway API Inference Extension scrapes from a vLLM server are served too, labelled with
    `model_name`: `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (the memory tier's
    use of its bound, 0 to 1)."""

    def __init__(self, cache: PersistentPromptCache, waiting: Any = None, model_name: str | None = None):
        self.cache = cache
        # The index keeps one SQLite connection per thread that uses it, for as long as the store
        # is open; HTTP requests each run on a new thread, so their reads go through this one.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-metrics")
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(cache, self.read))
        if waiting is not None:
            self.registry.register(_VllmGauges(cache, waiting, model_name or ""))
        self.fetch_seconds = Histogram(
            "kvstore_fetch_seconds", "Time to look up and restore a prompt's cache from the store.",
            buckets=FETCH_SECONDS_BUCKETS, registry=self.registry)
        self.restored_tokens = Histogram(
            "kvstore_restored_tokens", "Prompt tokens restored from the store per request (0: a miss).",
            buckets=RESTORED_TOKENS_BUCKETS, registry=self.registry)
        cache.observers.append(self._observe)

    def _observe(self, seconds: float, reused: int) -> None:
        self.fetch_seconds.observe(seconds)
        self.restored_tokens.observe(reused)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        self._reader.shutdown(wait=False)

    def read(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on this server's one reading thread (raises what `fn` raised, or TimeoutError)."""
        return self._reader.submit(fn).result(timeout=READ_TIMEOUT_S)


class _StoreCollector:
    """Counters of this process and gauges of the store, read when scraped."""

    def __init__(self, cache: PersistentPromptCache, read: Callable[[Callable[[], Any]], Any]):
        self.cache, self.read = cache, read

    def describe(self) -> list:
        return []  # collected lazily: the store may be busy at registration

    def collect(self) -> Iterator[Metric]:
        cache, store = self.cache, self.cache.store
        c = cache.counters
        yield _counter("kvstore_requests", "Prompt-cache lookups (one per request).", c["requests"])
        yield _counter("kvstore_prompt_tokens", "Prompt tokens of those lookups.", c["prompt_tokens"])
        reused = CounterMetricFamily("kvstore_reused_tokens", "Prompt tokens restored instead of "
                                     "computed, by the tier that held them.", labels=["tier"])
        tiers = dict(c["reused_by_tier"])
        if not _has_remote(store) and not tiers.get("remote"):
            tiers.pop("remote", None)
        if store.index is None and not tiers.get("disk"):  # a RAM-only store has no disk tier
            tiers.pop("disk", None)
        for tier, n in tiers.items():
            reused.add_metric([tier], n)
        yield reused
        yield _counter("kvstore_inserts", "Caches handed to the store (queued for the writer).", c["inserts"])
        w = store.writer.stats
        dropped = CounterMetricFamily("kvstore_dropped_writes", "Records that never reached the "
                                      "disk: queue full, write failed, or over the per-request cap.",
                                      labels=["reason"])
        dropped.add_metric(["queue_full"], w.dropped_jobs)
        dropped.add_metric(["write_error"], w.write_errors)
        dropped.add_metric(["too_long"], c["not_stored_too_long"])
        dropped.add_metric(["index_unavailable"], store.counters.get("skipped_inserts", 0))
        yield dropped
        yield _counter("kvstore_fetch_errors", "Lookups that failed and were served as a miss.",
                       c["fetch_errors"] + store.counters.get("fetch_errors", 0))
        yield _counter("kvstore_quarantined", "Damaged records found and quarantined by this process.",
                       store.counters.get("quarantined", 0))
        yield _counter("kvstore_tenant_unknown", "Lookups and inserts no request told the tenant of "
                       "(served without the store).", c["tenant_unknown"])
        check = store.restore_check()
        yield _counter("kvstore_restore_copies", "Restores done by copy because the first restore's "
                       "self-check found mlx arrays that did not hold what was written into them.",
                       check["copy_restores"])
        yield _counter("kvstore_canaries", "First generation steps made into their prompts' canaries (a repeated prompt's too; "
                       "a record keeps the canary it was written with).",
                       cache.first_steps.canaries)
        yield _counter("kvstore_canary_recomputes", "Requests whose restore did not give its prompt's canary, "
                       "computed again from their whole prompt before they were answered.",
                       cache.first_steps.redone)
        yield from self._gauges(store)
        yield from self._tenants(store)
        yield from self._writes(store)
        yield from self._remote(store)

    def _tenants(self, store) -> Iterator[Metric]:
        """Each tenant's records on disk, by its tag (a short HMAC of its salt, never its id): the
        `TENANT_SERIES` biggest, the rest summed under the tag "other" (with `--trust-client-salt`
        every new salt is a tenant: a client must not grow the scrape without bound)."""
        if store.index is None:
            return
        try:
            found = self.read(store.index.tenant_totals)
        except Exception:  # a busy or damaged index: leave them out, keep serving
            return
        if not found:
            return
        size = GaugeMetricFamily("kvstore_tenant_bytes", "Bytes of each tenant's records on disk.", labels=["tenant"])
        count = GaugeMetricFamily("kvstore_tenant_records", "Each tenant's records on disk.", labels=["tenant"])
        biggest = sorted(found.items(), key=lambda item: (-item[1][1], item[0]))
        shown, rest = biggest[:TENANT_SERIES], biggest[TENANT_SERIES:]
        if rest:
            shown.append(("other", (sum(n for _, (n, _) in rest), sum(b for _, (_, b) in rest))))
        for tag, (n, nbytes) in shown:
            size.add_metric([tag], nbytes)
            count.add_metric([tag], n)
        yield size
        yield count

    def _gauges(self, store) -> Iterator[Metric]:
        if store.index is None:  # a RAM-only store holds its records in the memory tier
            kinds = store.memory.kinds()
            totals = {"bytes": store.memory.nbytes, "chunks": kinds.get(CHUNK, 0),
                      "tails": kinds.get(TAIL, 0), "checkpoints": kinds.get(CHECKPOINT, 0)}
        else:
            try:
                totals = self.read(store.index.totals)
            except Exception:  # a busy or damaged index: leave the disk gauges out, keep serving
                totals = None
        if totals is not None:
            yield _gauge("kvstore_store_bytes", "Bytes the store holds (on disk; in RAM for a "
                         "RAM-only store).", totals["bytes"])
            records = GaugeMetricFamily("kvstore_records", "Records the store holds, by kind.",
                                        labels=["kind"])
            for kind in ("chunks", "tails", "checkpoints"):
                records.add_metric([kind.rstrip("s")], totals.get(kind, 0))
            yield records
        yield _gauge("kvstore_memory_bytes", "Bytes in the store's memory tier.", store.memory.nbytes)
        yield _gauge("kvstore_write_queue_bytes", "Bytes queued for the background writer.",
                     store.writer.pending_bytes)

    def _writes(self, store) -> Iterator[Metric]:
        """What the store's disk was written, and what admission and the budget kept out
        (`stats()["writes"]`: every process on the store)."""
        try:
            w = self.read(store.write_stats)
        except Exception:  # a busy or damaged index: leave them out, keep serving
            return
        yield _gauge("kvstore_writes_bytes_last_day", "Bytes written to the store's disk in the last "
                     "day (24 to 25 hours, by the hour), remote downloads included.", w["bytes_last_day"])
        yield _counter("kvstore_writes_bytes_lifetime", "Bytes written to the store's disk over its life, "
                       "remote downloads included (as an SSD's written-bytes counter).", w["bytes_lifetime"])
        for key, why in (("not_admitted", "the admission policy"), ("over_budget", "the write budget")):
            kept = CounterMetricFamily(f"kvstore_writes_{key}", f"Records {why} kept in RAM only when inserted, written later or not "
                                       "(unit: records or bytes).", labels=["unit"])
            kept.add_metric(["records"], w[key])
            kept.add_metric(["bytes"], w[key + "_bytes"])
            yield kept
        if w["max_write_rate"] is not None:
            yield _gauge("kvstore_write_budget_bytes_per_day", "The write budget (max_write_rate).",
                         w["max_write_rate"])

    def _remote(self, store) -> Iterator[Metric]:
        """The remote tier's own counters of this process (uploads, downloads, errors, ...)."""
        counters = getattr(getattr(store, "remote", None), "counters", None)
        if not isinstance(counters, dict):
            return
        family = CounterMetricFamily("kvstore_remote_events", "Remote tier counters of this "
                                     "process, by event.", labels=["event"])
        for name, value in sorted(counters.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric([name], value)
        yield family


class _VllmGauges:
    """The gauges a vLLM server exports that routers read to pick a node."""

    def __init__(self, cache: PersistentPromptCache, waiting: Any, model_name: str):
        self.cache, self.waiting, self.model_name = cache, waiting, model_name

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued and not started yet.",
                                    labels=["model_name"])
        waiting.add_metric([self.model_name], max(0, self.waiting.count))
        yield waiting
        memory = self.cache.store.memory
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the memory tier's bound in use "
                                  "(1 means full).", labels=["model_name"])
        usage.add_metric([self.model_name], memory.nbytes / memory.capacity if memory.capacity else 0.0)
        yield usage
        c = self.cache.counters
        yield _counter("kvstore_prefetches", "POST /kvstore/prefetch requests (refused ones too).", c["prefetches"])
        yield _counter("kvstore_prefetch_tokens", "Prompt tokens prefetches brought into RAM.", c["prefetch_tokens"])
        yield _gauge("kvstore_warmed_prompts", "Prompts --warm-top loaded into RAM at start.", c["warmed_prompts"])
        events = getattr(self.cache.store, "events", None)
        if events is not None:
            counts = events.stats()
            yield _counter("kvstore_kv_events", "KV events published (vLLM's format).", counts["events"])
            yield _counter("kvstore_kv_event_batches", "KV event batches published.", counts["batches"])


def _has_remote(store) -> bool:
    """A remote tier is configured (`kvstore.open(remote=...)`)."""
    return getattr(store, "remote", None) is not None


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
