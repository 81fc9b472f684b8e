"""``GET /metrics``: the boxes a key may see, in Prometheus' text format, from each box's
newest sample (``core.metrics``: every 10 s while it runs), written with the official
client library. Counters are the cumulative ones of the sample; a box started again
starts its guest counters over, which Prometheus' ``rate()`` takes as a reset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..version import __version__

# (name, help, the sample's field, counter?)
BOX_FIGURES = (
    ("sandlot_box_cpu_seconds", "Host CPU time of the box's VM", "cpu_seconds", True),
    ("sandlot_box_memory_rss_bytes", "Resident memory of the box's VM on the host", "rss_bytes", False),
    ("sandlot_box_memory_pss_bytes", "Proportional set size of the box's VM on the host", "pss_bytes", False),
    ("sandlot_box_guest_memory_used_bytes", "Memory in use in the guest", "guest_memory_used_bytes", False),
    ("sandlot_box_guest_memory_total_bytes", "Memory the guest has", "guest_memory_total_bytes", False),
    (
        "sandlot_box_disk_allocated_bytes",
        "Bytes the box's own disk layer takes on the host",
        "disk_bytes",
        False,
    ),
    ("sandlot_box_network_receive_bytes", "Bytes the guest received", "net_rx_bytes", True),
    ("sandlot_box_network_transmit_bytes", "Bytes the guest sent", "net_tx_bytes", True),
    ("sandlot_box_disk_read_bytes", "Bytes the guest read from its disks", "disk_read_bytes", True),
    ("sandlot_box_disk_written_bytes", "Bytes the guest wrote to its disks", "disk_written_bytes", True),
    ("sandlot_box_execs", "Commands started in the box", "execs", True),
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Boxes(Collector):
    def __init__(
        self, rows: list[tuple[dict[str, Any], dict[str, Any] | None]], bounded: dict[str, Any]
    ) -> None:
        self.rows = rows  # (the box's id, name and state; its newest sample)
        self.bounded = bounded  # box id ("": the home): record: what: count (``api.metrics.bounded``)

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("sandlot_info", "The server's sandlot", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        states = GaugeMetricFamily("sandlot_boxes", "Boxes by state", labels=["state"])
        for state in sorted({box["state"] for box, _ in self.rows}):
            states.add_metric([state], sum(1 for box, _ in self.rows if box["state"] == state))
        yield states
        labels = ["box", "name"]
        for name, doc, field, counter in BOX_FIGURES:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=labels)
            for box, sample in self.rows:
                if sample is not None and sample.get(field) is not None:
                    family.add_metric([box["id"], box["name"]], float(sample[field]))
            yield family
        started = CounterMetricFamily("sandlot_box_exec_start_seconds",
                                      "Time from request to running of the commands started, summed",
                                      labels=labels)  # fmt: skip
        sampled = GaugeMetricFamily("sandlot_box_sample_timestamp_seconds", "When the box was last sampled",
                                    labels=labels)  # fmt: skip
        for box, sample in self.rows:
            if sample is None:
                continue
            if sample.get("exec_start_us") is not None:
                started.add_metric([box["id"], box["name"]], sample["exec_start_us"] / 1e6)
            sampled.add_metric([box["id"], box["name"]], sample["at"])
        yield started
        yield sampled
        names = {box["id"]: box["name"] for box, _ in self.rows}
        boxes = CounterMetricFamily("sandlot_box_records_bounded",
                                    "What a box's bounded records folded, dropped or refused (what: "
                                    "folded, dropped, dropped_bytes, refused_dns, refused_connections...)",
                                    labels=[*labels, "record", "what"])  # fmt: skip
        home = CounterMetricFamily("sandlot_records_bounded", "What the home's bounded records dropped",
                                   labels=["record", "what"])  # fmt: skip
        for box_id, recs in sorted(self.bounded.items()):
            for record, counts in sorted(recs.items()):
                for what, n in sorted(counts.items()):
                    if box_id == "":
                        home.add_metric([record, what], float(n))
                    elif box_id in names:
                        boxes.add_metric([box_id, names[box_id], record, what], float(n))
        yield boxes
        yield home


# (name, help, the field of ``BoxStore.chunk_totals``): the home's chunk store (docs/storage.md)
STORAGE_FIGURES = (
    ("sandlot_storage_states", "Saved states kept as chunks", "states"),
    ("sandlot_storage_chunks", "Chunks the home keeps (each once)", "chunks"),
    ("sandlot_storage_stored_bytes", "Bytes the chunks take on disk, compressed, each once", "stored_bytes"),
    ("sandlot_storage_unshared_bytes", "Bytes the states would take if each kept its own chunks",
     "unshared_bytes"),
    ("sandlot_storage_garbage_bytes", "Bytes of chunks no saved state lists, until a collection",
     "garbage_bytes"),
    ("sandlot_storage_tier_bytes", "Bytes of the saved states' chunks that the storage tier holds",
     "remote_bytes"),
)  # fmt: skip
# (name, help, the home's counter): what went to and came from the storage tier
STORAGE_COUNTERS = (
    ("sandlot_storage_tier_sent_bytes", "Bytes sent to the storage tier (chunks, disk files, boxes)",
     "tier_sent_bytes"),
    ("sandlot_storage_tier_received_bytes", "Bytes read from the storage tier (pulls, evicted states loaded)",
     "tier_received_bytes"),
)  # fmt: skip


class _Storage(Collector):
    def __init__(self, totals: dict[str, int]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        for name, doc, field in STORAGE_FIGURES:
            yield GaugeMetricFamily(name, doc, value=float(self.totals[field]))
        for name, doc, field in STORAGE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(self.totals.get(field, 0)))


def exposition(
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]],
    bounded: dict[str, Any] | None = None,
    storage: dict[str, int] | None = None,
) -> bytes:
    """The text format of these boxes and samples, of what their records bounded, and
    (an admin's) of the home's chunk store."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Boxes(rows, bounded or {}))
    if storage is not None:
        registry.register(_Storage(storage))
    return generate_latest(registry)
