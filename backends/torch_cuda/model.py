"""Python-based `torch_cuda` backend: serves a torch module built from the model's config
(tritonkit.serving.torch_serving) on the instance's GPU (KIND_GPU, FP16 or FP32) or on the CPU (KIND_CPU, FP32).

Used by the GPU view of the repository (`python -m tritonkit.runtime.gpu_repository`), where the text encoder and the
image classifier run here instead of in onnxruntime on the CPU. Batching as in backends/onnxruntime: every request of
one execute() runs as one forward pass (ragged inputs right-padded to the longest), outputs are split back; a request
whose tensors do not fit fails alone, and if the batched pass fails the requests are retried one by one.

Config parameters: see tritonkit/serving/torch_serving.py; also `pad_value.<INPUT>` (default 0) and `warmup` ("1", the
default: one pass at batch 1 and at max_batch_size at load, so CUDA context, kernel loading and the caching
allocator's growth stay out of served requests).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.serving import torch_serving
from tritonkit.serving.backend_utils import error_response, param


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        self.torch = torch
        self.config = json.loads(args["model_config"])
        self.name = self.config["name"]
        self.max_batch_size = int(self.config.get("max_batch_size", 0))
        if self.max_batch_size < 1:
            raise pb_utils.TritonModelException(f"{self.name}: max_batch_size: torch_cuda needs a batch axis")
        if args.get("model_instance_kind") == "GPU":
            if not torch.cuda.is_available():
                raise pb_utils.TritonModelException(f"{self.name}: instance_group.kind: KIND_GPU but torch sees "
                                                    "no CUDA device")
            self.device = f"cuda:{int(args['model_instance_device_id'])}"
            torch.cuda.set_device(self.device)
            # Shapes change with every dynamic batch, and cuDNN's autotuning of each new shape stalled the load
            # (64 batch sizes x 2 instances took over 180 s): heuristic algorithm choice instead.
            torch.backends.cudnn.benchmark = False
        else:
            self.device = "cpu"
        version_dir = Path(args["model_repository"]) / args["model_version"]
        try:
            self.module, self.dtype = torch_serving.build_module(self.config, version_dir, self.device)
        except torch_serving.ModuleConfigError as err:
            raise pb_utils.TritonModelException(f"{self.name}: {err}") from None
        self.channels_last = self.device != "cpu" and param(self.config, "architecture") == "efficientnet-lite"
        self.inputs = [
            {
                "name": cfg["name"],
                "dtype": pb_utils.triton_string_to_numpy(cfg["data_type"]),
                "dims": [int(d) for d in cfg["dims"]],
                "ragged": bool(cfg.get("allow_ragged_batch", False)),
                "pad": float(param(self.config, f"pad_value.{cfg['name']}", "0")),
            }
            for cfg in self.config["input"]
        ]
        self.outputs = [
            (cfg["name"], pb_utils.triton_string_to_numpy(cfg["data_type"])) for cfg in self.config["output"]
        ]
        if self.device != "cpu" and param(self.config, "warmup", "1") == "1":
            self._warmup()

    def _warmup(self) -> None:
        for rows in sorted({1, self.max_batch_size}):
            feeds = {}
            for spec in self.inputs:
                shape = [rows] + [d if d > 0 else 16 for d in spec["dims"]]
                feeds[spec["name"]] = np.ones(shape, dtype=spec["dtype"])
            self._forward(feeds)

    def _forward(self, merged: dict[str, np.ndarray]) -> list[np.ndarray]:
        torch = self.torch
        tensors = []
        for spec in self.inputs:
            t = torch.from_numpy(merged[spec["name"]]).to(self.device, non_blocking=True)
            if t.is_floating_point():
                t = t.to(self.dtype)
                if self.channels_last and t.dim() == 4:
                    t = t.contiguous(memory_format=torch.channels_last)
            tensors.append(t)
        with torch.inference_mode():
            results = self.module(*tensors)
        # .cpu() waits for the GPU: the pass is done when execute() returns.
        return [r.float().cpu().numpy() for r in results]

    def _run(self, group: list[tuple[int, dict[str, np.ndarray], int]]) -> list[list[np.ndarray]]:
        merged = torch_serving.merge([feeds for _, feeds, _ in group], self.inputs)
        return torch_serving.split(self._forward(merged), [rows for _, _, rows in group])

    def _respond(self, outputs: list[np.ndarray]):
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value.astype(dtype, copy=False)))
            for (name, dtype), value in zip(self.outputs, outputs)
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        responses: list = [None] * len(requests)
        good = []
        for i, request in enumerate(requests):
            feeds = {}
            for spec in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, spec["name"])
                if tensor is not None:
                    feeds[spec["name"]] = tensor.as_numpy()
            try:
                good.append((i, feeds, torch_serving.check_request(feeds, self.inputs, self.max_batch_size)))
            except torch_serving.RequestError as err:
                responses[i] = error_response(pb_utils, f"{self.name}: {err}")
        if good:
            try:
                for (i, _, _), out in zip(good, self._run(good)):
                    responses[i] = self._respond(out)
            except Exception:
                # Isolate the request that broke the batched pass; the others still get answers.
                for entry in good:
                    try:
                        responses[entry[0]] = self._respond(self._run([entry])[0])
                    except Exception as err:
                        responses[entry[0]] = error_response(pb_utils, f"{self.name}: inference failed: {err}",
                                                             client=False)
        return responses

    def finalize(self) -> None:
        self.module = None
        if self.device != "cpu":
            self.torch.cuda.empty_cache()
