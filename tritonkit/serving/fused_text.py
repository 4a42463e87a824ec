"""`<name>_fused` of a text model whose graph scores token ids (a reranker, a text classifier): the tokenizer and the
INT8 graph in ONE Python-backend stub, the ensemble's contract without its second stub round trip.

The text inputs are the config's BYTES inputs (one: texts; two: pairs, tritonkit.serving.textproc); every other
output than `num_tokens` and `truncated` is an output of the graph (parameter `onnx_model`, run on parameter
`runtime`, tritonkit.serving.runtimes), whose inputs take the token ids, the mask and, where the graph reads them,
the segment ids. All texts of all requests of one execute() go through one `encode_batch`, then length buckets
(`ragged_max_padding`, tritonkit.serving.batching) run the graph, and the rows are split back per request. Packing
(tritonkit.serving.packing) is not used: it rewrites an embedding's pooling tail, and a classifier's head follows
its pooling.

A request with a bad text fails alone (INVALID_ARG, the field and element named); the rest of the batch is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.errors import ConfigError
from tritonkit.serving import textproc
from tritonkit.serving.backend_utils import announce_precision, error_response, ort_metrics, param
from tritonkit.serving.batching import run_in_buckets
from tritonkit.serving.runtimes import open_runner

EXTRAS = ("num_tokens", "truncated")


def _error(message: str, client: bool = True):
    return error_response(pb_utils, message, client)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config["name"]
        model_dir = Path(args["model_repository"])
        try:
            self.tok = textproc.TextTokenizer(config, model_dir)
            onnx_path = textproc.resolve(param(config, "onnx_model", "model.onnx"), model_dir)
        except (LookupError, FileNotFoundError) as err:
            raise pb_utils.TritonModelException(f"{self.name}: {err}") from None
        if not onnx_path.exists():
            raise pb_utils.TritonModelException(f"{self.name}: model not found: {onnx_path} (built by "
                                                "`python -m tritonkit.build`)")
        try:
            self.session = open_runner(param(config, "runtime", "onnxruntime"), onnx_path, config)
        except ConfigError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        self.outputs = [o["name"] for o in config["output"] if o["name"] not in EXTRAS]
        self.segment_ids = "token_type_ids" in self.session.input_names
        self.pad_id = int(param(config, "pad_id", "0"))
        max_padding = param(config, "ragged_max_padding")
        self.max_padding = None if max_padding is None else float(max_padding)
        pb_utils.Logger.log_info(f"{self.name}: {self.session.describe()}, length buckets")
        self._precision_gauge = announce_precision(pb_utils, config, self.name, self.session.metadata)
        self._counters = ort_metrics(pb_utils, {"model": self.name, "version": str(args["model_version"])})
        warm = [("warm-up text", "a second, longer warm-up text")] if len(self.tok.fields) > 1 else ["warm-up text"]
        for _ in range(int(param(config, "warmup_runs", "2"))):  # lazy kernel set-up before the first request
            self._run(self.tok.encode([warm])[0].encodings, count=False)
            self._counters.add("warmup_runs", 1)

    def _feeds(self, encodings: list) -> dict[str, np.ndarray]:
        ids, mask = textproc.pad(encodings, self.pad_id)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.segment_ids:
            feeds["token_type_ids"] = textproc.pad_types(encodings)
        return feeds

    def _run(self, encodings: list, count: bool = True) -> list[np.ndarray]:
        """Every output of the graph for `encodings`, rows in their order, in length buckets."""
        lengths = [len(e.ids) for e in encodings]
        fed, released = 0, False

        def run(rows: list[int]) -> list[np.ndarray]:
            nonlocal fed, released
            feeds = self._feeds([encodings[i] for i in rows])
            results, freed = self.session.run(self.outputs, feeds, len(rows))
            released |= freed
            fed += feeds["input_ids"].size
            return results

        out, runs = run_in_buckets(lengths, self.max_padding, run)
        if count:
            self._counters.add("arena_releases", int(released))
            self._counters.add("session_runs", runs)
            self._counters.add("input_elements", fed)
            self._counters.add("padding_elements", fed - sum(lengths))
        return out

    def execute(self, requests):
        responses = [None] * len(requests)
        arrays, pairs = self.tok.request_arrays(requests, pb_utils.get_input_tensor_by_name)
        good: list[tuple[int, textproc.Encoded]] = []
        for r, enc in enumerate(self.tok.encode_requests(arrays, pairs)):
            if isinstance(enc, textproc.BadText):
                responses[r] = _error(f"{self.name}: {enc}")
            else:
                good.append((r, enc))
        if not good:
            return responses
        try:
            results = self._run([e for _, enc in good for e in enc.encodings])
        except Exception as err:  # every request of the group gets the reason; the model stays up
            for r, _ in good:
                responses[r] = _error(f"{self.name}: inference failed: {err}", client=False)
            return responses
        self._counters.add("batched_requests", len(good))
        start = 0
        for r, enc in good:
            n = len(enc.encodings)
            responses[r] = pb_utils.InferenceResponse(output_tensors=[
                *(pb_utils.Tensor(name, res[start : start + n]) for name, res in zip(self.outputs, results)),
                pb_utils.Tensor("num_tokens", enc.lengths),
                pb_utils.Tensor("truncated", enc.truncated),
            ])
            start += n
        return responses

    def finalize(self) -> None:
        self._counters.close()
        self.session = self._precision_gauge = None
