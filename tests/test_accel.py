"""Device choice, compute precision, FLOPs/MFU and peak memory (accel.py), with CUDA/MPS/XPU availability
monkeypatched: this machine has no accelerator."""

import pytest
import torch

from p2pdiloco.config import ConfigError, ModelConfig
from p2pdiloco.training import accel
from p2pdiloco.training.accel import (
    autocast_for,
    compute_dtype,
    flops_per_token,
    mfu,
    peak_flops,
    peak_memory,
    pick_device,
)


def _machine(monkeypatch, cuda=False, mps=False, xpu=False, bf16=True, name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(accel, "_mps_available", lambda: mps)
    monkeypatch.setattr(accel, "_xpu_available", lambda: xpu)


@pytest.mark.parametrize(("cuda", "mps", "xpu", "expected"), [
    (True, True, True, "cuda"), (False, True, True, "mps"), (False, False, True, "xpu"), (False, False, False, "cpu"),
])
def test_auto_prefers_cuda_then_mps_then_xpu_then_cpu(monkeypatch, cuda, mps, xpu, expected):
    _machine(monkeypatch, cuda=cuda, mps=mps, xpu=xpu)
    assert pick_device("auto").type == expected


def test_named_device_must_exist(monkeypatch):
    _machine(monkeypatch, cuda=True)
    assert pick_device("cuda:1") == torch.device("cuda:1")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="not available"):
        pick_device("mps")
    with pytest.raises(ConfigError, match="unknown device"):
        pick_device("tpu-ish")


def test_precision_per_device(monkeypatch):
    _machine(monkeypatch, cuda=True, bf16=True)
    assert compute_dtype(torch.device("cuda"), "auto") == torch.bfloat16
    assert compute_dtype(torch.device("xpu"), "auto") == torch.bfloat16
    assert compute_dtype(torch.device("cuda"), "fp32") == torch.float32
    for dev in ("cpu", "mps"):  # no bf16 autocast by default where it is slow or unverifiable
        assert compute_dtype(torch.device(dev), "auto") == torch.float32
    assert compute_dtype(torch.device("cpu"), "bf16") == torch.bfloat16
    _machine(monkeypatch, cuda=True, bf16=False)  # e.g. a V100 or T4: fp32, no loss scaler needed
    assert compute_dtype(torch.device("cuda"), "auto") == torch.float32
    with pytest.raises(ConfigError, match="run.precision"):
        compute_dtype(torch.device("cpu"), "fp8")


def test_bf16_autocast_runs_on_cpu_and_fp32_does_not_cast():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with autocast_for(torch.device("cpu"), "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast_for(torch.device("cpu"), "auto"):
        assert (a @ b).dtype == torch.float32


def test_flops_per_token_golden():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=8, seq_len=16)
    # N = 1000 parameters of which 16*8 = 128 are position embeddings: 6*872 + 12*2*8*16
    assert flops_per_token(cfg, 1000) == 6 * 872 + 3072 == 8304


def test_flops_per_token_llama_golden():
    # no position embeddings; an untied llama's input table (vocab 256 x d 8 = 2048) is only looked up
    tied = ModelConfig(n_layer=2, n_head=2, d_model=8, seq_len=16, arch="llama")
    assert flops_per_token(tied, 5000) == 6 * 5000 + 3072
    untied = ModelConfig(n_layer=2, n_head=2, d_model=8, seq_len=16, arch="llama", tie_embeddings=False)
    assert flops_per_token(untied, 5000) == 6 * (5000 - 2048) + 3072


def test_peak_flops_by_gpu_name_and_mfu(monkeypatch):
    _machine(monkeypatch, cuda=True, name="NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda")) == 989e12
    _machine(monkeypatch, cuda=True, name="NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda")) == 756e12
    _machine(monkeypatch, cuda=True, name="NVIDIA A100-SXM4-40GB")
    assert peak_flops(torch.device("cuda")) == 312e12
    _machine(monkeypatch, cuda=True, name="Some Future GPU")
    assert peak_flops(torch.device("cuda")) is None
    assert peak_flops(torch.device("cpu")) is None  # unknown: no MFU claimed
    assert peak_flops(torch.device("cpu"), override=1e12) == 1e12
    assert mfu(1000.0, 1e9, 1e12 * 2, n_devices=2) == pytest.approx(0.25)
    assert mfu(1000.0, 1e9, None) is None


def test_peak_memory_host_always_device_where_tracked(monkeypatch):
    cpu = peak_memory(torch.device("cpu"))
    assert cpu["peak_host_bytes"] > 50e6 and cpu["peak_device_bytes"] is None  # torch alone is > 50 MB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123456)
    assert peak_memory(torch.device("cuda"))["peak_device_bytes"] == 123456
