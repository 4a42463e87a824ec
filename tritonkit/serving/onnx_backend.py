"""The Python-based backends that serve ONNX files in the embedded tritonserver: `backends/onnxruntime/` and
`backends/openvino/` are this class over one runtime each (tritonkit.serving.runtimes).

Triton (>= 23.10) serves any model whose config says `backend: "<name>"` with `<backend-dir>/<name>/model.py`, so
configs written for the NGC container's native onnxruntime and openvino backends run unchanged here.

Batching is real: all requests handed to one `execute()` run as one inference (concatenated on the batch axis;
inputs with `allow_ragged_batch` are right-padded to the longest in the group), and outputs are split back.
A request whose tensors do not fit fails alone. If a batched run fails, only that run's requests are retried, by
bisection (halves, then halves of the failing half): one bad request among n costs about 2·log2(n) extra runs, not
n, and the other groups of the same execute() are not rerun. Retries are counted in `tritonkit_ort_retried_runs`.

Errors a request causes (missing input, dtype, rank, shape, batch size, an id outside its embedding table, a
tensor onnxruntime rejects as an invalid argument) are client errors (HTTP 400 / gRPC INVALID_ARGUMENT) naming the
input and the limit; any other failure of the run is the server's (HTTP 500 / gRPC INTERNAL).

Config `parameters` (string values), same keys as the native backend where one exists:
  intra_op_thread_count, inter_op_thread_count   onnxruntime thread pools (default: usable CPUs / instances, 1)
  INFERENCE_NUM_THREADS, NUM_STREAMS,             openvino (default: usable CPUs / instances, 1 stream, LATENCY;
  PERFORMANCE_HINT, COMPILATION_NUM_THREADS,      validated as the native openvino backend does)
  HINT_BF16
  pad_value.<INPUT>                               value used to right-pad a ragged input (default 0)
  ragged_max_padding                              split a ragged batch into length buckets so that padding is
                                                  at most this fraction of each run's elements
                                                  (tritonkit.serving.batching; default: one run per execute(),
                                                  padded to the longest); buckets of rows, by their
                                                  attention_mask, where each output is one value per row,
                                                  else of whole requests
  packed_model                                    a text encoder's packed form (tritonkit.serving.packing), in the
                                                  version directory: each execute() runs its texts end to end in rows,
                                                  no padding, one run; the config's inputs stay input_ids +
                                                  attention_mask. Absent file: length buckets, with a warning
  packed_row_tokens                               tokens per packed row (default tritonkit.serving.packing.ROW_TOKENS)
  packed_width_multiple                           round a packed run's row width up to a multiple of this (masked
                                                  slots) and its text count to a power of two, when > 1: fewer
                                                  distinct shapes for a runtime that prepares kernels per shape
                                                  (OpenVINO; default 1)
  packed_static_rows                              openvino: row counts ("1", "1,2") whose packed runs, at every
                                                  width bucket, run on models compiled for that static shape
                                                  (tritonkit.serving.packing.StaticShapes; default none)
  arena_release_batch                             onnxruntime: after a burst of runs above this many rows, give its
                                                  CPU arena back to the OS
                                                  (tritonkit.serving.backend_utils.ArenaRelease; default
                                                  max_batch_size // 4, "0": never)
  warmup_runs                                     runs over a made-up batch at load, so the first requests do not
                                                  pay for lazy kernel set-up (default 2; "0": none)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.errors import ConfigError
from tritonkit.serving import packing
from tritonkit.serving.backend_utils import (
    announce_precision,
    error_response,
    index_limits,
    ort_metrics,
    pad_concat,
    param,
    usable_cpus,
)
from tritonkit.serving.batching import length_buckets, right_padded_lengths, run_in_buckets
from tritonkit.serving.runtimes import open_runner, static_shapes


class _RequestError(ValueError):
    pass


class OnnxModel:
    """One model of `backend: <RUNTIME>`; subclasses name the runtime."""

    RUNTIME = ""

    def initialize(self, args: dict) -> None:
        self.config = json.loads(args["model_config"])
        self.name = self.config["name"]
        self.max_batch_size = int(self.config.get("max_batch_size", 0))
        model_dir = Path(args["model_repository"]) / args["model_version"]
        filename = self.config.get("default_model_filename") or "model.onnx"
        model_path = model_dir / filename
        if not model_path.exists():
            raise pb_utils.TritonModelException(f"{self.name}: model file not found: {model_path}")

        try:
            self.session = open_runner(self.RUNTIME, model_path, self.config)
        except ConfigError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        pb_utils.Logger.log_info(f"{self.name}: {self.session.describe()} (usable CPUs {usable_cpus()})")
        # An INT8 model name serving the FP32 graph: say so wherever operators look, and on the metrics port.
        self._precision_gauge = announce_precision(pb_utils, self.config, self.name, self.session.metadata)
        # Ids past an embedding table fail inside session.run with an opaque message: check them up front.
        self.index_limits = index_limits(model_path)

        self.inputs = []
        for cfg in self.config["input"]:
            self.inputs.append(
                {
                    "name": cfg["name"],
                    "dtype": pb_utils.triton_string_to_numpy(cfg["data_type"]),
                    "dims": [int(d) for d in cfg["dims"]],
                    "ragged": bool(cfg.get("allow_ragged_batch", False)),
                    "optional": bool(cfg.get("optional", False)),
                    "pad": float(param(self.config, f"pad_value.{cfg['name']}", "0")),
                }
            )
        bucketing = param(self.config, "ragged_max_padding")
        self.max_padding = float(bucketing) if bucketing is not None else None
        self.outputs = [
            (cfg["name"], pb_utils.triton_string_to_numpy(cfg["data_type"])) for cfg in self.config["output"]
        ]
        # Rows of one request differ in length too (a reranker's 20 documents): bucket rows, not requests, where
        # each row's length is its attention_mask's and every output is one fixed-shape value per row.
        ragged = [s for s in self.inputs if s["ragged"]]
        self.row_buckets = (self.max_padding is not None and self.max_batch_size > 0
                            and any(s["name"] == "attention_mask" for s in ragged)
                            and all(s["dims"] == [-1] for s in ragged)
                            and all(-1 not in [int(d) for d in cfg["dims"]] for cfg in self.config["output"]))
        session_inputs = self.session.input_names
        for spec in self.inputs:
            if spec["name"] not in session_inputs:
                raise pb_utils.TritonModelException(
                    f"{self.name}: config input '{spec['name']}' is not an input of {filename} "
                    f"(model inputs: {sorted(session_inputs)})"
                )
        self.packed = None
        packed_name = param(self.config, "packed_model")
        if packed_name and self.max_batch_size > 0:
            packed_file = model_dir / packed_name
            if packed_file.exists():
                self.packed = open_runner(self.RUNTIME, packed_file, self.config)
                meta = self.packed.metadata
                self.pooling = meta[packing.META_POOLING]
                self.row_tokens = int(param(self.config, "packed_row_tokens", str(packing.ROW_TOKENS)))
                self.width_multiple = int(param(self.config, "packed_width_multiple", "1"))
                self.pad_id = int(float(param(self.config, "pad_value.input_ids", "0")))
                try:
                    static_shapes(self.packed, self.config, self.row_tokens, self.width_multiple, self.max_batch_size)
                except ConfigError as err:
                    raise pb_utils.TritonModelException(str(err)) from None
                pb_utils.Logger.log_info(f"{self.name}: packed batches from {packed_name} ({self.pooling} pooling, "
                                         f"rows of {self.row_tokens} tokens)")
            else:
                pb_utils.Logger.log_warn(f"{self.name}: {packed_name} not found; padded length buckets instead "
                                         "(`make build` writes it)")
        labels = {"model": self.name, "version": str(args["model_version"])}
        self._counters = ort_metrics(pb_utils, labels)
        self._warm_up(int(param(self.config, "warmup_runs", "2")))

    def _warm_up(self, runs: int) -> None:
        """Run a made-up batch (ids 0, masks 1, 8 per free dim) before the first request: both runtimes set up
        kernels lazily on a new shape, and the first requests would pay for it."""
        if runs <= 0:
            return
        rows = 2 if self.max_batch_size > 0 else None
        feeds = {}
        for spec in self.inputs:
            if spec["optional"]:
                continue
            shape = [8 if d == -1 else d for d in spec["dims"]]
            feeds[spec["name"]] = np.ones([rows, *shape] if rows else shape, dtype=spec["dtype"]) \
                if spec["name"] == "attention_mask" else np.zeros([rows, *shape] if rows else shape, spec["dtype"])
        try:
            for _ in range(runs):
                if self.packed is not None:
                    merged, _, _ = self._pack([feeds])
                    self.packed.run([name for name, _ in self.outputs], merged, rows or 1)
                self.session.run([name for name, _ in self.outputs], feeds, rows or 1)
                self._counters.add("warmup_runs", 1)
        except Exception as err:  # a model whose inputs need real values: serve anyway, say so
            pb_utils.Logger.log_warn(f"{self.name}: warm-up skipped: {err}")

    # -- request handling ---------------------------------------------------------------------------------
    def _read(self, request) -> dict[str, np.ndarray]:
        feeds = {}
        for spec in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec["name"])
            if tensor is None:
                if spec["optional"]:
                    continue
                raise _RequestError(f"input '{spec['name']}' is missing")
            array = tensor.as_numpy()
            if array.dtype != spec["dtype"]:
                raise _RequestError(
                    f"input '{spec['name']}': dtype {array.dtype} does not match config {np.dtype(spec['dtype'])}"
                )
            dims = spec["dims"]
            if self.max_batch_size > 0:
                if array.ndim != len(dims) + 1:
                    raise _RequestError(
                        f"input '{spec['name']}': rank {array.ndim} != {len(dims) + 1} (batch + dims {dims})"
                    )
                if array.shape[0] > self.max_batch_size:
                    raise _RequestError(
                        f"input '{spec['name']}': batch {array.shape[0]} exceeds max_batch_size {self.max_batch_size}"
                    )
                shape = array.shape[1:]
            else:
                shape = array.shape
            if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)):
                raise _RequestError(f"input '{spec['name']}': shape {list(shape)} does not match config dims {dims}")
            # A config looser than its graph: the graph's static dims decide, on every runtime alike.
            graph = self.session.input_shapes.get(spec["name"])
            if graph is not None and self.max_batch_size > 0:
                graph = graph[1:]
            for axis, (need, got) in enumerate(zip(graph or (), shape)):
                if need is not None and need != got:
                    raise _RequestError(f"input '{spec['name']}': dim {axis} is {got} but the graph takes only "
                                        f"{need} (Expected: {need})")
            limit = self.index_limits.get(spec["name"])
            if limit is not None and array.size and (array.min() < 0 or array.max() >= limit[0]):
                bad = int(array.max()) if array.max() >= limit[0] else int(array.min())
                raise _RequestError(
                    f"input '{spec['name']}': value {bad} is out of range; ids must be in [0, {limit[0]}) "
                    f"(rows of {limit[1]})"
                )
            feeds[spec["name"]] = array
        if self.max_batch_size > 0 and feeds:
            sizes = {a.shape[0] for a in feeds.values()}
            if len(sizes) != 1:
                raise _RequestError(f"inputs disagree on batch size: {sorted(sizes)}")
        return feeds

    def _batch(self, feeds_list: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], int, int]:
        """Concatenate per-request feeds on axis 0, right-padding ragged inputs to the longest."""
        merged, total, padding = {}, 0, 0
        for spec in self.inputs:
            arrays = [f[spec["name"]] for f in feeds_list if spec["name"] in f]
            if not arrays:
                continue
            if len(arrays) != len(feeds_list):
                raise _RequestError(f"optional input '{spec['name']}' given by only some requests of a batch")
            merged[spec["name"]] = pad_concat(arrays, spec["name"], spec["ragged"], spec["pad"], _RequestError)
            total += merged[spec["name"]].size
            padding += merged[spec["name"]].size - sum(a.size for a in arrays)
        return merged, total, padding

    def _pack(self, feeds_list: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], int, int]:
        """Every text of every request, unpadded (its attention_mask's ones), laid end to end in rows."""
        texts = []
        for feeds in feeds_list:
            ids, mask = feeds["input_ids"], feeds["attention_mask"]
            if ids.shape != mask.shape:
                raise _RequestError(f"input 'attention_mask': shape {list(mask.shape)} differs from input_ids' "
                                    f"{list(ids.shape)}")
            for row, keep in zip(ids, mask != 0):
                if not keep.any():
                    raise _RequestError("input 'attention_mask': a text with no tokens (all zeros)")
                texts.append(row[keep])
        feeds = packing.pack(texts, self.row_tokens, self.pooling, self.pad_id, width_multiple=self.width_multiple)
        tokens = sum(len(t) for t in texts)
        return feeds, feeds["input_ids"].size, feeds["input_ids"].size - tokens

    def _run(self, feeds_list: list[dict[str, np.ndarray]], retry: bool = False) -> list[list[np.ndarray]]:
        session = self.session
        if self.packed is not None:
            merged, total, padding = self._pack(feeds_list)
            session, rows = self.packed, merged["pool"].shape[0]  # texts, not packed rows
        elif self.max_batch_size == 0:
            merged, total, padding = feeds_list[0], sum(a.size for a in feeds_list[0].values()), 0
            rows = 1
        else:
            merged, total, padding = self._batch(feeds_list)
            rows = next(iter(merged.values())).shape[0]
        if retry:
            self._counters.add("retried_runs", 1)
        try:
            if self.row_buckets and self.packed is None and rows > 1:
                results, released, runs, total, padding = self._run_rows(merged)
            else:
                (results, released), runs = session.run([name for name, _ in self.outputs], merged, rows), 1
        except Exception:
            self._counters.add("failed_runs", 1)
            raise
        self._counters.add("session_runs", runs)
        self._counters.add("arena_releases", int(released))
        self._counters.add("batched_requests", len(feeds_list))
        self._counters.add("input_elements", total)
        self._counters.add("padding_elements", padding)
        if self.max_batch_size == 0:
            return [results]
        per_request, start = [], 0
        for feeds in feeds_list:
            n = next(iter(feeds.values())).shape[0]
            per_request.append([r[start : start + n] for r in results])
            start += n
        return per_request

    def _run_rows(self, merged: dict[str, np.ndarray]) -> tuple[list[np.ndarray], bool, int, int, int]:
        """The batch's rows in length buckets, each ragged input cut to its bucket's longest row: (outputs in row
        order, arena released, runs, elements fed, padding fed)."""
        lengths = right_padded_lengths(merged["attention_mask"])
        ragged = {s["name"] for s in self.inputs if s["ragged"]}
        fed, released = 0, False

        def run(rows: list[int]) -> list[np.ndarray]:
            nonlocal fed, released
            width = int(lengths[rows].max())
            feeds = {n: a[rows, :width] if n in ragged else a[rows] for n, a in merged.items()}
            results, freed = self.session.run([name for name, _ in self.outputs], feeds, len(rows))
            released |= freed
            fed += sum(a.size for a in feeds.values())
            return results

        results, runs = run_in_buckets(lengths.tolist(), self.max_padding, run)
        useful = sum(int(lengths.sum()) if n in ragged else a.size for n, a in merged.items())
        return results, released, runs, fed, fed - useful

    def _respond(self, outputs: list[np.ndarray]):
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value.astype(dtype, copy=False)))
            for (name, dtype), value in zip(self.outputs, outputs)
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def _error(message: str, client: bool):
        return error_response(pb_utils, message, client=client)

    def _serve(self, group: list[tuple[int, dict[str, np.ndarray]]], responses: list, retry: bool = False) -> None:
        """One session.run over `group`; if it fails, bisect: each half is run (and split again) on its own."""
        try:
            outputs = self._run([f for _, f in group], retry)
        except Exception as err:
            if len(group) > 1:
                half = len(group) // 2
                self._serve(group[:half], responses, retry=True)
                self._serve(group[half:], responses, retry=True)
                return
            # onnxruntime's INVALID_ARGUMENT is about the feeds (type, rank, dims, index bounds): the request's fault.
            client = isinstance(err, (_RequestError, *self.session.client_errors))
            responses[group[0][0]] = self._error(f"{self.name}: {'' if client else 'inference failed: '}{err}", client)
            return
        for (i, _), out in zip(group, outputs):
            try:
                responses[i] = self._respond(out)
            except Exception as err:
                responses[i] = self._error(f"{self.name}: cannot build the response: {err}", client=False)

    def _groups(self, good: list[tuple[int, dict[str, np.ndarray]]]) -> list[list]:
        """The session runs of one execute(): all requests in one, or length buckets when configured."""
        if self.max_batch_size == 0:  # no batch axis, nothing to merge: one run per request
            return [[g] for g in good]
        ragged = [s["name"] for s in self.inputs if s["ragged"]]
        if self.packed is not None or self.max_padding is None or not ragged or len(good) < 2 or self.row_buckets:
            return [good]
        # A request's length: its widest ragged input (all ragged inputs of a text model share the length).
        lengths = [max(int(np.prod(f[n].shape[1:])) for n in ragged if n in f) for _, f in good]
        rows = [next(iter(f.values())).shape[0] for _, f in good]
        return [[good[j] for j in run] for run in length_buckets(lengths, rows, self.max_padding)]

    def execute(self, requests):
        responses: list = [None] * len(requests)
        good: list[tuple[int, dict[str, np.ndarray]]] = []
        for i, request in enumerate(requests):
            try:
                good.append((i, self._read(request)))
            except _RequestError as err:
                responses[i] = self._error(f"{self.name}: {err}", client=True)
        if good:
            for group in self._groups(good):
                self._serve(group, responses)
        return responses

    def finalize(self) -> None:
        self._counters.close()
        self.session = self.packed = self._precision_gauge = None


class OnnxRuntimeModel(OnnxModel):
    RUNTIME = "onnxruntime"


class OpenVinoModel(OnnxModel):
    RUNTIME = "openvino"
