"""What this machine has for TensorRT (tritonkit.tensorrt.environment): the reason a build is skipped, detection
checked against the machine itself, and one build per compute capability on a device of it."""

from __future__ import annotations

from tests.support.tensorrt_support import this_machine
from tritonkit.tensorrt import environment
from tritonkit.tensorrt.environment import Environment, Gpu

H100 = Gpu(0, "NVIDIA H100", (9, 0), "GPU-11111111-2222-3333-4444-555555555555")


def test_skip_reason_names_what_is_missing():
    assert "import tensorrt" in Environment(None, (H100,)).skip_reason
    assert "no CUDA GPU" in Environment("10.5.0", ()).skip_reason
    both = Environment(None, ()).skip_reason
    assert "tensorrt" in both and "GPU" in both
    assert "older than 10" in Environment("8.6.1", (H100,)).skip_reason
    assert Environment("10.5.0", (H100,)).skip_reason is None
    assert Environment("11.0.1", (H100,)).skip_reason is None


def test_detect_is_consistent_with_this_machine():
    trt, gpus = this_machine()
    env = environment.detect()
    assert len(env.gpus) == gpus, (env.gpus, gpus)
    assert (env.trt_version is None) == (trt is None), (env.trt_version, trt)
    if trt is not None:
        assert env.trt_version.split(".")[:2] == trt.split(".")[:2]
    # The `gpu` tests skip exactly when detect() gives a reason (conftest): it must not give one here if both exist.
    runnable = trt is not None and gpus > 0 and int(trt.split(".")[0]) >= 10
    assert (env.skip_reason is None) == runnable, env.skip_reason


def test_one_build_per_compute_capability_on_a_device_of_it():
    l4, a10 = Gpu(1, "NVIDIA L4", (8, 9)), Gpu(2, "NVIDIA A10", (8, 6), "GPU-aaaaaaaa-0000-0000-0000-000000000000")
    second_h100 = Gpu(3, "NVIDIA H100", (9, 0))
    devices, missing = environment.plan_devices([H100, l4, second_h100, a10])
    assert devices == [a10, l4, H100] and missing == []
    devices, missing = environment.plan_devices([H100], wanted=["9.0", "8.6", "12.0"])
    assert devices == [H100] and missing == ["12.0", "8.6"]
    env = environment.device_env(a10, {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == a10.uuid and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert environment.device_env(l4, {})["CUDA_VISIBLE_DEVICES"] == "1"
