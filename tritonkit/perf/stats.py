"""Triton's statistics API, read one way for every benchmark: `read` takes cumulative counters per model, summed over
the versions loaded; subtracting two reads gives what happened between them, and `Counters.split` says it per
request and per execution.

Two views of compute time exist in the API and both are kept: `inference_stats` adds an execution's time once per
request it served (what a request waited in compute), `batch_stats` once per execution (what the model's instance
spent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

_COMPUTE_PARTS = ("compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Counters:
    """One model's cumulative counters (or, after `a - b`, those between two reads)."""

    success: int = 0
    fail: int = 0  # failed in the server, shedding by a queue policy included
    cache_hit: int = 0
    cache_miss: int = 0
    queue_ns: int = 0  # time requests waited in the scheduler (dynamic batcher)
    compute_ns: int = 0  # input copy + run + output copy, once per request
    inferences: int = 0  # items, a batch of n counting n
    executions: int = 0
    execution_ns: int = 0  # input copy + run + output copy, once per execution
    batches: Mapping[int, int] = field(default_factory=dict)  # batch size -> executions of that size

    @classmethod
    def of(cls, entries: Sequence[dict]) -> Counters:
        """Summed over the `model_stats` entries of one model (one per loaded version), as the JSON API gives them."""
        total: dict = {f.name: 0 for f in fields(cls) if f.name != "batches"}
        batches: dict[int, int] = {}
        for e in entries:
            st = e.get("inference_stats", {})
            for key in ("success", "fail", "cache_hit", "cache_miss"):
                total[key] += int(st.get(key, {}).get("count", 0))
            total["queue_ns"] += int(st.get("queue", {}).get("ns", 0))
            total["compute_ns"] += sum(int(st.get(p, {}).get("ns", 0)) for p in _COMPUTE_PARTS)
            total["inferences"] += int(e.get("inference_count", 0))
            total["executions"] += int(e.get("execution_count", 0))
            for b in e.get("batch_stats", []):
                size = int(b["batch_size"])
                batches[size] = batches.get(size, 0) + int(b["compute_infer"]["count"])
                total["execution_ns"] += sum(int(b.get(p, {}).get("ns", 0)) for p in _COMPUTE_PARTS)
        return cls(**total, batches=batches)

    def __sub__(self, before: Counters) -> Counters:
        values = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self) if f.name != "batches"}
        batches = {size: n - before.batches.get(size, 0) for size, n in self.batches.items()}
        return Counters(**values, batches={size: n for size, n in batches.items() if n})

    def split(self) -> dict[str, float]:
        """Per request and per execution (of a difference of two reads); NaN where nothing was served."""
        per = lambda ns, n: ns / n / 1e6 if n else math.nan  # noqa: E731
        return {"requests": self.success, "failed": self.fail,
                "queue_ms": per(self.queue_ns, self.success), "compute_ms": per(self.compute_ns, self.success),
                "batch": self.inferences / self.executions if self.executions else math.nan,
                "execution_ms": per(self.execution_ns, self.executions)}


def read(http_url: str, models: Sequence[str]) -> dict[str, Counters]:
    """Cumulative counters of each of `models` (GET /v2/models/<m>/stats through tritonclient's HTTP client)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        return {m: Counters.of(client.get_inference_statistics(m)["model_stats"]) for m in models}
    finally:
        client.close()


def between(before: Mapping[str, Counters], after: Mapping[str, Counters]) -> dict[str, dict[str, float]]:
    """`Counters.split` per model of what happened between two `read`s."""
    return {m: (a - before.get(m, Counters())).split() for m, a in after.items()}
