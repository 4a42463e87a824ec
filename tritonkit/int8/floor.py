"""The half-precision floor of a model's INT8 gates, and the gates judged against it.

A gate that the FP32 graph run at half precision already fails measures the data (near-ties, narrow embedding cones),
not quantization. So every INT8 form is judged beside its floor: the FP32 graph at the reduced precision that form
competes with, on the same split, scored by the same metrics against FP32.
- served (CPU) form: bf16, the precision CPU runtimes offer, on every CPU as onnxruntime's CPU provider running the
  FP32 graph with bf16 rounding emulated where a bf16 runtime rounds (`emulate_bf16`: the inputs and weights of
  MatMul / Gemm / Conv, as AVX512_BF16 and AMX compute them, products summed in fp32). One floor for every CPU class,
  so a recipe's judgement does not depend on the CPU it was searched on; validated against OpenVINO's native bf16
  (INFERENCE_PRECISION_HINT, `measure(..., native=True)`) on a CPU that has it (`python -m tritonkit.int8.floor
  --compare-emulated`);
- tensorrt form: fp16, the plan INT8 competes with on a GPU. Without a GPU here it is the graph converted to float16
  (weights and every activation between ops rounded to fp16, keep_io_types) run by onnxruntime's CPU provider, which
  computes ops it has no fp16 kernel for in fp32 between casts, as TensorRT's fp16 tactics accumulate in fp32.

The rule (`targets`): a gate passes when INT8 is within the kind's FLOOR_SLACK of the floor or meets the absolute
bound, whichever is looser; never below the kind's CATASTROPHE bounds, which no floor loosens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tritonkit import envinfo, paths
from tritonkit.int8.evaluate import reference

PRECISION = {"served": "bf16", "tensorrt": "fp16"}


class Unavailable(Exception):
    """This machine cannot compute the precision (the reason names what is missing)."""


# The ops a bf16 CPU runtime computes in bf16 (AVX512_BF16 dot products, AMX tiles; oneDNN under OpenVINO) and the
# inputs it rounds: data and weights; a bias is added to the fp32 accumulator.
BF16_OPS: Mapping[str, tuple[int, ...]] = {"MatMul": (0, 1), "Gemm": (0, 1), "Conv": (0, 1), "ConvTranspose": (0, 1)}


def emulate_bf16(model, ops: Mapping[str, tuple[int, ...]] = BF16_OPS, activations: bool = False):
    """A copy of an FP32 onnx ModelProto computing what a bf16 CPU runtime computes, on any CPU: each float input of
    `ops` at the listed positions goes through Cast to BFLOAT16 and back (round to nearest even, as VCVTNEPS2BF16
    and oneDNN's conversions do) and the op runs in fp32, where a product of two bf16 numbers is exact, so only the
    order of the fp32 sums differs from the hardware's. `activations`: also round every float tensor passed between
    ops, except on the graph's tail after the last of `ops` (OpenVINO stores activations in bf16 and keeps that tail
    in fp32). Subgraphs (If, Loop) are left as they are."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    types.update({t.name: t.data_type for t in graph.initializer})

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name) == TensorProto.FLOAT

    rounded: set[tuple[int, int]] = set()  # (node index, input position) that reads the rounded copy
    for i, node in enumerate(graph.node):
        rounded |= {(i, k) for k in ops.get(node.op_type, ()) if k < len(node.input) and is_float(node.input[k])}
    if activations:
        tail = _tail(graph, ops)
        produced = {out for i, node in enumerate(graph.node) if i not in tail for out in node.output if is_float(out)}
        rounded |= {(i, k) for i, node in enumerate(graph.node) for k, name in enumerate(node.input)
                    if name in produced}
    nodes, done = [], set()
    for i, node in enumerate(graph.node):
        for k in sorted(k for j, k in rounded if j == i):
            name = node.input[k]
            if name not in done:  # one rounded copy per tensor, made before its first reader
                nodes += [helper.make_node("Cast", [name], [f"{name}__bf16"], name=f"{name}__to_bf16",
                                           to=TensorProto.BFLOAT16),
                          helper.make_node("Cast", [f"{name}__bf16"], [f"{name}__bf16r"], name=f"{name}__from_bf16",
                                           to=TensorProto.FLOAT)]
                done.add(name)
            node.input[k] = f"{name}__bf16r"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _tail(graph, ops: Mapping[str, tuple[int, ...]]) -> set[int]:
    """Indices of the nodes reached backwards from the graph's outputs without passing one of `ops`: the part
    OpenVINO keeps in fp32 at bf16 precision, for accuracy."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    stack = [producer[o.name] for o in graph.output if o.name in producer]
    tail: set[int] = set()
    while stack:
        i = stack.pop()
        if i in tail or graph.node[i].op_type in ops:
            continue
        tail.add(i)
        stack += [producer[name] for name in graph.node[i].input if name in producer]
    return tail


def _bf16_emulated_run(fp32: Path):
    import onnx

    from tritonkit.int8.evaluate import run_batches, session

    sess = session(emulate_bf16(onnx.load(str(fp32))))

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return run_batches(sess, [batch])
    return run


def _bf16_native_run(fp32: Path):
    import openvino as ov

    if not envinfo.has_bf16():
        raise Unavailable("no native bf16 on this CPU (avx512_bf16 / amx_bf16): no runtime computes bf16 here")
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(fp32)), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"})
    if str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower() not in ("bf16", "<type: 'bfloat16'>"):
        raise Unavailable(f"OpenVINO {ov.__version__} would not compute bf16 here")
    names = {p.get_any_name() for p in compiled.inputs}
    output = compiled.outputs[0]

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return compiled({k: v for k, v in batch.items() if k in names})[output]
    return run


def _fp16_run(fp32: Path):
    import onnx
    import onnxruntime as ort

    from tritonkit.export import float16

    model = float16(onnx.load(str(fp32)))
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # the converter's graph is not always loadable (e.g. a Cast it retyped); say so
        raise Unavailable(f"the float16 conversion of this graph does not load: {str(err)[:200]}") from None
    names, output = {i.name for i in sess.get_inputs()}, sess.get_outputs()[0].name

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return sess.run([output], {k: v for k, v in batch.items() if k in names})[0]
    return run


RUNNERS = {"bf16": _bf16_emulated_run, "fp16": _fp16_run}
NATIVE = {"bf16": _bf16_native_run}  # the precision computed by a runtime on this CPU, where it can be


def how(precision: str, native: bool = False) -> str:
    import onnxruntime

    if native:
        import openvino

        return (f"FP32 graph on OpenVINO {openvino.__version__}, INFERENCE_PRECISION_HINT=bf16, native bf16 "
                f"({', '.join(envinfo.cpu_flags(wanted=envinfo.BF16_FLAGS))})")
    return {"bf16": f"FP32 graph on onnxruntime {onnxruntime.__version__} CPU with bf16 rounding emulated at the "
                    f"inputs and weights of {', '.join(BF16_OPS)} (Cast to bfloat16 and back), sums in fp32",
            "fp16": f"FP32 graph as TensorRT's FP16 build gets it (export.float16), "
                    f"onnxruntime {onnxruntime.__version__} CPU"
            }[precision]


def key(kind, fp32: Path, precision: str, splits: Sequence[str], native: bool = False) -> str:
    """A floor's key in the floors file: what its numbers depend on. The emulated bf16 floor is onnxruntime's CPU
    provider on the graph, the same on every x86 class, so no CPU flags; a native one is this CPU's bf16 on
    OpenVINO's version."""
    name, env = getattr(kind, "NAME", ""), envinfo.fingerprint()
    if precision == "fp16":  # onnxruntime's CPU provider on the converted graph: the same on every x86 class
        parts: list = [precision, list(splits), {"packages": env["packages"], "machine": env["machine"]}, name]
    elif native:
        import openvino

        bf16 = envinfo.cpu_flags(wanted=envinfo.BF16_FLAGS)
        env = {**env, "openvino": openvino.__version__, "cpu_bf16_features": bf16}
        parts = [precision, "native", list(splits), env, name]
    else:
        parts = [precision, "emulated", sorted(BF16_OPS.items()), list(splits),
                 {"packages": env["packages"], "machine": env["machine"]}, name]
    stat = Path(fp32).stat()
    memo = (str(Path(fp32).resolve()), stat.st_mtime_ns, stat.st_size, json.dumps(parts))
    if memo not in _KEYS:  # the whole graph is hashed: once per process while it is unchanged
        _KEYS[memo] = hashlib.sha256(Path(fp32).read_bytes() + json.dumps(parts).encode()).hexdigest()[:20]
    return _KEYS[memo]


