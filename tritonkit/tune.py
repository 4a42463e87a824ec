"""Config search: the most throughput an ensemble gives under a p99 latency budget, on this machine.

    python -m tritonkit.tune text_embedding --p99-ms 50 [--profile throughput] [--minutes 15]
    make tune MODEL=text_embedding P99_MS=50 PROFILE=throughput

Knobs, per composing model (the Python preprocessors included): dynamic_batching max_queue_delay_microseconds
and preferred_batch_size, max_batch_size, instance count, the ORT intra-op thread count and, for ragged inputs,
the length-bucket padding limit (`ragged_max_padding`). Each point is a
variant repository (tritonkit.repo_variants: edited configs, model files symlinked) served by a fresh tritonserver
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

from tritonkit import paths, repo_variants
from tritonkit.config import check_config, to_pbtxt
from tritonkit.perf import PerfError, PerfPoint, run_perf_analyzer, write_input_data
from tritonkit.serving.runtimes import THREAD_PARAMETER

PROFILES = paths.ROOT / "profiles"
RESULTS = paths.ROOT / "perf" / "results"
LADDER = (1, 2, 4, 8, 16, 32, 64)
NOISE_MARGIN = 0.04  # a move must beat the incumbent by more than the run-to-run spread

# knob → candidate values, in order (neighbours are the adjacent entries)
VALUES: dict[str, tuple] = {
    "queue_delay_us": (0, 250, 500, 1000, 2000, 4000, 8000, 16000),
    "preferred_batch": (0, 4, 8, 16, 32),  # 0: none (the batcher sends as large a batch as is queued)
    "max_batch": (8, 16, 32, 64, 128),
    "instances": (1, 2, 3, 4),
    "threads": (1, 2, 4),
    "bucket_padding": (0.1, 0.25, 0.4, 1.0),  # ragged_max_padding; 1.0: one run per execute()
}


def get_knob(cfg: mc.ModelConfig, knob: str):
    if knob == "queue_delay_us":
        return cfg.dynamic_batching.max_queue_delay_microseconds
    if knob == "preferred_batch":
        return max(cfg.dynamic_batching.preferred_batch_size, default=0)
    if knob == "max_batch":
        return cfg.max_batch_size
    if knob == "instances":
        return cfg.instance_group[0].count if cfg.instance_group else 1
    # .get(): indexing a protobuf map would insert the missing key into the config being read.
    if knob == "threads":
        param = cfg.parameters.get(THREAD_PARAMETER.get(cfg.backend, "intra_op_thread_count"))
        return int(param.string_value) if param and param.string_value else 0
    if knob == "bucket_padding":
        param = cfg.parameters.get("ragged_max_padding")
        return float(param.string_value) if param and param.string_value else 1.0
    raise KeyError(knob)


def set_knob(cfg: mc.ModelConfig, knob: str, value) -> None:
    if knob == "queue_delay_us":
        cfg.dynamic_batching.max_queue_delay_microseconds = value
    elif knob == "preferred_batch":
        del cfg.dynamic_batching.preferred_batch_size[:]
        if value:
            cfg.dynamic_batching.preferred_batch_size.append(min(value, cfg.max_batch_size))
    elif knob == "max_batch":
        cfg.max_batch_size = value
        pbs = [b for b in cfg.dynamic_batching.preferred_batch_size if b <= value]
        del cfg.dynamic_batching.preferred_batch_size[:]
        cfg.dynamic_batching.preferred_batch_size.extend(pbs)
    elif knob == "instances":
        if not cfg.instance_group:
            cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU)
        cfg.instance_group[0].count = value
    elif knob == "threads":
        cfg.parameters[THREAD_PARAMETER.get(cfg.backend, "intra_op_thread_count")].string_value = str(value)
    elif knob == "bucket_padding":
        cfg.parameters["ragged_max_padding"].string_value = f"{value:g}"
    else:
        raise KeyError(knob)


def knobs_of(cfg: mc.ModelConfig) -> list[str]:
    knobs = []
    if cfg.HasField("dynamic_batching"):
        knobs += ["queue_delay_us", "preferred_batch"]
    knobs += ["max_batch", "instances"]
    if cfg.backend in THREAD_PARAMETER:
        knobs.append("threads")
        if any(i.allow_ragged_batch for i in cfg.input):
            knobs.append("bucket_padding")
    return knobs


Point = dict[str, dict[str, object]]  # model → knob → value


def apply(configs: dict[str, mc.ModelConfig], ensemble: str, point: Point) -> dict[str, mc.ModelConfig]:
    """Copies of the configs with the point's knobs set; the ensemble's max_batch_size follows its steps'."""
    out = {}
    for name, cfg in configs.items():
        new = mc.ModelConfig()
        new.CopyFrom(cfg)
        for knob, value in point.get(name, {}).items():
            set_knob(new, knob, value)
        out[name] = new
    out[ensemble].max_batch_size = min(out[s.model_name].max_batch_size
                                       for s in out[ensemble].ensemble_scheduling.step)
    for cfg in out.values():
        check_config(cfg)
    return out


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
        read = lambda m: repo_variants.read_config(m, self.repository, committed=False)  # noqa: E731
        ens = read(self.ensemble)
        self.steps = [s.model_name for s in ens.ensemble_scheduling.step]
        self.configs = {self.ensemble: ens} | {m: read(m) for m in self.steps}
        self.start: Point = {m: {k: get_knob(self.configs[m], k) for k in knobs_of(self.configs[m])}
                             for m in self.steps}
        self.start_c = 8

    def measure(self, point: Point, note: str = "") -> Trial:
        from tritonkit.server import TritonServer

        configs = apply(self.configs, self.ensemble, point)
        edits = {name: (lambda cfg, new=cfg: cfg.CopyFrom(new)) for name, cfg in configs.items()}
        ladder: list[PerfPoint] = []
        with tempfile.TemporaryDirectory(prefix="tritonkit-tune-") as tmp:
            repo = repo_variants.make_variant(Path(tmp) / "repo", list(configs), edits, source=self.repository,
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


# -- profiles --------------------------------------------------------------------------------------------------

def changed_configs(base: dict[str, mc.ModelConfig], ensemble: str, point: Point) -> dict[str, mc.ModelConfig]:
    """The configs that differ from `base` at this point (only these get a configs/<profile>.pbtxt)."""
    new = apply(base, ensemble, point)
    return {name: cfg for name, cfg in new.items() if to_pbtxt(cfg) != to_pbtxt(base[name])}


def profile_configs(tuner: Tuner, point: Point) -> dict[str, mc.ModelConfig]:
    return changed_configs(tuner.configs, tuner.ensemble, point)


def profile_files(profile: str, configs: dict[str, mc.ModelConfig], record: dict,
                  repository: Path = paths.MODEL_REPOSITORY) -> dict[Path, str]:
    """configs/<profile>.pbtxt text per changed model, headed by where its knobs come from."""
    header = (f"# Profile '{profile}': config.pbtxt with the knobs `{record['command']}` chose (tritonkit.tune); "
              f"generated, do not edit.\n# Serve it with `make serve PROFILE={profile}` / tritonserver "
              f"--model-config-name={profile}. Knobs and measurements: profiles/{record['ensemble']}.{profile}.json\n")
    return {Path(repository) / name / "configs" / f"{profile}.pbtxt": header + to_pbtxt(cfg)
            for name, cfg in configs.items()}


def tuned_profiles(repository: Path = paths.MODEL_REPOSITORY) -> dict[Path, str]:
    """configs/<profile>.pbtxt of every committed tune record: today's config.pbtxt with the knobs the tuner changed
    from where it started, so a profile follows its spec (parameters added or defaults measured after it was tuned)
    instead of freezing the config it was tuned from."""
    out: dict[Path, str] = {}
    for path in sorted(PROFILES.glob("*.json")):
        record = json.loads(path.read_text())
        if not all((Path(repository) / m / "config.pbtxt").exists() for m in record["models"]):
            continue  # a spec whose configs are not generated yet
        base = {m: repo_variants.read_config(m, repository, committed=False) for m in record["models"]}
        moved = {m: {k: v for k, v in knobs.items() if record["start"].get(m, {}).get(k) != v}
                 for m, knobs in record["winner"].items()}
        out |= profile_files(record["profile"], changed_configs(base, record["ensemble"], moved), record, repository)
    return out


def write_profile(profile: str, configs: dict[str, mc.ModelConfig], record: dict,
                  repository: Path = paths.MODEL_REPOSITORY) -> list[Path]:
    """configs/<profile>.pbtxt per changed model + profiles/<ensemble>.<profile>.json, all or nothing."""
    targets = profile_files(profile, configs, record, repository)
    targets[PROFILES / f"{record['ensemble']}.{profile}.json"] = json.dumps(record, indent=2) + "\n"
    # The previous profile of this ensemble: files of models no longer changed are removed.
    stale = {Path(repository) / m / "configs" / f"{profile}.pbtxt" for m in record["models"]} - set(targets)
    backups = {p: p.read_bytes() for p in [*targets, *stale] if p.exists()}
    written: list[Path] = []
    try:
        for path, text in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            written.append(path)
        for path in stale:
            path.unlink(missing_ok=True)
    except BaseException:  # Ctrl-C included: leave the previous profile as it was
        for path in targets:
            path.with_suffix(path.suffix + ".tmp").unlink(missing_ok=True)
        for path in written:
            if path in backups:
                path.write_bytes(backups[path])
            else:
                path.unlink(missing_ok=True)
        for path in stale:
            if path in backups:
                path.write_bytes(backups[path])
        raise
    return sorted(targets)


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
    from tritonkit import lab

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
