"""A tiny model with a bounded queue, for the overload tests: the sleepy echo model of tiny_models (one
execute() takes `delay_ms`) with Triton's queue policy, so a burst far over capacity is shed by the scheduler."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import SLEEPY_MODEL_PY
from tritonkit.repository.config import DynamicBatching, ModelSpec, Tensor, to_pbtxt


def build_bounded_repository(
    repo: Path, delay_ms: int, max_queue_size: int, timeout_us: int = 0, max_batch_size: int = 2,
    name: str = "bounded", max_queue_delay_us: int = 1000,
) -> Path:
    """Python echo model (Y = X) with `max_batch_size` per execute() of `delay_ms`, one instance, and
    `default_queue_policy { timeout_action: REJECT, max_queue_size, default_timeout_microseconds }`."""
    cfg = ModelSpec(
        name=name, backend="python", max_batch_size=max_batch_size,
        inputs=[Tensor("X", "FP32", [1])], outputs=[Tensor("Y", "FP32", [1])],
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=max_queue_delay_us),
        parameters={"delay_ms": str(delay_ms)},
    ).to_proto()
    policy = cfg.dynamic_batching.default_queue_policy
    policy.timeout_action = policy.REJECT
    policy.max_queue_size = max_queue_size
    policy.default_timeout_microseconds = timeout_us
    policy.allow_timeout_override = True
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(to_pbtxt(cfg))
    (repo / name / "1" / "model.py").write_text(SLEEPY_MODEL_PY)
    return repo