_KEYS: dict[tuple, str] = {}


def source(kind, precision: str, splits: Sequence[str], native: bool = False) -> str | None:
    """What a CPU-independent floor is measured from, the same on every machine: the model's spec, the packages,
    precision and splits (None for a native floor, or a spec made in memory). A record found by it stands for a
    fresh clone whose FP32 export differs in the last bits (Lite0's does between an AMD EPYC and an Intel Xeon)."""
    file = getattr(getattr(kind, "spec", None), "file", None)
    if native or file is None:
        return None
    env = envinfo.fingerprint()
    parts = [precision, list(splits), file.read_text(), env["packages"], env["machine"], getattr(kind, "NAME", "")]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def record_path(kind) -> Path | None:
    """models/<name>.floors.json beside the spec: floors measured by builds, committed so that a fresh clone on the
    same packages (and, for a floor a runtime computes natively, CPU flags) reuses them (None for a spec made in
    memory, e.g. by tests)."""
    file = getattr(getattr(kind, "spec", None), "file", None)
    return file.with_name(f"{kind.NAME}.floors.json") if file is not None else None


def score(kind, fp32: Path, run, splits: Sequence[str]) -> dict:
    """{split: gate metrics} of `run` (a batch -> first output function) against the FP32 graph on onnxruntime."""
    out = {}
    for split in splits:
        batches = kind.eval_batches(split)
        got = np.concatenate([run(b) for b in batches]).astype(np.float32)
        ref = reference(kind, fp32, split, batches)  # shared with the search's and the replay's gate checks
        out[split] = {k: round(float(v), 6) for k, v in kind.gate_metrics(ref, got).items()}
    return out


