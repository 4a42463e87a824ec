"""A quantization's report: the recipe, its metrics against their gates and the other recipes measured, as JSON
and as a table."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tritonkit.int8.settings import QuantRecipe
from tritonkit.kinds.gates import Target


@dataclass
class QuantReport:
    model: str
    recipe: QuantRecipe
    metrics: dict[str, float]
    targets: list[Target]
    # Other recipes measured the same way (the reason this one was chosen), each {"recipe": ..., metrics...}.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    @property
    def passed(self) -> bool:
        return all(t.met(self.metrics) for t in self.targets)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "created": self.created,
            "passed": self.passed,
            "recipe": self.recipe.to_json(),
            "metrics": self.metrics,
            "targets": [
                {**asdict(t), "met": t.met(self.metrics), "got": self.metrics.get(t.metric)} for t in self.targets
            ],
            "candidates": self.candidates,
            "details": self.details,
        }

    def write(self, path: Path) -> Path:
        import json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def print_table(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        # Wide enough for the candidates table when printed to a file or CI log.
        console = console or Console(width=None if sys.stdout.isatty() else 150)
        table = Table(title=f"{self.model} INT8 vs FP32 — recipe '{self.recipe.name}'")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("target", justify="right")
        table.add_column("met", justify="center")
        by_metric = {t.metric: t for t in self.targets}
        for name, value in self.metrics.items():
            t = by_metric.get(name)
            table.add_row(
                name,
                f"{value:.5f}" if isinstance(value, float) else str(value),
                f"{t.op} {t.value}" if t else "",
                ("yes" if t.met(self.metrics) else "NO") if t else "",
            )
        console.print(table)
        if self.candidates:
            keys = [k for k in self.candidates[0] if k != "recipe"]
            cand = Table(title="recipes measured (same calibration and evaluation sets)")
            cand.add_column("recipe")
            for k in keys:
                cand.add_column(k, justify="right")
            for row in self.candidates:
                cand.add_row(row["recipe"], *[_fmt(row.get(k)) for k in keys])
            console.print(cand)
        console.print(f"targets {'met' if self.passed else 'NOT met'}; why this recipe: {self.recipe.rationale}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)
