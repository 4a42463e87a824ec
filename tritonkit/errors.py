"""Every error tritonkit raises on purpose, one class per failure kind, each naming what failed and how to fix it.

Each is also a subclass of the built-in it used to be (ValueError, RuntimeError, LookupError), so callers that
catch those keep working; the modules that raise them re-export them.
"""

from __future__ import annotations


class TritonkitError(Exception):
    """Base of every tritonkit error."""


# raised by tritonkit.envinfo
class CpuClassError(TritonkitError, ValueError):
    """$TRITONKIT_CPU_CLASS names no CPU INT8 class; the message lists the classes."""


# raised by tritonkit.repository.replica
class ReplicaError(TritonkitError, RuntimeError):
    """A replica's repository view cannot be made (a record that does not fit its repository); names the model."""


# raised by tritonkit.paths
class PackageNotInstalled(TritonkitError, LookupError):
    """An installed Python package the project reads files from is missing."""


# raised by tritonkit.repository.config
class ConfigError(TritonkitError, ValueError):
    """A config problem; `field` names the offending field (dotted path), `model` the config."""

    def __init__(self, model: str, field: str, message: str):
        self.model, self.field = model, field
        super().__init__(f"{model}: {field}: {message}")


# raised by tritonkit.kinds.spec
class SpecError(TritonkitError, ValueError):
    """A spec problem; `field` names the offending key (dotted), `spec` the file or model name."""

    def __init__(self, spec: str, field: str, message: str):
        self.spec, self.field = spec, field
        super().__init__(f"{spec}: {field}: {message}")


# raised by tritonkit.kinds.architectures
class SourceError(TritonkitError, ValueError):
    """A source directory cannot be served; the message names the missing or unsupported piece."""


# raised by tritonkit.add
class AddError(TritonkitError, ValueError):
    """The model cannot be added; the message says what is missing and where."""


# raised by tritonkit.serving.packing
class PackingError(TritonkitError, ValueError):
    """An encoder graph cannot be rewritten for packed batches; the message names the part not found."""


# raised by tritonkit.export
class ExportValidationError(TritonkitError, RuntimeError):
    """Some samples of the exported graph differ from the reference beyond the spec's tolerance."""

    def __init__(self, spec_name: str, metric: str, tolerance: float, failures: list, checked: int):
        self.spec_name, self.metric, self.tolerance = spec_name, metric, tolerance
        self.failures, self.checked = failures, checked
        op = ">=" if metric == "cosine" else "<="
        lines = "\n  ".join(str(c) for c in failures)
        super().__init__(
            f"{spec_name}: {len(failures)} of {checked} samples miss {metric} {op} {tolerance}; worst:\n  {lines}"
        )


# raised by tritonkit.int8 (quantize and the modules it is split into)
class QuantizationError(TritonkitError, RuntimeError):
    """The quantized graph breaks a rule (e.g. a non-zero zero point) or the recipe does not fit the graph."""


# raised by tritonkit.int8.search
class SearchError(TritonkitError, RuntimeError):
    """The search could not run (e.g. the graph has no quantizable unit)."""


# raised by the INT8 stage (tritonkit.int8.pipeline)
class GateError(TritonkitError, RuntimeError):
    """An INT8 model missed a gate, or was made on another package set or CPU; the message says how to fix it."""


# raised by tritonkit.tensorrt
class EngineError(TritonkitError, RuntimeError):
    """A plan could not be built or does not match ONNX Runtime within tolerance."""


# raised by tritonkit.serving.imaging
class ImageInputError(TritonkitError, ValueError):
    """One input image cannot be used; the message names the field and, where one applies, the limit."""


# raised by tritonkit.serving.textproc
class BadText(TritonkitError, ValueError):
    """A request's input cannot be embedded; the message names the element (`text[i] ...`)."""


# raised by tritonkit.perf.analyzer
class PerfError(TritonkitError, RuntimeError):
    """perf_analyzer failed or is missing; the message carries its output tail."""


# raised by tritonkit.data.photos
class PhotoDataError(TritonkitError, RuntimeError):
    """A photo in the manifest is missing or differs from the recorded file; the message names it."""


# raised by tritonkit.data.make_eval_corpus
class CorpusSourceError(TritonkitError, RuntimeError):
    """A source package is missing or its files are not in the expected form."""


# raised by tritonkit.runtime.supervisor
class SupervisorError(TritonkitError, RuntimeError):
    """The server command cannot be supervised as given (names the flag or variable to fix)."""


# raised by tritonkit.runtime.gpu_repository
class GpuRepositoryError(TritonkitError, ValueError):
    """A builder option is wrong; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


# raised by tritonkit.serving.torch_serving
class ModuleConfigError(TritonkitError, ValueError):
    """A config parameter of a torch_cuda model is missing or wrong; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"parameters.{field}: {message}")


# raised by tritonkit.runtime.server and tritonkit.runtime.backend_dir
class SetupError(TritonkitError, RuntimeError):
    """The environment is missing something `make setup` installs."""


# raised by tritonkit.runtime.server
class ServerStartError(TritonkitError, RuntimeError):
    """tritonserver exited or did not become ready; the message carries its log tail."""


class RepositoryCallError(TritonkitError, RuntimeError):
    """A repository API call (load, unload) was refused; the message carries Triton's own reason."""
