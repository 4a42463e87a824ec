"""`python -m tritonkit.build ARGS` with a ledger of what it measured: every whole-split evaluation of a graph
(tritonkit.int8.evaluate.Evaluator.metrics, the packed proof's and the runtime choice's accuracy checks) and every
timing of a graph at the served batch sizes (tritonkit.int8.speed.speedup; a rival raced against its parent,
tritonkit.int8.speed.race), keyed by the graph's sha256, every
measurement of the FP32 graph's seconds a row (tritonkit.int8.floor.row_seconds) and every construction of a form's
`Gates` (tritonkit.int8.gates), written as JSON to $COUNTED_BUILD_LEDGER. The measuring code runs unchanged: each
spy records, then calls through.

    python tests/support/counted_build.py <build args...>
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path


def _digest(model) -> str:
    if hasattr(model, "SerializeToString"):
        return hashlib.sha256(model.SerializeToString()).hexdigest()
    return hashlib.sha256(Path(model).read_bytes()).hexdigest()


def main(argv: list[str]) -> int:
    from tritonkit import build
    from tritonkit.int8 import evaluate, speed
    from tritonkit.repository import runtime_choice

    ledger: list[dict] = []
    metrics, speedup, accuracy = evaluate.Evaluator.metrics, speed.speedup, runtime_choice.accuracy

    def counted_metrics(self, model, exact=False):
        whole = len(self.batches) == len(self.spec.eval_batches(self.split))
        if whole:  # a sample (every third batch) ranks candidates; only whole splits judge
            ledger.append({"what": "evaluate", "split": self.split, "graph": _digest(model), "exact": exact})
        return metrics(self, model, exact)

    def counted_speedup(spec, fp32, model, batches, *args, **kwargs):
        if list(batches) == list(spec.SPEED_BATCHES):
            ledger.append({"what": "time", "graph": _digest(model), "variants": list(kwargs.get("variants", ()))})
        return speedup(spec, fp32, model, batches, *args, **kwargs)

    def counted_accuracy(kind, path, fp32, variant, threads, batches=None):
        ledger.append({"what": "evaluate", "split": "test", "graph": _digest(path), "variant": variant})
        return accuracy(kind, path, fp32, variant, threads, batches)

    from tritonkit.kinds.text import TextEmbedding

    write_packed = TextEmbedding.write_packed

    def counted_write_packed(self, model_path, fp32=None, judge=None, reference=None):
        if fp32 is not None:  # an INT8 graph's packed form, judged on the test split (a float one: a few texts)
            ledger.append({"what": "evaluate", "split": "test", "graph": _digest(model_path) + ":packed"})
        return write_packed(self, model_path, fp32, judge, reference)

    race = speed.race

    def counted_race(spec, fp32, parent, rivals, batches, *args, **kwargs):
        # A rival's speed comes from its race with its parent (a trim or finer granularity that beat the parent
        # serves with it); the parent, timed before, is timed again there head to head, by design.
        for variant, model in rivals.values():
            ledger.append({"what": "race", "graph": _digest(model), "variants": [fp32[0], variant]})
        return race(spec, fp32, parent, rivals, batches, *args, **kwargs)

    TextEmbedding.write_packed = counted_write_packed
    speed.race = counted_race
    evaluate.Evaluator.metrics = counted_metrics
    speed.speedup = counted_speedup
    runtime_choice.accuracy = counted_accuracy
    # Modules that imported speedup by name before the spy was set: bind theirs too.
    from tritonkit.int8 import context, floor, gates, timing

    context.speedup = timing.speedup = counted_speedup
    timing.race = counted_race
    row_seconds, make_gates = floor.row_seconds, gates._make

    def counted_row_seconds(kind, fp32, *args, **kwargs):
        ledger.append({"what": "row_seconds", "graph": _digest(fp32)})
        return row_seconds(kind, fp32, *args, **kwargs)

    def counted_gates(kind, form, *args, **kwargs):
        ledger.append({"what": "gates", "form": form})
        return make_gates(kind, form, *args, **kwargs)

    floor.row_seconds, gates._make = counted_row_seconds, counted_gates
    try:
        return build.main(argv)
    finally:
        Path(os.environ["COUNTED_BUILD_LEDGER"]).write_text(json.dumps(ledger, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
