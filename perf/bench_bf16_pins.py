"""Whether keeping chosen nodes of a served INT8 graph in f32 lets it run in OpenVINO bf16 within its gates: the
committed served candidate (as bench_trim.py builds it) compiled as openvino-bf16 serves it, with OpenVINO's
per-node precision pin (the `DisablePrecisionConversion` runtime attribute, value `dynamic:dynamic`, read from IR;
the CPU plugin keeps such a node's precision) on: nothing, the float glue (every node but weighted ones and
FakeQuantize), the recipe's float weighted nodes, every node; then the graph in f32, the graph in f32 with only its
float weighted nodes in bf16 (Casts around them), and the FP32 file in bf16.

    python perf/bench_bf16_pins.py efficientnet_lite1 [--float-nodes trimmed.json] [--batch 8]

Per row: top-1 agreement (images; texts: cosine min) on all validation against FP32 and whether every gate holds
there (no margin), ms per call at
`--batch` (median of 30 after 5 warm-up calls, the served threads), and how many layers ran in each precision
(OpenVINO's kernel names). Last, the layers still in bf16 with every node pinned. `--float-nodes`: a JSON file
{"float_nodes": [...]} (bench_trim.py prints one) to use instead of the committed candidate's. Writes nothing into
the repository.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit import envinfo, kinds, paths
from tritonkit.int8 import gates, judge
from tritonkit.int8.context import SearchContext
from tritonkit.int8.params import file_digest
from tritonkit.int8.recipe import committed_candidate, load_recipes
from tritonkit.serving.runtimes import openvino_core, openvino_properties, variant_config

WEIGHTED = {"Convolution", "GroupConvolution", "MatMul"}
NOT_PINNED = {"Parameter", "Result", "Constant"}
PIN = {"name": "DisablePrecisionConversion", "version": "0", "value": "dynamic:dynamic"}


def pinned(xml: Path, rule, out: Path) -> tuple[Path, int]:
    """A copy of the IR at `xml` (weights beside it) with every layer `rule` picks pinned to its precision."""
    tree, count = ET.parse(xml), 0
    for layer in tree.getroot().iter("layer"):
        if layer.get("type") in NOT_PINNED or not rule(layer):
            continue
        rt = layer.find("rt_info")
        ET.SubElement(rt if rt is not None else ET.SubElement(layer, "rt_info"), "attribute", PIN)
        count += 1
    tree.write(out)
    out.with_suffix(".bin").symlink_to(xml.with_suffix(".bin"))
    return out, count


def bf16_nodes(graph: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of `graph` whose weighted nodes in `names` take and give bf16 (Casts on their inputs and output): the
    rest keeps the compile's f32 precision, these run OpenVINO's bf16 kernels."""
    out = onnx.ModelProto()
    out.CopyFrom(graph)
    nodes = []
    for node in out.graph.node:
        if node.op_type not in ("Conv", "MatMul", "Gemm") or node.name not in names:
            nodes.append(node)
            continue
        for i, name in enumerate(node.input):
            nodes.append(helper.make_node("Cast", [name], [f"{name}:bf16:{node.name}"], to=TensorProto.BFLOAT16))
            node.input[i] = f"{name}:bf16:{node.name}"
        result = node.output[0]
        node.output[0] = f"{result}:bf16"
        nodes += [node, helper.make_node("Cast", [node.output[0]], [result], to=TensorProto.FLOAT)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--float-nodes", type=Path, help="JSON {\"float_nodes\": [...]} instead of the committed ones")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    if not envinfo.has_bf16():
        raise SystemExit("this CPU has no native bf16: nothing to pin against")
    import openvino as ov

    kind = kinds.get(args.model)
    fp32 = paths.model_file(kind.FP32_MODEL)
    entry = (load_recipes(kind, None) or {}).get("served")
    candidate = committed_candidate(kind, "served", entry, fp32, file_digest(fp32))
    if candidate is None:
        raise SystemExit(f"{kind.NAME}: no committed served candidate with parameters for this FP32 file")
    recipe, params = candidate
    if args.float_nodes:
        recipe = replace(recipe, float_nodes=json.loads(args.float_nodes.read_text())["float_nodes"])
    search = SearchContext(kind, fp32, [recipe.form], check_speed=False, progress=False, log=lambda _m: None,
                           margin=0.0, exact=judge.exact_judgement(),
                           gates=gates.for_entry(kind, fp32, "served", entry), committed=(recipe, params),
                           min_int8_share=0.0)
    val, floats = search.val, set(recipe.float_nodes)
    core = openvino_core()

    def is_float_weighted(layer) -> bool:
        return layer.get("type") in WEIGHTED and any(layer.get("name", "").startswith(f) for f in floats)

    rules = {"nothing": None, "float glue": lambda lay: lay.get("type") not in WEIGHTED | {"FakeQuantize"},
             "float weighted nodes": is_float_weighted, "every node": lambda lay: True}
    print(f"{kind.NAME}: {recipe.describe()}, {envinfo.cpu_model()} ({envinfo.int8_class()}); scored on all "
          f"validation, ms per call at batch {args.batch}, {kind.SERVE_THREADS} threads")
    with tempfile.TemporaryDirectory(prefix="bench-pins-") as tmp:
        xml = Path(tmp) / "int8.xml"
        graph = search.build(recipe)  # its MatMulNBits blocks set OpenVINO's run-time groups, as served
        onnx.save(graph, str(Path(tmp) / "int8.onnx"))
        ov.save_model(core.read_model(str(Path(tmp) / "int8.onnx")), str(xml), compress_to_fp16=False)
        runs = [(f"bf16, {name}", *(pinned(xml, rule, Path(tmp) / f"pinned{i}.xml") if rule else (xml, 0)),
                 "openvino-bf16") for i, (name, rule) in enumerate(rules.items())]
        onnx.save(bf16_nodes(graph, floats), str(Path(tmp) / "bf16-nodes.onnx"))
        runs += [("f32 (no bf16)", xml, 0, "openvino"),
                 ("f32, float weighted nodes in bf16", Path(tmp) / "bf16-nodes.onnx", 0, "openvino"),
                 ("FP32 file in bf16", fp32, 0, "openvino-bf16")]
        for name, model, count, variant in runs:
            props = {**openvino_properties(variant_config(kind.SERVE_THREADS, variant), None if model == fp32 else
                                           graph), "PERF_COUNT": True}
            compiled = core.compile_model(core.read_model(str(model)), "CPU", props)
            request = compiled.create_infer_request()
            got = np.concatenate([request.infer(b)[compiled.outputs[0]].copy() for b in val.batches])
            metrics = kind.gate_metrics(val.ref, got)
            if name == runs[0][0]:
                metric = "top1_agreement" if "top1_agreement" in metrics else "cosine_min"
                print(f"\n| INT8 graph, pinned to f32 | layers pinned | {metric} | gates | ms | layers by precision |"
                      "\n|---|---:|---:|---|---:|---|")
            held = "held" if not search.gates.missed("validation", metrics) else "missed"
            kernels = collections.Counter(layer.exec_type.rsplit("_", 1)[-1] for layer in request.profiling_info
                                          if layer.exec_type.rsplit("_", 1)[-1] in ("bf16", "f32", "I8"))
            feed = {k: v[: args.batch] for k, v in val.batches[0].items()}
            for _ in range(5):
                request.infer(feed)
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                request.infer(feed)
                times.append(time.perf_counter() - t0)
            print(f"| {name} | {count} | {metrics[metric]:.4f} | {held} | {1e3 * statistics.median(times):.1f} | "
                  + ", ".join(f"{k} {n}" for k, n in sorted(kernels.items())) + " |")
            if name == "bf16, every node":
                left = [f"{layer.node_type} {layer.node_name}" for layer in request.profiling_info
                        if layer.exec_type.endswith("bf16")]
        print(f"\nStill bf16 with every node pinned ({len(left)}): " + "; ".join(left))


if __name__ == "__main__":
    main()
