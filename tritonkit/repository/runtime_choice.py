"""Which CPU runtime serves each built ONNX file, chosen by measurement (`make build` runs it after INT8).

For every served file of a spec (the INT8 and FP32 models; a text encoder's packed form where the build wrote one,
since that is what the backend runs), each VARIANT (onnxruntime, openvino f32, and for gated files on a BF16 CPU
openvino-bf16) is timed at the kind's served batch sizes with the served threads per instance, over MIXES random
text mixes (a server's shapes), runs interleaved, median of repeats. The fastest variant that beats ONNX Runtime
by MIN_GAIN serves only if accuracy holds on it too, against the FP32 graph under ONNX Runtime on the test split
(the INT8 gates, or the export tolerance for an FP32 file); otherwise the next, else ONNX Runtime, and the record
says why for each.

The choice is committed per CPU INT8 class (envinfo.int8_class) in models/<name>.runtime.json, with the numbers,
both runtimes' versions and the CPU that measured them. The committed configs name COMMITTED_CLASS's choice; a
replica of any class serves its own class's record or FP32 (tritonkit.repository.replica), never another's. An
unchanged file (or an INT8 file rebuilt from the same FP32 file, recipe and packages: calibration is not
bit-reproducible, see source_digest) keeps its committed choice; a build on a class with no entry measures nothing
and writes nothing unless asked: `python -m tritonkit.build <name> --choose-runtime` measures this class.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from tritonkit import envinfo, paths
from tritonkit.int8.budget import Budget
from tritonkit.int8.evaluate import EXACT_COSINE, cosine_min, reference_ready, row_count
from tritonkit.int8.params import file_digest
from tritonkit.serving import runtimes
from tritonkit.serving.runtimes import DEFAULT, MIN_GAIN, VARIANTS, needs_bf16, open_variant, usable_here

# Distinct text mixes timed per batch size: a server's every call has a new input shape, and OpenVINO prepares
# kernels per shape (docs/runtimes.md), so one repeated batch would overstate it.
MIXES = 24
# Mixes per timed sample: every mix runs once untimed per variant (the steady state), then each round times the
# next SAMPLE_MIXES of them on every variant, so the rounds' medians compare the same inputs. A quarter of the mixes
# times MPNet's FP32 file in 89 s, all of them in 246 s (perf/bench_runtime_choice.py), and 7 rounds still cover
# every mix.
SAMPLE_MIXES = 6
# Timed rounds per batch size, and the fewest a build's budget may cut them to (a median still).
ROUNDS = 7
MIN_ROUNDS = 3
# Of a file's share of a build's budget, what the timing may take; the rest is for the accuracy checks.
TIMING_SHARE = 0.6


def choice_path(kind) -> Path:
    return kind.spec.file.with_name(f"{kind.NAME}.runtime.json")


def load(kind) -> dict:
    """The committed choices; none for a spec that lives in no file (made in memory, e.g. by tests)."""
    if kind.spec.file is None:
        return {"classes": {}}
    path = choice_path(kind)
    return json.loads(path.read_text()) if path.exists() else {"classes": {}}


# The committed configs in model_repository/ speak for this class (the reference machine's), whatever machine
# generates them; each replica derives its own class's at start (tritonkit.repository.replica).
COMMITTED_CLASS = "vnni"


def entry(kind, cpu_class: str | None = None) -> tuple[str | None, dict]:
    """(class, entry) for this CPU's class, else the first measured class (borrowed, for build-time timing only:
    replicas read `recorded`), else (None, {})."""
    classes = load(kind)["classes"]
    cpu_class = cpu_class or envinfo.int8_class()
    if cpu_class in classes:
        return cpu_class, classes[cpu_class]
    for other in sorted(classes):
        return other, classes[other]
    return None, {}


def recorded(kind, cpu_class: str) -> dict:
    """The entry measured on `cpu_class` itself ({} where that class measured nothing): what its replicas serve."""
    return load(kind)["classes"].get(cpu_class, {})


def runtime_for(kind, model: str, cpu_class: str | None = None) -> str:
    """The runtime `model` (a served model of this spec) is configured with."""
    return VARIANTS[variant_for(kind, model, cpu_class)][0]


def variant_for(kind, model: str, cpu_class: str | None = None) -> str:
    """The variant recorded for `model`: `cpu_class`'s own record when a class is named, else this CPU's entry."""
    record = recorded(kind, cpu_class) if cpu_class else entry(kind)[1]
    return record.get("models", {}).get(model, {}).get("runtime", DEFAULT)


def served_variants(kind) -> tuple[str, str | None]:
    """The variants this CPU class serves the FP32 and INT8 models on (its committed record; ONNX Runtime before any
    choice), bf16-free where this CPU has no native bf16 (usable_here): read once per build, before its INT8 stage,
    which races and judges on them. INT8's is None before the INT8 name has a record (a new model): its search times
    the INT8 file where FP32 runs fastest (tritonkit.int8.pipeline.run)."""
    fp32 = usable_here(variant_for(kind, kind.FP32_MODEL))
    int8 = entry(kind)[1].get("models", {}).get(kind.INT8_MODEL, {}).get("runtime")
    return fp32, None if int8 is None else usable_here(int8)


def variant_parameters(kind, variant: str) -> dict[str, str]:
    """The config parameters `variant` adds (OpenVINO's bf16 hint, by its native name; the packing bucket only for
    a kind that packs)."""
    params = dict(VARIANTS[variant][1])
    if not getattr(kind, "packable", False):
        for packed_only in ("packed_width_multiple", "packed_static_rows"):
            params.pop(packed_only, None)
    return params


def parameters_for(kind, model: str, cpu_class: str | None = None) -> dict[str, str]:
    """The config parameters the variant chosen for `model` adds (variant_parameters)."""
    return variant_parameters(kind, variant_for(kind, model, cpu_class))


def serve_on(runtime: str):
    """Serve a model of our embedded backends (or a fused model's encoder) on `runtime`, same threads per
    instance (none named: the runtime's default); OpenVINO's own parameters go when it leaves OpenVINO."""
    from tritonkit.repository.native_check import OPENVINO_PARAMETERS
    from tritonkit.serving.runtimes import THREAD_PARAMETER

    def edit(cfg) -> None:  # a tritonclient ModelConfig
        threads = next((cfg.parameters[k].string_value for k in THREAD_PARAMETER.values() if k in cfg.parameters),
                       "")
        leaving = {*OPENVINO_PARAMETERS, "packed_static_rows"} if runtime != "openvino" else set()
        drop = set(THREAD_PARAMETER.values()) | leaving
        for key in [k for k in cfg.parameters if k in drop]:
            del cfg.parameters[key]
        if threads:
            cfg.parameters[THREAD_PARAMETER[runtime]].string_value = threads
        if cfg.backend == "python":
            cfg.parameters["runtime"].string_value = runtime
        else:
            cfg.backend = runtime
    return edit


def served_session(kind, model: str, path: Path):
    """`path` opened as `model`'s config serves it (its runtime, precision and threads), with an
    onnxruntime-style `run(names, feeds)`: the offline twin of what the server runs."""
    return open_variant(variant_for(kind, model), path, served_threads(kind, model), kind.spec.serving.max_batch_size)


def _variant_width_multiple(variant: str) -> int:
    return int(dict(VARIANTS[variant][1]).get("packed_width_multiple", "1"))


def width_multiple(kind, model: str) -> int:
    """The packed row-width bucket `model`'s backend uses (1: none)."""
    return _variant_width_multiple(variant_for(kind, model))


def served_int8(kind) -> tuple[str, Path, str]:
    """(variant, file, OpenVINO precision "bf16" or "f32") the INT8 model is served with here."""
    variant = variant_for(kind, kind.INT8_MODEL)
    return variant, served_file(paths.model_file(kind.INT8_MODEL)), "bf16" if needs_bf16(variant) else "f32"


def served_file(path: Path) -> Path:
    """What the backend runs for `path`: its packed form where the build wrote one."""
    from tritonkit.serving import packing

    packed = packing.packed_path(path)
    return packed if packed.exists() else path


def _output(kind) -> str:
    return getattr(kind, "OUTPUT", None) or kind.OUTPUTS[0]


def served_feeds(kind, path: Path, batch: int, variant: str) -> list[dict[str, np.ndarray]]:
    """The kind's timing feeds at `batch` (Kind.timing_feeds: MIXES batches where shapes vary), as the served
    backend would feed `variant`: a packed file takes the same random benchmark texts (fixed seed) packed."""
    if path.name.endswith(".packed.onnx"):
        from tritonkit import data

        texts = data.split("benchmark")
        rng = np.random.default_rng(batch)
        mixes = [[texts[int(j)] for j in rng.choice(len(texts), batch, replace=False)] for _ in range(MIXES)]
        return [kind.packed_feeds(m, width_multiple=_variant_width_multiple(variant)) for m in mixes]
    return kind.timing_feeds(batch, MIXES)


class BudgetSpent(Exception):
    """A measurement that would not finish in what is left of a build's budget (the message says what it needs)."""


def fit_rounds(per_mix: dict[str, float], budget_s: float, most: int, min_sample_s: float, available: int = MIXES
               ) -> tuple[int, int]:
    """(rounds, mixes): the most timed rounds (MIN_ROUNDS..`most`) that fit in `budget_s`, from the seconds a mix
    took per variant in the warm-up (`per_mix`; the first SAMPLE_MIXES of the `available` mixes). A round times
    SAMPLE_MIXES mixes on every variant, and each further mix the rounds rotate through is warmed first (OpenVINO
    prepares kernels per shape); where no such plan fits, the rounds re-time the warmed mixes alone; where
    MIN_ROUNDS of those do not fit either, BudgetSpent. An overestimate where the warm-up prepared kernels: the cut
    errs towards fewer rounds."""
    per_round = sum(max(min_sample_s, SAMPLE_MIXES * t) for t in per_mix.values())
    each, warmed = sum(per_mix.values()), min(SAMPLE_MIXES, available)
    for rotate in (True, False):
        for rounds in range(most, min(MIN_ROUNDS, most) - 1, -1):
            mixes = min(available, rounds * SAMPLE_MIXES) if rotate else warmed
            if (mixes - warmed) * each + rounds * per_round <= budget_s:
                return rounds, mixes
    raise BudgetSpent(f"{min(MIN_ROUNDS, most)} timed rounds need about {min(MIN_ROUNDS, most) * per_round:.0f} s, "
                      f"{max(budget_s, 0.0):.0f} s left")


def time_variants(kind, path: Path, variants, batches, threads: int, repeats: int = ROUNDS,
                  min_sample_s: float = 0.05, budget_s: float | None = None, rounds_used: dict | None = None
                  ) -> dict[str, dict[str, float]]:
    """{variant: {"batch<n>": items/s}}: every mix a round will time run once per variant untimed, then `repeats`
    rounds, each timing the next SAMPLE_MIXES mixes (rotating) on every variant in turn, looped to `min_sample_s`;
    median of rounds. `budget_s`: seconds the whole measurement may take, shared evenly by the batch sizes left;
    their rounds and mixes are cut to fit (fit_rounds), the rounds written to `rounds_used` by batch size."""
    sample_mixes = SAMPLE_MIXES  # read at each call: perf/bench_runtime_choice.py sets it
    started = time.perf_counter()
    runners = {v: open_variant(v, path, threads, kind.spec.serving.max_batch_size) for v in variants}
    out: dict[str, dict[str, float]] = {v: {} for v in runners}
    names = [_output(kind)]
    for i, batch in enumerate(batches):
        feeds = {v: served_feeds(kind, path, batch, v) for v in runners}
        available = min(len(f) for f in feeds.values())  # a kind without texts times one batch
        warmed, per_mix = min(sample_mixes, available), {}
        for v, session in runners.items():  # every shape timed runs once before: the server's steady state
            t0 = time.perf_counter()
            for f in feeds[v][:warmed]:
                session.run(names, f)
            per_mix[v] = (time.perf_counter() - t0) / warmed
        rounds, used = repeats, min(available, max(repeats * sample_mixes, warmed))
        if budget_s is not None:
            share = (budget_s - (time.perf_counter() - started)) / (len(batches) - i)
            rounds, used = fit_rounds(per_mix, share, repeats, min_sample_s, available)
        for v, session in runners.items():
            for f in feeds[v][warmed:used]:
                session.run(names, f)
        samples: dict[str, list[float]] = {v: [] for v in runners}
        for r in range(rounds):
            for v, session in runners.items():
                mixes = [feeds[v][(r * sample_mixes + j) % used] for j in range(sample_mixes)]
                t0, n = time.perf_counter(), 0
                while True:
                    for f in mixes:
                        session.run(names, f)
                    n += 1
                    if time.perf_counter() - t0 >= min_sample_s:
                        break
                samples[v].append(batch * len(mixes) * n / (time.perf_counter() - t0))
        for v in runners:
            out[v][f"batch{batch}"] = round(statistics.median(samples[v]), 2)
        if rounds_used is not None:
            rounds_used[f"batch{batch}"] = rounds
    return out


def _rate(items_per_s: dict[str, float]) -> float:
    """Items a second at the largest timed batch size."""
    return max(items_per_s[max(items_per_s, key=lambda b: int(b.removeprefix("batch")))], 1e-9)


def check_seconds(rows: int, row_s: float, gain: float, threads: int, reference: bool) -> float:
    """About how long accuracy() takes: the variant over the test split's `rows`, from the FP32 graph's seconds a
    row there on ONNX Runtime with every core (`row_s`, floor.row_seconds; the speed mixes' texts are shorter than
    the split's), at `threads` cores and `gain` times ONNX Runtime's speed; plus that FP32 run itself where the
    `reference` is still to compute. Cores are counted as if they scaled perfectly: it errs towards cutting."""
    cores = os.cpu_count() or 1
    return rows * row_s * (max(1.0, cores / threads) / max(gain, 1e-9) + (1.0 if reference else 0.0))


def accuracy(kind, path: Path, fp32: Path, variant: str, threads: int, batches=None) -> dict[str, float]:
    """The kind's gate metrics of `path` run as `variant` against `fp32` under ONNX Runtime, test split (FP32's
    outputs computed once per process: the replay and the packed proof before it use the same)."""
    from tritonkit.int8.evaluate import reference

    got = open_variant(variant, path, threads, kind.spec.serving.max_batch_size)
    batches = kind.eval_batches("test") if batches is None else batches
    ref = reference(kind, fp32, "test", batches)
    if path.name.endswith(".packed.onnx"):
        from tritonkit import data

        texts = data.eval_texts("test")
        return kind.gate_metrics(kind.arrival_order(ref, texts), kind.embed_packed(got, texts))
    return kind.gate_metrics(ref, np.concatenate([got.run([_output(kind)], b)[0] for b in batches]))


class ExactSession:
    """A file in exact int32 arithmetic (tritonkit.int8.evaluate.session(exact=True)) behind the runners' `run`."""

    def __init__(self, path: Path):
        from tritonkit.int8.evaluate import session

        self.session = session(path, exact=True)
        self.inputs = {i.name for i in self.session.get_inputs()}

    def run(self, names, feeds, *_):
        return self.session.run(list(names), {k: v for k, v in feeds.items() if k in self.inputs})


def worst_cosine(a, b, output: str, feeds: list[dict]) -> float:
    """The lowest cosine between the rows two sessions (`run(names, feeds)`) give for the same feeds."""
    return min(cosine_min(a.run([output], f)[0], b.run([output], f)[0]) for f in feeds)


def exact_agreement(kind, path: Path, variant: str, threads: int) -> float:
    """worst_cosine of `path` run as `variant` against its exact int32 arithmetic, on served-like batches."""
    got = open_variant(variant, path, threads, kind.spec.serving.max_batch_size)
    packed = path.name.endswith(".packed.onnx")
    feeds = served_feeds(kind, path, 8, variant)[:4] if packed else kind.eval_batches("test")[:2]
    return worst_cosine(got, ExactSession(path), _output(kind), feeds)


def source_digest(kind, gated: bool, cpu_class: str) -> str:
    """What a served file is built from, the same on every machine: the model's spec, the package versions and,
    for the INT8 file, `cpu_class`'s committed served recipe. Not the files' bytes: Lite0's calibration (histograms over
    multi-threaded runs) differs in the last bits between builds, and its FP32 export differs between CPUs (seen
    on an AMD EPYC and an Intel Xeon, same packages), so a fresh clone's files never hash like the measured ones
    although they serve the same."""
    from tritonkit.int8 import recipe

    entry = (recipe.read(kind) or recipe.RecipeFile()).served.get(cpu_class) if gated else None
    served = [entry.recipe, entry.status] if entry else [None, None]
    blob = json.dumps([kind.spec.file.read_text(), served, envinfo.versions()], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def served_threads(kind, model: str) -> int:
    s = kind.spec.serving
    return s.model_threads if model == kind.INT8_MODEL else s.fp32_threads


def variants_for(gated: bool) -> list[str]:
    """The variants a file is timed as: bf16 only for a gated (INT8-name) file on a CPU with native bf16."""
    return ["onnxruntime", "openvino"] + (["openvino-bf16"] if gated and envinfo.has_bf16() else [])


def shares(kind, pending: list[tuple[str, bool]], borrowed: frozenset[str] = frozenset()) -> list[float]:
    """The fraction of a build's budget left each (model, gated) file to measure may take, in turn, of what is left
    when its turn comes: by its work, the variants it is timed as over its served threads (MPNet's INT8 name times
    three variants at one thread, its FP32 file two at two; an even split cut the first's batch 32 and left the
    second ~165 s unused). A model in `borrowed` takes its timings from another file (twin_timings): no work."""
    work = [0.0 if model in borrowed else len(variants_for(gated)) / served_threads(kind, model)
            for model, gated in pending]
    return [w / sum(work[i:]) if sum(work[i:]) else 1.0 for i, w in enumerate(work)]


def same_graph(a: Path, b: Path) -> bool:
    """Whether two ONNX files hold the same graph, whatever their metadata: an FP32 fallback under the INT8 name is
    its FP32 twin's graph with the fallback's marks (recipe.write_fp32_fallback, build.build_packed)."""
    import onnx

    a, b = Path(a), Path(b)
    if not (a.exists() and b.exists()) or abs(a.stat().st_size - b.stat().st_size) > 1 << 20:
        return False

    def graph(path: Path) -> bytes:
        return onnx.load(str(path), load_external_data=False).graph.SerializeToString()

    return graph(a) == graph(b)


def twin_timings(record: dict | None) -> dict | None:
    """The FP32 file's timings from the INT8 name's `record`, where that file is an FP32 fallback of the same graph
    at the same threads (choose decides): the variants the FP32 file is timed as, if the record timed them all."""
    speed = (record or {}).get("items_per_s") or {}
    wanted = variants_for(False)
    return {v: speed[v] for v in wanted} if all(v in speed for v in wanted) else None


def reusable(old: dict | None, digest: str, source: str, served: str, threads: int) -> bool:
    """Whether a committed record still speaks for the file: the same file (or the same INT8 sources), timed at the
    threads per instance it is served with now (a spec that changes them changes which runtime wins)."""
    if not old or old.get("budget_cut"):  # cut short by a build's budget: the next build measures it whole
        return False
    same = digest == old.get("sha256") or source == old.get("source")
    return same and old.get("file") == served and old.get("threads") == threads


def choose_model(kind, model: str, path: Path, fp32: Path, gated: bool, digest: str,
                 budget: Budget | None = None, timed: dict | None = None, gates=None, least: bool = False,
                 facts=None) -> dict:
    """Measure one served model's file as every variant; the record that goes in the choice file. The fastest
    variant that beats ONNX Runtime by MIN_GAIN and keeps the gates (gated files) or the export tolerance (FP32)
    serves; otherwise ONNX Runtime. `budget` (this file's share of a build's): the timing takes TIMING_SHARE of what
    is left (fewer rounds; where even MIN_ROUNDS of every batch size do not fit, as `least`), and an accuracy check
    that would not finish by then is not started: ONNX Runtime serves, and the record's `budget_cut` says so (a later
    build measures again, not reusable). `timed`: its timings, measured on
    the same graph at the same threads (twin_timings); its accuracy checks are its own. `gates`: the served form's
    (tritonkit.int8.gates), where the build judged the INT8 file by them: not measured again. `least`: the build's
    budget was spent before its turn: timed in MIN_ROUNDS, the fewest that give a median, with no deadline, so the
    file still serves on the runtime its gates hold on; the record's `budget_cut` says so (measured whole later).
    `facts`: the build's measured facts of the FP32 file (tritonkit.int8.facts), its seconds a row not measured
    again."""
    from tritonkit.int8 import floor
    from tritonkit.int8 import gates as int8_gates
    from tritonkit.kinds.gates import missed

    threads = served_threads(kind, model)
    file = served_file(path)
    variants = variants_for(gated)
    timing_s = None if budget is None else budget.share(TIMING_SHARE).seconds
    rounds: dict[str, int] = {}
    try:
        speed = timed or time_variants(kind, file, variants, kind.SPEED_BATCHES, threads,
                                       MIN_ROUNDS if least else ROUNDS, budget_s=timing_s, rounds_used=rounds)
    except BudgetSpent:  # never starved: a share too short for every batch size is timed at the least instead
        speed = time_variants(kind, file, variants, kind.SPEED_BATCHES, threads, MIN_ROUNDS)
        rounds, least, budget = dict.fromkeys(speed[DEFAULT], MIN_ROUNDS), True, None
    # The geometric mean over the served batch sizes: no single batch size decides.
    gains = {v: float(np.exp(np.mean([np.log(speed[v][b] / speed[DEFAULT][b]) for b in speed[DEFAULT]])))
             for v in variants}
    record = {"file": paths.rel(file), "sha256": digest, "threads": threads, "items_per_s": speed,
              "vs_onnxruntime": {v: round(g, 3) for v, g in gains.items()}, "accuracy": {},
              **({"timed_as": kind.INT8_MODEL} if timed else {})}
    if any(r < ROUNDS for r in rounds.values()):
        record["rounds"] = rounds
    if least:
        record["budget_cut"] = (f"timed in {MIN_ROUNDS} rounds, the fewest, and checked without a deadline: the "
                                "build's budget left too little for more")
    # FP32 on another runtime must match FP32 as the export does; INT8 keeps its gates, judged against the FP32
    # graph's bf16 floor as the INT8 build judged it (tritonkit.int8.gates). A floor only loosens the absolute
    # gates, so it is measured only for a variant that misses them (MPNet's: ~9 min on 2 cores, where the search
    # ended before its floor).
    if gated:
        gates = gates or int8_gates.for_form(kind, fp32, "served", defer=True)
    else:
        targets = [kind.FP32_RUNTIME_CHECK]
    from tritonkit.int8.facts import FP32Facts

    runtime, reasons, batches = DEFAULT, [], kind.eval_batches("test")
    facts = facts or FP32Facts(kind, fp32)
    for variant in sorted((v for v in variants if v != DEFAULT), key=lambda v: -gains[v]):
        if gains[variant] < MIN_GAIN:
            reasons.append(f"{variant} {gains[variant]:.2f}x, under the {MIN_GAIN}x needed to switch")
            break
        if budget is not None:
            need = check_seconds(row_count(batches), facts.row_s(), _rate(speed[variant]) / _rate(speed[DEFAULT]),
                                 threads, not reference_ready(kind, fp32, "test", batches))
            left = budget.left()
            if need > left:
                record["budget_cut"] = (f"{variant} {gains[variant]:.2f}x, its accuracy check (about {need:.0f} s) "
                                        f"not started: {max(left, 0.0):.0f} s of the build's budget left")
                reasons.append(record["budget_cut"])
                break
        metrics = accuracy(kind, file, fp32, variant, threads, batches)
        record["accuracy"][variant] = {k: round(v, 6) for k, v in metrics.items()}
        if gated and budget is not None and gates.decided("test", metrics) is None:  # only the floor can tell
            need = floor.estimate_s(kind, fp32, floor.PRECISION["served"], facts.row_s())
            left = budget.left()
            if need > left:
                record["budget_cut"] = (f"{variant} {gains[variant]:.2f}x misses the absolute gates; its bf16 "
                                        f"floor (about {need:.0f} s) not measured: {max(left, 0.0):.0f} s of "
                                        "the build's budget left")
                reasons.append(record["budget_cut"])
                break
        problems = gates.missed("test", metrics) if gated else missed(targets, metrics)
        if gated and not envinfo.int8_sums_exact() and VARIANTS[variant][0] != DEFAULT:
            # ONNX Runtime takes the exact path on this class (backend_utils.EXACT_INT8_ENTRY); another runtime
            # must show it computes the same, since the recipe was proven in exact arithmetic.
            exact = exact_agreement(kind, file, variant, threads)
            record["accuracy"][variant]["exact_cosine_min"] = round(exact, 6)
            if exact < EXACT_COSINE:
                problems.append(f"INT8 arithmetic not exact on this CPU class: cosine min {exact:.6f} to exact "
                                f"int32 (< {EXACT_COSINE})")
        if not problems:
            runtime = variant
            reasons.append(f"{variant} {gains[variant]:.2f}x; {'gates' if gated else 'FP32'} hold on it")
            break
        reasons.append(f"{variant} {gains[variant]:.2f}x but misses: {'; '.join(problems)}")
    reason = "; ".join(reasons) or "no other variant is faster by the needed margin"
    record.update(runtime=runtime, reason=reason)
    return record


def choose(kind, fp32: Path, int8: Path | None, force: bool = False, log=print, budget=None, gates=None,
           facts=None) -> dict:
    """Measure (or reuse this class's committed measurement of unchanged files) and write models/<name>.runtime.json;
    returns this class's entry (empty for a spec that lives in no file: it keeps ONNX Runtime). `budget`
    (tritonkit.int8.budget.Budget), a build's: the files to measure share what is left by their work (`shares`),
    the INT8 name (what a client calls by default) first; a file whose share is spent is still timed, in the fewest
    rounds (choose_model's `least`), so no name serves a runtime the build did not measure. `gates`: the served
    form's, as the build judged the INT8 file; `facts`: the build's measured facts of the FP32 file."""
    if kind.spec.file is None:
        return {}
    data = load(kind)
    cpu_class = envinfo.int8_class()
    if cpu_class not in data["classes"] and data["classes"] and not force:
        # Another class committed this file; a build here leaves it be and its replicas serve FP32 on ONNX Runtime.
        log(f"{kind.NAME}: no runtime measured on this {cpu_class} CPU (recorded: {', '.join(sorted(data['classes']))}"
            f"); a replica here serves FP32 on ONNX Runtime, or what this machine's proof proved "
            f"(tritonkit.int8.proof). Measure with `python -m tritonkit.build {kind.NAME} --choose-runtime` and "
            "commit it")
        return {}
    current = data["classes"].get(cpu_class, {})
    files = {kind.INT8_MODEL: (int8, True)} if int8 is not None and int8.exists() else {}
    files[kind.FP32_MODEL] = (fp32, False)
    records = dict(current.get("models", {}))
    measured = {}
    for model, (path, gated) in files.items():
        old, served = records.get(model), paths.rel(served_file(path))
        digest, source = file_digest(path)[:16], source_digest(kind, gated, cpu_class)
        if not force and reusable(old, digest, source, served, served_threads(kind, model)):
            records[model] = old
            here = usable_here(old["runtime"])
            log(f"{kind.NAME}: {model} runs on {old['runtime']} (committed for {cpu_class}: {old['reason']})"
                + (f"; on {here} here, a CPU without native bf16" if here != old["runtime"] else ""))
            continue
        measured[model] = (path, gated, digest, source)
    # An FP32 fallback under the INT8 name at the FP32 file's threads runs the same graph: timed once, as the INT8
    # name (Lite1's files; an added image model's, at the default threads), which then has the FP32 file's share too.
    twin = (kind.FP32_MODEL in measured and kind.INT8_MODEL in files
            and served_threads(kind, kind.INT8_MODEL) == served_threads(kind, kind.FP32_MODEL)
            and same_graph(served_file(files[kind.INT8_MODEL][0]), served_file(fp32)))
    borrowed = frozenset({kind.FP32_MODEL} if twin else ())
    fractions = shares(kind, [(model, gated) for model, (_, gated, *_) in measured.items()], borrowed)
    for (model, (path, gated, digest, source)), fraction in zip(measured.items(), fractions, strict=True):
        served = paths.rel(served_file(path))
        timed = twin_timings(records.get(kind.INT8_MODEL)) if model in borrowed else None
        mine = budget.share(fraction) if budget is not None and budget.bounded else None
        least = mine is not None and mine.spent() and timed is None
        if least:  # never starved: a file the build's budget left no time for is still timed, at the least
            mine = None
            log(f"{kind.NAME}: budget: spent before {served}'s turn; timed in {MIN_ROUNDS} rounds, the fewest (measure "
                f"it whole with `python -m tritonkit.build {kind.NAME} --choose-runtime`)")
        if timed is not None:
            log(f"{kind.NAME}: {served} is {kind.INT8_MODEL}'s graph at its threads: its timings are that file's")
        else:
            log(f"{kind.NAME}: timing {served} on {', '.join(runtimes.RUNTIMES)}"
                + ("" if mine is None else f" (within {mine.left():.0f} s of the build's budget)"))
        records[model] = {**choose_model(kind, model, path, fp32, gated, digest, mine, timed,
                                         gates if gated else None, least, facts), "source": source}
        log(f"{kind.NAME}: {model} → {records[model]['runtime']} ({records[model]['reason']})")
    if records != current.get("models"):
        write_class(kind, data, cpu_class, records, envinfo.cpu_model(), "--choose-runtime")
        log(f"{kind.NAME}: wrote {paths.rel(choice_path(kind))} ({cpu_class})")
    return data["classes"][cpu_class]


def write_class(kind, data: dict, cpu_class: str, models: dict, cpu: str, flag: str) -> Path:
    """The choice file (`data`, as load read it) with `cpu_class`'s record set to `models`, timed on `cpu` and made
    by `python -m tritonkit.build <name> <flag>`: the file's one writer."""
    data["classes"][cpu_class] = {"models": models, "versions": runtimes.versions(), "cpu": cpu,
                                  "date": datetime.date.today().isoformat(),
                                  "command": f"python -m tritonkit.build {kind.NAME} {flag}"}
    choice_path(kind).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return choice_path(kind)