def _recorded(recorded: Mapping, digest: str, origin: str | None) -> dict | None:
    """The floor a floors file holds for the graph's `key`, else for its `source`, else None."""
    if digest in recorded:
        return recorded[digest]["floor"]
    found = next((r for r in recorded.values() if r.get("source") == origin), None) if origin is not None else None
    return found["floor"] if found is not None else None


# A floor's run at its precision against the FP32 run over the same batches (MPNet, 12 validation batches, 2-core
# Xeon, 2026-11-28: bf16 emulated 1.12x; its fp16 floor took 287 s for two splits FP32 runs in ~300 s).
PRECISION_COST = 1.15
# Batches of a split timed in FP32 to estimate a pass over it (evenly spread: the batches are length-sorted).
PROBE_BATCHES = 3


def row_seconds(kind, fp32: Path, split: str = "validation") -> float:
    """Seconds per row of the FP32 graph on onnxruntime here (as the references run), from PROBE_BATCHES evenly
    spread batches of `split`, after one untimed run."""
    import time

    from tritonkit.int8.evaluate import run_batches, session

    batches = kind.eval_batches(split)
    picked = [batches[int(i)] for i in np.linspace(0, len(batches) - 1, min(PROBE_BATCHES, len(batches)))]
    sess = session(fp32)
    run_batches(sess, picked[:1])
    t0 = time.perf_counter()
    rows = len(run_batches(sess, picked))
    return (time.perf_counter() - t0) / max(rows, 1)


def recorded(kind, fp32: Path, precision: str, splits: Sequence[str] = ("validation", "test")) -> dict | None:
    """The floor the spec's floors file already holds for this graph (by `key`, else `source`), else None."""
    file = record_path(kind)
    held = json.loads(file.read_text()) if file is not None and file.exists() else {}
    return _recorded(held, key(kind, fp32, precision, splits), source(kind, precision, splits))


def estimate_s(kind, fp32: Path, precision: str, row_s: float, splits: Sequence[str] = ("validation", "test")
               ) -> float:
    """About how long measure() takes here: 0 where a recorded floor stands, else per split its FP32 reference
    (unless computed already) and one run at `precision` (PRECISION_COST), at `row_s` seconds a row (row_seconds)."""
    from tritonkit.int8.evaluate import reference_ready, row_count

    if recorded(kind, fp32, precision, splits) is not None:
        return 0.0
    total = 0.0
    for split in splits:
        batches = kind.eval_batches(split)
        rows = row_count(batches)
        total += rows * row_s * (PRECISION_COST + (0.0 if reference_ready(kind, fp32, split, batches) else 1.0))
    return total


