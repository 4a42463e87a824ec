"""Python-based `onnxruntime` backend for the embedded tritonserver.

Triton (>= 23.10) serves any model whose config says `backend: "onnxruntime"` with this file when it lies at
`<backend-dir>/onnxruntime/model.py`, so configs written for the NGC container's native ORT backend run unchanged.

Batching is real: all requests handed to one `execute()` run as one `session.run` (concatenated on the batch
axis; inputs with `allow_ragged_batch` are right-padded to the longest in the group), and outputs are split back.
A request whose tensors do not fit fails alone; if the batched run itself fails, requests are retried one by one
so the bad one is isolated.

Config `parameters` (string values), same keys as the native backend where one exists:
  intra_op_thread_count, inter_op_thread_count   ORT thread pools (default: cores / instances, 1)
  pad_value.<INPUT>                               value used to right-pad a ragged input (default 0)
  ragged_max_padding                              split a ragged batch into length buckets so that padding is
                                                  at most this fraction of each run's elements (tritonkit.batching;
                                                  default: one run per execute(), padded to the longest)
  arena_release_batch                             after a burst of runs above this many rows, give ORT's CPU
                                                  arena back to the OS (tritonkit.backend_utils.ArenaRelease;
                                                  default max_batch_size // 4, "0": never)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from tritonkit.backend_utils import ArenaRelease, error_response, ort_metrics, param, session_options
from tritonkit.batching import length_buckets


class _RequestError(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.config = json.loads(args["model_config"])
        self.name = self.config["name"]
        self.max_batch_size = int(self.config.get("max_batch_size", 0))
        model_dir = Path(args["model_repository"]) / args["model_version"]
        filename = self.config.get("default_model_filename") or "model.onnx"
        model_path = model_dir / filename
        if not model_path.exists():
            raise pb_utils.TritonModelException(f"{self.name}: model file not found: {model_path}")

        self.session = ort.InferenceSession(str(model_path), session_options(self.config),
                                            providers=["CPUExecutionProvider"])

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
        session_inputs = {i.name for i in self.session.get_inputs()}
        for spec in self.inputs:
            if spec["name"] not in session_inputs:
                raise pb_utils.TritonModelException(
                    f"{self.name}: config input '{spec['name']}' is not an input of {filename} "
                    f"(model inputs: {sorted(session_inputs)})"
                )
        labels = {"model": self.name, "version": str(args["model_version"])}
        self._families, self._metrics = ort_metrics(pb_utils, labels)
        self.arena = ArenaRelease(self.config)

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
            target = np.max([a.shape[1:] for a in arrays], axis=0)
            parts = []
            for a in arrays:
                pad = [(0, 0)] + [(0, int(t - s)) for t, s in zip(target, a.shape[1:])]
                if any(p[1] for p in pad):
                    if not spec["ragged"]:
                        raise _RequestError(f"input '{spec['name']}': shapes differ within a batch")
                    a = np.pad(a, pad, constant_values=np.asarray(spec["pad"]).astype(a.dtype))
                parts.append(a)
            merged[spec["name"]] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            total += merged[spec["name"]].size
            padding += merged[spec["name"]].size - sum(a.size for a in arrays)
        return merged, total, padding

    def _run(self, feeds_list: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        if self.max_batch_size == 0:
            merged, total, padding = feeds_list[0], sum(a.size for a in feeds_list[0].values()), 0
        else:
            merged, total, padding = self._batch(feeds_list)
        rows = next(iter(merged.values())).shape[0] if self.max_batch_size else 1
        results, released = self.arena.run(self.session, [name for name, _ in self.outputs], merged, rows)
        self._metrics["session_runs"].increment(1)
        self._metrics["arena_releases"].increment(int(released))
        self._metrics["batched_requests"].increment(len(feeds_list))
        self._metrics["input_elements"].increment(total)
        self._metrics["padding_elements"].increment(padding)
        if self.max_batch_size == 0:
            return [results]
        per_request, start = [], 0
        for feeds in feeds_list:
            n = next(iter(feeds.values())).shape[0]
            per_request.append([r[start : start + n] for r in results])
            start += n
        return per_request

    def _respond(self, outputs: list[np.ndarray]):
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value.astype(dtype, copy=False)))
            for (name, dtype), value in zip(self.outputs, outputs)
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def _error(message: str):
        return error_response(pb_utils, message, client=False)

    def _groups(self, good: list[tuple[int, dict[str, np.ndarray]]]) -> list[list]:
        """The session runs of one execute(): all requests in one, or length buckets when configured."""
        if self.max_batch_size == 0:  # no batch axis, nothing to merge: one run per request
            return [[g] for g in good]
        ragged = [s["name"] for s in self.inputs if s["ragged"]]
        if self.max_padding is None or not ragged or len(good) < 2:
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
                responses[i] = self._error(f"{self.name}: {err}")
        if good:
            try:
                for group in self._groups(good):
                    for (i, _), out in zip(group, self._run([f for _, f in group])):
                        responses[i] = self._respond(out)
            except Exception:
                # Isolate the request that broke the batched run; the others still get answers.
                for i, feeds in good:
                    try:
                        responses[i] = self._respond(self._run([feeds])[0])
                    except Exception as err:
                        responses[i] = self._error(f"{self.name}: inference failed: {err}")
        return responses

    def finalize(self) -> None:
        self._metrics.clear()
        self._families.clear()
        self.session = None
