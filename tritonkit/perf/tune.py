"""Config search: the most throughput an ensemble gives under a p99 latency budget, on this machine.

    python -m tritonkit.perf.tune text_embedding --p99-ms 50 [--profile throughput] [--minutes 15]
    make tune MODEL=text_embedding P99_MS=50 PROFILE=throughput

Knobs, per composing model (the Python preprocessors included): dynamic_batching max_queue_delay_microseconds
and preferred_batch_size, max_batch_size, instance count, the ORT intra-op thread count and, for ragged inputs,
the length-bucket padding limit (`ragged_max_padding`). Each point is a
variant repository (tritonkit.repository.variants: edited configs, model files symlinked) served by a fresh tritonserver
and measured with perf_analyzer along a concurrency ladder: it climbs while p99 stays within the budget, and the
score is the best throughput among the points within it.

Search: coordinate hill climbing from the current (hand-tuned) config. For each knob in turn it measures the next
value up and down and moves when the score improves by more than the noise margin; it sweeps the knobs until a
pass changes nothing or the time is up. At the end the start and the winner are measured again, interleaved, and
the report shows both, so "at least as good as the hand-tuned config" is a measured statement.

The winner is written as a named profile: `model_repository/<model>/configs/<profile>.pbtxt` for each model that
changed, which tritonserver selects with `--model-config-name=<profile>` (`make serve PROFILE=<profile>`, also in
the NGC container), plus `profiles/<ensemble>.<profile>.json` (knobs, budget, measurements, command). Files are
written all-or-nothing: an interrupted write puts the previous ones back. The search itself never touches
`model_repository/`. `tuned_profiles` regenerates every profile from today's config.pbtxt + the knobs its
tuner changed (`make generate`), so a profile never freezes the config it was tuned from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import paths
from tritonkit.perf.analyzer import PerfError, PerfPoint, run_perf_analyzer, write_input_data
from tritonkit.repository import variants
from tritonkit.repository.profiles import VALUES, Point, apply, changed_configs, get_knob, knobs_of, write_profile

RESULTS = paths.ROOT / "perf" / "results"
LADDER = (1, 2, 4, 8, 16, 32, 64)
NOISE_MARGIN = 0.04  # a move must beat the incumbent by more than the run-to-run spread


@dataclass
class Trial:
    point: Point
    score: float  # best throughput within the budget (0 if none)
    best: PerfPoint | None
    ladder: list[PerfPoint] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        return {"point": self.point, "score": self.score, "best": self.best.to_json() if self.best else None,
                "ladder": [p.to_json() for p in self.ladder], "note": self.note}


@dataclass
class Tuner:
    ensemble: str
    p99_ms: float
    input_data: Path
    measurement_ms: int = 2000
    progress: Callable[[str], None] = print
    repository: Path = paths.MODEL_REPOSITORY
    trials: list[Trial] = field(default_factory=list)

    def __post_init__(self):
        read = lambda m: variants.read_config(m, self.repository, committed=False)  # noqa: E731
        ens = read(self.ensemble)
        self.steps = [s.model_name for s in ens.ensemble_scheduling.step]
        self.configs = {self.ensemble: ens} | {m: read(m) for m in self.steps}
        self.start: Point = {m: {k: get_knob(self.configs[m], k) for k in knobs_of(self.configs[m])}
                             for m in self.steps}
        self.start_c = 8

    def measure(self, point: Point, note: str = "") -> Trial:
        from tritonkit.runtime.server import TritonServer

        configs = apply(self.configs, self.ensemble, point)
        edits = {name: (lambda cfg, new=cfg: cfg.CopyFrom(new)) for name, cfg in configs.items()}
        ladder: list[PerfPoint] = []
        with tempfile.TemporaryDirectory(prefix="tritonkit-tune-") as tmp:
            repo = variants.make_variant(Path(tmp) / "repo", list(configs), edits, source=self.repository,
                                         committed=False)
            server = TritonServer.on_free_ports(model_repository=repo, model_control_mode="explicit",
                                                models=[self.ensemble], exit_timeout_s=5)
            try:
                with server:
                    ladder = self._climb(server.grpc_url)
            except (PerfError, RuntimeError) as err:  # a config the server rejects or that fails under load
                note = f"{note} failed: {str(err).splitlines()[0]}".strip()
        within = [p for p in ladder if p.p99_ms <= self.p99_ms]
        best = max(within, key=lambda p: p.throughput, default=None)
        trial = Trial(point, best.throughput if best else 0.0, best, ladder, note)
        self.trials.append(trial)
        where = f"{trial.score:.1f}/s at c={best.concurrency} (p99 {best.p99_ms:.1f} ms)" if best else "nothing"
        self.progress(f"  [{len(self.trials)}] {describe(point, self.start)}: {where} {note}".rstrip())
        return trial

    def _climb(self, url: str) -> list[PerfPoint]:
        """Up the concurrency ladder from the incumbent's level while p99 is within budget and throughput grows;
        down it when the first level is already over budget."""
        run = lambda c: run_perf_analyzer(self.ensemble, url, c, self.input_data,  # noqa: E731
                                          protocol="grpc", measurement_ms=self.measurement_ms,
                                          stability_percentage=50)
        i = LADDER.index(self.start_c)
        ladder = [run(LADDER[i])]
        step = 1 if ladder[0].p99_ms <= self.p99_ms else -1
        while 0 <= i + step < len(LADDER):
            i += step
            point = run(LADDER[i])
            ladder.append(point)
            if step > 0 and (point.p99_ms > self.p99_ms or point.throughput < ladder[-2].throughput * 1.02):
                break
            if step < 0 and point.p99_ms <= self.p99_ms:
                break
        return ladder

    def search(self, minutes: float) -> tuple[Trial, Trial]:
        deadline = time.monotonic() + minutes * 60
        incumbent = self.measure(self.start, "start (current configs)")
        if incumbent.best:
            self.start_c = incumbent.best.concurrency
        improved = True
        while improved and time.monotonic() < deadline:
            improved = False
            for model in self.steps:
                for knob in knobs_of(self.configs[model]):
                    for value in neighbours(knob, incumbent.point[model][knob]):
                        if time.monotonic() >= deadline:
                            break
                        point = json.loads(json.dumps(incumbent.point))
                        point[model][knob] = value
                        if any(_same(t.point, point) for t in self.trials):
                            continue
                        trial = self.measure(point)
                        if trial.score > incumbent.score * (1 + NOISE_MARGIN):
                            incumbent, improved = trial, True
                            if trial.best:
                                self.start_c = trial.best.concurrency
                            self.progress(f"  → accepted: {trial.score:.1f}/s")
                            break
        return self.trials[0], incumbent

    def confirm(self, start: Trial, winner: Trial, repeats: int = 3) -> dict[str, list[float]]:
        """Start and winner measured again, interleaved, so drift on a shared machine hits both alike."""
        scores: dict[str, list[float]] = {"start": [], "winner": []}
        for _ in range(repeats):
            for name, trial in (("start", start), ("winner", winner)):
                if trial.best:
                    self.start_c = trial.best.concurrency
                scores[name].append(self.measure(trial.point, f"confirm {name}").score)
        return scores


def neighbours(knob: str, value) -> list:
    values = list(VALUES[knob])
    if value not in values:
        values = sorted({*values, value})
    i = values.index(value)
    return [values[j] for j in (i + 1, i - 1) if 0 <= j < len(values)]


def _same(a: Point, b: Point) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def describe(point: Point, start: Point) -> str:
    changes = [f"{m}.{k}={v}" for m, knobs in point.items() for k, v in knobs.items() if start[m][k] != v]
    return ", ".join(changes) or "start"



def profile_configs(tuner: Tuner, point: Point) -> dict[str, mc.ModelConfig]:
    return changed_configs(tuner.configs, tuner.ensemble, point)


def plot(tuner: Tuner, winner: Trial, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    every = [p for t in tuner.trials for p in t.ladder]
    ax.scatter([p.p99_ms for p in every], [p.throughput for p in every], s=12, c="0.7",
               label="every point tried (config × concurrency)")
    bests = [t for t in tuner.trials if t.best]
    ax.scatter([t.best.p99_ms for t in bests], [t.best.throughput for t in bests], s=22, c="tab:blue",
               label="best within budget, per config")
    first = tuner.trials[0]
    if first.best:
        ax.scatter([first.best.p99_ms], [first.best.throughput], marker="s", s=80, c="tab:orange",
                   label="start (hand-tuned)")
    if winner.best:
        ax.scatter([winner.best.p99_ms], [winner.best.throughput], marker="*", s=200, c="tab:red", label="winner")
    ax.axvline(tuner.p99_ms, ls="--", c="k", lw=1, label=f"p99 budget {tuner.p99_ms:g} ms")
    ax.set(xscale="log", xlabel="p99 latency (ms)", ylabel="inferences/s",
           title=f"make tune {tuner.ensemble}: {len(tuner.trials)} configs")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from tritonkit.perf import lab

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", help="ensemble to tune: a spec name (models/*.toml)")
    parser.add_argument("--p99-ms", type=float, required=True, help="p99 latency budget (ms)")
    parser.add_argument("--profile", default="tuned", help="profile name to write (default: tuned)")
    parser.add_argument("--minutes", type=float, default=15.0, help="search time budget (default 15)")
    parser.add_argument("--measurement-ms", type=int, default=2000)
    parser.add_argument("--confirm-repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="search and report, write no profile")
    args = parser.parse_args(argv)
    if not args.profile.replace("_", "").replace("-", "").isalnum() or args.profile == "config":
        parser.error(f"--profile: '{args.profile}' must be letters, digits, '-' or '_' (and not 'config')")

    from tritonkit import build, kinds

    if args.model not in kinds.names():
        parser.error(f"model '{args.model}' is not a spec (known: {', '.join(kinds.names())})")
    pipeline = lab.pipeline(args.model)

    build.build(pipeline.name, progress=False)
    out_dir = RESULTS / f"tune-{args.model}-{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    data = write_input_data(out_dir / "input.json", pipeline.workloads[0].rows())
    tuner = Tuner(args.model, args.p99_ms, data, measurement_ms=args.measurement_ms)
    print(f"tuning {args.model} (steps: {', '.join(tuner.steps)}) for p99 <= {args.p99_ms:g} ms, "
          f"{args.minutes:g} min; results in {out_dir.relative_to(paths.ROOT)}", flush=True)
    start, winner = tuner.search(args.minutes)
    confirm = tuner.confirm(start, winner, args.confirm_repeats) if args.confirm_repeats else {}
    med = {k: statistics.median(v) for k, v in confirm.items() if v}
    command = f"make tune MODEL={args.model} P99_MS={args.p99_ms:g} PROFILE={args.profile}"
    record = {
        "ensemble": args.model, "profile": args.profile, "p99_budget_ms": args.p99_ms, "command": command,
        "models": [*tuner.steps, args.model], "start": start.point, "winner": winner.point,
        "changes": describe(winner.point, start.point),
        "search": {"configs_tried": len(tuner.trials) - 2 * args.confirm_repeats, "minutes": args.minutes},
        "confirm_median": med, "confirm_runs": confirm,
        "winner_best": winner.best.to_json() if winner.best else None,
        "machine": f"{os.cpu_count()} cores", "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    (out_dir / "trials.json").write_text(json.dumps([t.to_json() for t in tuner.trials], indent=2))
    (out_dir / "report.json").write_text(json.dumps(record, indent=2))
    png = plot(tuner, winner, out_dir / "search.png")
    lines = [f"# make tune {args.model}, p99 <= {args.p99_ms:g} ms", "", f"![search]({png.name})", "",
             "| # | config (changes from start) | best within budget /s | at c | p99 ms | note |",
             "|---:|---|---:|---:|---:|---|"]
    for i, t in enumerate(tuner.trials, 1):
        b = t.best
        lines.append(f"| {i} | {describe(t.point, start.point)} | {t.score:.1f} | {b.concurrency if b else ''} | "
                     f"{f'{b.p99_ms:.1f}' if b else ''} | {t.note} |")
    if med:
        lines += ["", f"Confirmation (median of {args.confirm_repeats}, interleaved): "
                  f"start {med.get('start', 0):.1f}/s, winner {med.get('winner', 0):.1f}/s "
                  f"({describe(winner.point, start.point)})."]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.dry_run:
        return 0
    # Never publish a profile measured worse than where the search started.
    if med and med.get("winner", 0) < med.get("start", 0):
        winner = start
        record["winner"], record["changes"] = start.point, "start (the winner did not hold up on confirmation)"
    written = write_profile(args.profile, profile_configs(tuner, winner.point), record)
    print("wrote " + ", ".join(str(p.relative_to(paths.ROOT)) for p in written))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
