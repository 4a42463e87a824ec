"""`text_embedding_fused`: the `text_embedding` ensemble (tokenizer → INT8 text_encoder) in ONE Python-backend stub.

Same inputs, outputs and per-request errors as the ensemble, without its second stub round trip: all texts of all
requests of one execute() go through one `encode_batch`, then the encoder's runtime (parameter `runtime`:
onnxruntime or openvino, the one the build chose for the encoder, tritonkit.serving.runtimes) runs its ONNX
(parameter `onnx_model`, default the INT8 `text_encoder`'s file, shared rather than copied) over them, packed end to end
when the build wrote that file's packed form (tritonkit.serving.packing, as text_encoder does), else in length buckets
(`ragged_max_padding`, tritonkit.serving.batching), and the embeddings are split back per request.
Validation and tokenization are tritonkit/serving/textproc.py, shared with the `tokenizer` model; threads follow the
parameters of that runtime's backend (intra_op_thread_count or INFERENCE_NUM_THREADS, ...).

A request with a bad text fails alone (INVALID_ARG, the element named); the rest of the batch is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.errors import ConfigError
from tritonkit.serving import packing, textproc
from tritonkit.serving.backend_utils import announce_precision, error_response, ort_metrics, param
from tritonkit.serving.batching import run_in_buckets
from tritonkit.serving.runtimes import open_runner, static_shapes


def _error(message: str, client: bool = True):
    return error_response(pb_utils, message, client)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config["name"]
        model_dir = Path(args["model_repository"])
        try:
            self.tok = textproc.TextTokenizer(config, model_dir)
            ref = param(config, "onnx_model", "../text_encoder/1/model.onnx")
            onnx_path = textproc.resolve(ref, model_dir)
        except (LookupError, FileNotFoundError) as err:
            raise pb_utils.TritonModelException(f"{self.name}: {err}") from None
        if not onnx_path.exists():
            raise pb_utils.TritonModelException(
                f"{self.name}: encoder model not found: {onnx_path} (built by `python -m tritonkit.build text`)"
            )
        packed = packing.packed_path(onnx_path)
        self.packed = packed.exists()
        try:
            self.session = open_runner(param(config, "runtime", "onnxruntime"), packed if self.packed else onnx_path,
                                       config)
        except ConfigError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        if self.packed:
            self.pooling = self.session.metadata[packing.META_POOLING]
            self.row_tokens = int(param(config, "packed_row_tokens", str(packing.ROW_TOKENS)))
            self.width_multiple = int(param(config, "packed_width_multiple", "1"))
            try:
                static_shapes(self.session, config, self.row_tokens, self.width_multiple,
                              int(config.get("max_batch_size", 0)))
            except ConfigError as err:
                raise pb_utils.TritonModelException(str(err)) from None
        pb_utils.Logger.log_info(f"{self.name}: {self.session.describe()}, "
                                 f"{'packed batches from ' + packed.name if self.packed else 'buckets'}")
        self._precision_gauge = announce_precision(pb_utils, config, self.name, self.session.metadata)
        self.dim = int(pb_utils.get_output_config_by_name(config, "embedding")["dims"][-1])
        # Unset: one run padded to the longest text of the execute().
        max_padding = param(config, "ragged_max_padding")
        self.max_padding = None if max_padding is None else float(max_padding)
        labels = {"model": self.name, "version": str(args["model_version"])}
        # Same counters as backends/onnxruntime, so dashboards and benchmarks read padding waste alike.
        self._counters = ort_metrics(pb_utils, labels)
        for _ in range(int(param(config, "warmup_runs", "2"))):  # lazy kernel set-up before the first request
            self._embed(self.tok.encode([["warm-up text", "a second, longer warm-up text"]])[0].encodings,
                        count=False)
            self._counters.add("warmup_runs", 1)

    def _embed(self, encodings: list, count: bool = True) -> np.ndarray:
        """Embeddings of `encodings` in one packed run (or length buckets); `count=False` leaves the counters be."""
        if self.packed:
            # Pad slots are masked out of every text, so any valid id will do (textproc.pad uses 0 too).
            feeds = packing.pack([np.asarray(e.ids, np.int64) for e in encodings], self.row_tokens, self.pooling,
                                 width_multiple=self.width_multiple)
            results, released = self.session.run(["embedding"], feeds, len(encodings))
            runs, fed, useful, out = 1, feeds["input_ids"].size, sum(len(e.ids) for e in encodings), results[0]
        else:
            lengths = [len(e.ids) for e in encodings]
            fed, useful, released = 0, 2 * sum(lengths), False

            def run(rows: list[int]) -> list[np.ndarray]:
                nonlocal fed, released
                ids, mask = textproc.pad([encodings[i] for i in rows])
                results, freed = self.session.run(["embedding"], {"input_ids": ids, "attention_mask": mask}, len(rows))
                released |= freed
                fed += 2 * ids.size
                return results

            (out,), runs = run_in_buckets(lengths, self.max_padding, run)
        if count:
            self._counters.add("arena_releases", int(released))
            self._counters.add("session_runs", runs)
            self._counters.add("input_elements", fed)
            self._counters.add("padding_elements", fed - useful)
        return out

    def execute(self, requests):
        responses = [None] * len(requests)
        arrays = [pb_utils.get_input_tensor_by_name(request, "text").as_numpy() for request in requests]
        good: list[tuple[int, textproc.Encoded]] = []
        for r, enc in enumerate(self.tok.encode_requests(arrays)):
            if isinstance(enc, textproc.BadText):
                responses[r] = _error(f"{self.name}: {enc}")
            else:
                good.append((r, enc))
        if not good:
            return responses
        try:
            embeddings = self._embed([e for _, enc in good for e in enc.encodings])
        except Exception as err:  # every request of the group gets the reason; the model stays up
            for r, _ in good:
                responses[r] = _error(f"{self.name}: inference failed: {err}", client=False)
            return responses
        self._counters.add("batched_requests", len(good))
        start = 0
        for r, enc in good:
            n = len(enc.encodings)
            responses[r] = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("embedding", embeddings[start : start + n]),
                    pb_utils.Tensor("num_tokens", enc.lengths),
                    pb_utils.Tensor("truncated", enc.truncated),
                ]
            )
            start += n
        return responses

    def finalize(self) -> None:
        self._counters.close()
        self.session = self._precision_gauge = None
