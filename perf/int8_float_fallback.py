"""Does a conv the search keeps in float stay float once onnxruntime loads the graph? Every depthwise conv of a
model is kept float in the served form's all-ops uint8 placement; the validation gates are measured with the guard
(`tritonkit.int8.quantize.keep_float`) and with its Shape nodes stripped, next to nothing in float.

    python perf/int8_float_fallback.py image_classification
"""

from __future__ import annotations

import argparse
import platform

import onnx

from tritonkit import kinds
from tritonkit.int8.search import Recipe, Search
from tritonkit.paths import model_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="image_classification")
    args = parser.parse_args()
    spec = kinds.get(args.model)
    fp32 = model_file(spec.FP32_MODEL)
    graph = onnx.load(str(fp32), load_external_data=False).graph
    depthwise = [n.name for n in graph.node
                 if n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute)]
    search = Search(spec, fp32, ["uint8"], check_speed=False, progress=False, log=lambda *a: None)
    guarded = search.build(Recipe(form="uint8", placement="all", float_nodes=depthwise))
    stripped = onnx.ModelProto.FromString(guarded.SerializeToString())
    keep = [n for n in stripped.graph.node if n.name.endswith("_keep_float")]
    for node in keep:
        stripped.graph.node.remove(node)
    rows = [("nothing in float", search.build(Recipe(form="uint8", placement="all"))),
            (f"{len(depthwise)} depthwise convs in float, guarded ({len(keep)} Shape nodes)", guarded),
            (f"{len(depthwise)} depthwise convs in float, guard stripped", stripped)]
    print(f"{spec.NAME}, uint8/all, minmax, validation split; {platform.machine()}, onnxruntime "
          f"{__import__('onnxruntime').__version__}\n")
    metrics = [t.metric for t in spec.TARGETS]
    print("| variant | " + " | ".join(metrics) + " |\n|---|" + "---|" * len(metrics))
    for label, model in rows:
        got = search.val.metrics(model)
        print(f"| {label} | " + " | ".join(f"{got[m]:.4f}" for m in metrics) + " |", flush=True)


if __name__ == "__main__":
    main()
