"""Packed text batches: several texts share one row of the encoder, with no padding between them.

A dynamic batch of texts in arrival order mixes lengths, and padding each to the longest wastes most of the work
(docs/performance.md: the same INT8 file runs 2.6x slower in arrival order than sorted). Length buckets
(`tritonkit.serving.batching`) save part of it at the price of small runs. Packing saves all of it: texts are laid
end to end in rows of up to `row_tokens` tokens, each token attends only to tokens of its own text (a block-diagonal
mask built in the graph from segment ids), positions restart at every text, and pooling is one MatMul with a
[texts, rows*tokens] weight matrix. Every per-token operation (embeddings, the dense layers, LayerNorm, GELU) is
row-independent, and masked keys get exactly zero attention weight, so in float each text's embedding equals its
padded one (an INT8 graph moves by its softmax's summation order; tritonkit.kinds.text.write_packed says how it
is proven instead). `pack_graph` rewrites the built FP32 or INT8 graph in place of re-exporting, which keeps the
INT8 recipe's weights and scales byte for byte.

    packed = pack_graph(onnx.load(path), pooling="mean", normalize=True, dim=384)
    feeds = pack([ids0, ids1, ...], row_tokens=ROW_TOKENS, pooling="mean")  # output row i: text i
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonkit.errors import PackingError

__all__ = ["POOLINGS", "PackingError", "StaticShapes", "bucket_width", "layout", "pack", "pack_graph", "packed_path"]

# Pooling modes a weight matrix can express; max pooling is not linear, so such models keep length buckets.
POOLINGS = ("mean", "mean_sqrt_len", "cls")
INPUTS = ("input_ids", "position_ids", "segment_ids", "pool")
# Tokens per packed row: one row holds a served batch of ~12 short texts, so OpenVINO runs most batches on a
# static one-row shape (docs/runtimes.md#static-shapes); ONNX Runtime times 64-256 alike (perf/bench_ceiling.py).
ROW_TOKENS = 256
# Width buckets per doubling of the row width (width_multiple > 1): 16..128 by 16, then 160..256 by 32, and so on.
BUCKETS_PER_DOUBLING = 8
# Row counts tried beyond the fewest that can hold a batch: more rows are rarely narrower, and each try costs a
# first-fit pass in the request path.
SPARE_ROWS = 2
# The additive mask value of a masked key: the one transformers uses, so exp() underflows to exactly 0.
MASKED = float(np.finfo(np.float32).min)
META_POOLING = "tritonkit.packed_pooling"


def bucket_width(width: int, multiple: int) -> int:
    """`width` rounded up to its bucket: multiples of `multiple` up to BUCKETS_PER_DOUBLING of them, then steps that
    double every BUCKETS_PER_DOUBLING buckets, so wide rows take few shapes; `multiple` <= 1: `width` itself."""
    if multiple <= 1:
        return width
    step = multiple
    while width > BUCKETS_PER_DOUBLING * step:
        step *= 2
    return -(-width // step) * step


def packed_path(model_path: Path) -> Path:
    """model.onnx -> model.packed.onnx, beside it in the same version directory."""
    return model_path.with_name(f"{model_path.stem}.packed{model_path.suffix}")


def _first_fit(lengths: Sequence[int], longest_first: Sequence[int], capacity: int) -> tuple[list[list[int]], int]:
    """First-fit decreasing (texts taken in `longest_first` order) into rows of `capacity` tokens: (text indices
    per row, the longest row's tokens)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in longest_first:
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows, max(capacity - free for free in room)


def layout(lengths: Sequence[int], row_tokens: int, balanced: bool = True) -> tuple[list[list[int]], int]:
    """Rows for texts of `lengths` tokens, at most max(row_tokens, longest) tokens each, with the fewest slots.

    Every row runs at the longest row's width, so filling rows of `row_tokens` leaves the last one mostly padding
    (160 tokens in rows of 128: 2 x 128 slots). Rows are balanced instead: for each row count that can hold the
    texts and up to SPARE_ROWS more, first-fit decreasing at capacity ceil(tokens / rows); the layout with the
    fewest rows x width slots, full rows included, wins (160 tokens: 2 x 80). `balanced=False` fills rows of
    max(row_tokens, longest); perf/bench_ceiling.py times both at served batch sizes.
    """
    total, longest = sum(lengths), max(lengths)
    limit = max(row_tokens, longest)
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # one sort for every capacity tried
    rows, width = _first_fit(lengths, longest_first, limit)
    if not balanced:
        return rows, width
    best = (len(rows) * width, rows, width)
    fewest = -(-total // limit)
    for count in range(fewest, min(fewest + SPARE_ROWS, len(lengths)) + 1):
        capacity = max(longest, -(-total // count))
        rows, width = _first_fit(lengths, longest_first, capacity)
        if len(rows) * width < best[0]:
            best = (len(rows) * width, rows, width)
        if capacity == longest:  # more rows cannot narrow them further
            break
    return best[1], best[2]


def pack(sequences: Sequence[np.ndarray], row_tokens: int, pooling: str, pad_id: int = 0, balanced: bool = True,
         width_multiple: int = 1) -> dict[str, np.ndarray]:
    """Feeds of a packed graph for `sequences` (each a 1-D array of one text's token ids, no padding).

    Rows as `layout` balances them; the pool matrix's row i weights text i's tokens as its pooling does (mean:
    1/len; mean_sqrt_len: 1/sqrt(len); cls: its first token), so the output's row i is text i's embedding, in the
    order given. `width_multiple` > 1 buckets the shapes, so a runtime that prepares kernels per input shape
    (OpenVINO) sees few distinct ones: the row width rounds up to its bucket (`bucket_width`, masked slots) and
    the pool's text count up to a power of two (zero rows, whose outputs the caller drops).
    """
    if pooling not in POOLINGS:
        raise PackingError(f"pooling '{pooling}' cannot be packed (packable: {', '.join(POOLINGS)})")
    lengths = [len(s) for s in sequences]
    if not lengths or min(lengths) < 1:
        raise PackingError("every text needs at least one token")
    rows, width = layout(lengths, row_tokens, balanced)
    width = bucket_width(width, width_multiple)
    ids = np.full((len(rows), width), pad_id, np.int64)
    positions = np.zeros((len(rows), width), np.int64)
    segments = np.full((len(rows), width), -1, np.int64)
    texts = 1 << (len(lengths) - 1).bit_length() if width_multiple > 1 else len(lengths)
    pool = np.zeros((texts, len(rows) * width), np.float32)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            n = lengths[i]
            ids[r, offset : offset + n] = sequences[i]
            positions[r, offset : offset + n] = np.arange(n)
            segments[r, offset : offset + n] = i
            flat = r * width + offset
            if pooling == "cls":
                pool[i, flat] = 1.0
            else:
                pool[i, flat : flat + n] = 1.0 / (np.sqrt(n) if pooling == "mean_sqrt_len" else n)
            offset += n
    return {"input_ids": ids, "position_ids": positions, "segment_ids": segments, "pool": pool}


@dataclass(frozen=True)
class StaticShapes:
    """Packed run shapes a runtime compiles as static models beside the dynamic one: `rows` row counts at every
    width bucket (`bucket_width`) up to `row_tokens`'s, each with a pool of `texts` rows (the most texts one run
    takes).

    OpenVINO's CPU plugin prepares every node again whenever a dynamic model's input shape changes, which a server's
    batches do nearly every call (docs/runtimes.md); a static model never does."""

    rows: tuple[int, ...]
    row_tokens: int
    width_multiple: int
    texts: int

    @classmethod
    def parse(cls, value: str, row_tokens: int, width_multiple: int, texts: int) -> StaticShapes | None:
        """From a config value such as "1" or "1,2" (empty: none); PackingError names what is wrong."""
        try:
            rows = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
        except ValueError:
            raise PackingError(f"expected row counts such as '1' or '1,2', got {value!r}") from None
        if not rows:
            return None
        if rows[0] < 1 or width_multiple < 2 or texts < 1:
            raise PackingError(f"static shapes need row counts >= 1, a width multiple >= 2 and a batch size >= 1 "
                               f"(got rows {list(rows)}, width multiple {width_multiple}, batch size {texts})")
        return cls(rows, row_tokens, width_multiple, texts)

    def fit(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int | None]:
        """Packed `feeds` whose rows and width are one of these shapes, with the pool grown to `texts` zero rows
        (their outputs are dropped), and the texts to keep; (feeds, None) as given otherwise."""
        rows, width = feeds["input_ids"].shape
        texts = feeds["pool"].shape[0]
        if rows not in self.rows or width not in self.widths() or texts > self.texts:
            return feeds, None
        pool = np.zeros((self.texts, feeds["pool"].shape[1]), np.float32)
        pool[:texts] = feeds["pool"]
        return {**feeds, "pool": pool}, texts

    def widths(self) -> tuple[int, ...]:
        return _widths(self.row_tokens, self.width_multiple)

    def examples(self) -> list[dict[str, np.ndarray]]:
        """One valid feed per static shape (each row one text of `width` tokens), to compile and warm up with."""
        out = []
        for rows in self.rows:
            for width in self.widths():
                pool = np.zeros((self.texts, rows * width), np.float32)
                for r in range(min(rows, self.texts)):
                    pool[r, r * width : (r + 1) * width] = 1.0 / width
                out.append({"input_ids": np.zeros((rows, width), np.int64),
                            "position_ids": np.tile(np.arange(width, dtype=np.int64), (rows, 1)),
                            "segment_ids": np.repeat(np.arange(rows, dtype=np.int64)[:, None], width, axis=1),
                            "pool": pool})
        return out


@functools.cache
def _widths(row_tokens: int, multiple: int) -> tuple[int, ...]:
    return tuple(sorted({bucket_width(w, multiple) for w in range(1, row_tokens + 1)}))


# -- graph rewrite -------------------------------------------------------------------------------------------

def _downstream(graph, source: str) -> set[str]:
    """Tensors whose values depend on `source`'s values (a Shape of it carries no values, only its size)."""
    reached = {source}
    for node in graph.node:  # exported graphs are topologically sorted
        if node.op_type not in ("Shape", "Size") and any(i in reached for i in node.input):
            reached.update(node.output)
    return reached


def _attention_mask_tensor(graph, producers: dict) -> str:
    """The additive mask every attention layer adds to its scores: derived from attention_mask, and not from the
    hidden states (so not the scores themselves, nor a relative-position bias)."""
    from_mask = _downstream(graph, "attention_mask")
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    if not norms:
        raise PackingError("no LayerNormalization node: not a transformer encoder graph")
    from_hidden = _downstream(graph, norms[0].output[0])
    found: set[str] = set()
    for softmax in (n for n in graph.node if n.op_type == "Softmax"):
        stack = [softmax.input[0]]
        while stack:
            tensor = stack.pop()
            if tensor in from_mask and tensor not in from_hidden:
                found.add(tensor)
                continue
            node = producers.get(tensor)
            if node is not None and node.op_type in ("Add", "Cast", "QuantizeLinear", "DequantizeLinear"):
                stack.extend(node.input)
    if len(found) != 1:
        raise PackingError(f"expected one attention mask shared by every layer's softmax, found {len(found)}")
    return found.pop()


def _position_ids_tensor(graph) -> str:
    gathers = [n for n in graph.node if n.op_type == "Gather" and "position_embeddings" in n.input[0]]
    if len(gathers) != 1:
        raise PackingError(f"expected one Gather on a position_embeddings table, found {len(gathers)}")
    return gathers[0].input[1]


def _position_offset(model, tensor: str) -> int:
    """Where the model's positions start (BERT 0; MPNet/RoBERTa padding_idx + 1), read by running the graph."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.INT64, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    n = 5
    ids = np.full((1, n), 1000, np.int64)
    positions = session.run([tensor], {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64)})[0]
    positions = np.asarray(positions).reshape(-1)
    if positions.shape != (n,) or not np.array_equal(positions, positions[0] + np.arange(n)):
        raise PackingError(f"position ids {positions.tolist()} are not consecutive for an unpadded text")
    return int(positions[0])


def pack_graph(model, pooling: str, normalize: bool, dim: int):
    """`model` (an exported or quantized encoder: input_ids + attention_mask -> pooled embedding) rewritten to
    take packed rows: input_ids, position_ids (0-based per text) and segment_ids [rows, tokens], and pool
    [texts, rows*tokens]; output the same embedding [texts, dim]."""
    import onnx
    from onnx import TensorProto, helper

    if pooling not in POOLINGS:
        raise PackingError(f"pooling '{pooling}' cannot be packed (packable: {', '.join(POOLINGS)})")
    names = [i.name for i in model.graph.input]
    if sorted(names) != ["attention_mask", "input_ids"]:
        raise PackingError(f"graph inputs {names}; expected input_ids and attention_mask")
    (output,) = model.graph.output
    producers = {o: n for n in model.graph.node for o in n.output}
    mask = _attention_mask_tensor(model.graph, producers)
    positions = _position_ids_tensor(model.graph)
    offset = _position_offset(model, positions)
    hidden = [n for n in model.graph.node if n.op_type == "LayerNormalization"][-1].output[0]

    packed = onnx.ModelProto()
    packed.CopyFrom(model)
    g = packed.graph
    for node in g.node:  # the rest of the graph reads our tensors instead of the ones derived from the mask
        for k, name in enumerate(node.output):
            if name == output.name:  # the padded pooling tail: pruned below
                node.output[k] = "packed/padded_output"
        for k, name in enumerate(node.input):
            if name == mask:
                node.input[k] = "packed/mask"
            elif name == positions:
                node.input[k] = "packed/positions"
    const = [
        helper.make_tensor("packed/offset", TensorProto.INT64, [], [offset]),
        helper.make_tensor("packed/zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("packed/masked", TensorProto.FLOAT, [], [MASKED]),
        helper.make_tensor("packed/axes_q", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("packed/axes_k", TensorProto.INT64, [2], [1, 2]),
        helper.make_tensor("packed/flat", TensorProto.INT64, [2], [-1, dim]),
        helper.make_tensor("packed/eps", TensorProto.FLOAT, [], [1e-12]),
    ]
    g.initializer.extend(const)
    head = [
        helper.make_node("Add", ["position_ids", "packed/offset"], ["packed/positions"], name="packed/Positions"),
        helper.make_node("Unsqueeze", ["segment_ids", "packed/axes_q"], ["packed/seg_q"], name="packed/SegQ"),
        helper.make_node("Unsqueeze", ["segment_ids", "packed/axes_k"], ["packed/seg_k"], name="packed/SegK"),
        helper.make_node("Equal", ["packed/seg_q", "packed/seg_k"], ["packed/same"], name="packed/Same"),
        helper.make_node("Where", ["packed/same", "packed/zero", "packed/masked"], ["packed/mask"],
                         name="packed/Mask"),
    ]
    tail = [
        helper.make_node("Reshape", [hidden, "packed/flat"], ["packed/tokens"], name="packed/Tokens"),
        helper.make_node("MatMul", ["pool", "packed/tokens"], ["packed/pooled" if normalize else output.name],
                         name="packed/Pool"),
    ]
    if normalize:  # torch.nn.functional.normalize: x / max(||x||, eps)
        tail += [
            helper.make_node("ReduceL2", ["packed/pooled"], ["packed/norm"], axes=[1], keepdims=1,
                             name="packed/Norm"),  # opset 17: axes is an attribute
            helper.make_node("Max", ["packed/norm", "packed/eps"], ["packed/norm_eps"], name="packed/NormEps"),
            helper.make_node("Div", ["packed/pooled", "packed/norm_eps"], [output.name], name="packed/Normalize"),
        ]
    rest = list(g.node)
    del g.node[:]
    g.node.extend(head + rest + tail)  # topological: the mask and positions read only graph inputs
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(output.name, TensorProto.FLOAT, ["texts", dim]))
    _prune(g)
    del g.input[:]
    g.input.extend([
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["rows", "tokens"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["rows", "tokens"]),
        helper.make_tensor_value_info("segment_ids", TensorProto.INT64, ["rows", "tokens"]),
        helper.make_tensor_value_info("pool", TensorProto.FLOAT, ["texts", "rows_x_tokens"]),
    ])
    used = {i for n in g.node for i in n.input}
    if "attention_mask" in used:
        readers = [n.name for n in g.node if "attention_mask" in n.input]
        raise PackingError(f"attention_mask is still read after the rewrite, by {readers}")
    del g.value_info[:]  # shapes of the rewritten part changed; onnxruntime infers them again
    helper.set_model_props(packed, {**{p.key: p.value for p in packed.metadata_props}, META_POOLING: pooling})
    return packed


def _prune(graph) -> None:
    """Drop nodes and initializers the outputs no longer need (the old mask and pooling subgraphs)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