def measure(kind, fp32: Path, precision: str, splits: Sequence[str] = ("validation", "test"), native: bool = False,
            reuse: bool = True, record: bool = True) -> dict:
    """{"precision", "how", split: metrics...} of the FP32 graph at `precision` against FP32 (onnxruntime), or
    {"precision", "unavailable": why}. bf16 is emulated on onnxruntime unless `native` (OpenVINO, on a CPU with bf16).
    Found in the spec's committed floors file under `key` (`reuse`), else measured and recorded there (`record`)."""
    digest = key(kind, fp32, precision, splits, native)
    file = record_path(kind)
    recorded = json.loads(file.read_text()) if file is not None and file.exists() else {}
    origin = source(kind, precision, splits, native)
    found = _recorded(recorded, digest, origin) if reuse else None
    if found is not None:
        return found
    out: dict = {"precision": precision}
    runner = (NATIVE if native else RUNNERS).get(precision)
    try:
        if runner is None:
            raise Unavailable(f"no runtime computes {precision} natively here")
        run = runner(Path(fp32))
    except Unavailable as err:
        out["unavailable"] = str(err)
        return out
    out["how"] = how(precision, native)
    out.update(score(kind, fp32, run, splits))
    if file is not None and record:
        import datetime

        # Where it was measured is provenance; whether the CPU matters is in the key.
        recorded[digest] = {"floor": out, "graph": paths.rel(Path(fp32)), "cpu": envinfo.cpu_model(),
                            "cpu_int8_class": envinfo.int8_class(), "date": datetime.date.today().isoformat(),
                            **({"source": origin} if origin else {})}
        file.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return out


def split_floor(floor: Mapping | None, split: str) -> Mapping[str, float] | None:
    """One split's metrics of a `measure` result (None where the floor is unavailable)."""
    return None if not floor or "unavailable" in floor else floor.get(split)


def compare_emulated(names: Sequence[str], activations: bool = False) -> int:
    """Print, per model and split, the native bf16 floor (OpenVINO) beside the emulated one on every metric the
    kind's floor slack covers (markdown); 1 when one differs by more than its slack, 2 without native bf16 here.
    Both are measured afresh; the emulated floor is recorded, as a build would. `activations`: also the emulation
    that rounds every activation between ops (not recorded), to show whether ops beyond BF16_OPS matter."""
    import time

    from tritonkit import kinds

    if not envinfo.has_bf16():
        print(f"no native bf16 on this CPU ({envinfo.cpu_model()}): nothing to validate the emulation against")
        return 2
    columns = ["native", "emulated"] + (["emulated, all activations"] if activations else [])
    emulated = columns[1:]
    print(f"| model | split | metric | {' | '.join(columns)} | {' | '.join(f'{c} − native' for c in emulated)} "
          "| slack | emulated within |")
    print("|---|---|---|" + "---:|" * (len(columns) + len(emulated) + 1) + "---|")
    worst = 0.0
    for name in names:
        kind = kinds.get(name)
        fp32 = paths.model_file(kind.FP32_MODEL)
        floors, seconds = {}, {}
        for column in columns:
            start = time.perf_counter()
            if column == "emulated, all activations":
                import onnx

                from tritonkit.int8.evaluate import run_batches, session

                sess = session(emulate_bf16(onnx.load(str(fp32)), activations=True))
                floors[column] = score(kind, fp32, lambda b, s=sess: run_batches(s, [b]), ("validation", "test"))
            else:
                floors[column] = measure(kind, fp32, "bf16", native=column == "native", reuse=False,
                                         record=column != "native")
                if "unavailable" in floors[column]:
                    print(f"| {name} | {column}: {floors[column]['unavailable']} |")
                    return 2
            seconds[column] = time.perf_counter() - start
        slack: Mapping[str, float] = getattr(kind, "FLOOR_SLACK", {})
        for split in ("validation", "test"):
            for metric in slack:
                values = [floors[c][split][metric] for c in columns]
                diffs = [v - values[0] for v in values[1:]]
                worst = max(worst, abs(diffs[0]) / slack[metric])
                print(f"| {name} | {split} | {metric} | " + " | ".join(f"{v:.4f}" for v in values + diffs)
                      + f" | {slack[metric]} | {'yes' if abs(diffs[0]) <= slack[metric] else '**no**'} |")
        print(f"| {name} | | seconds (both splits; the first includes the FP32 reference) | "
              + " | ".join(f"{seconds[c]:.0f}" for c in columns) + " |" * (len(emulated) + 2) + " |")
    print(f"\nlargest |emulated − native| as a share of its slack: {worst:.2f}")
    return 0 if worst <= 1.0 else 1
