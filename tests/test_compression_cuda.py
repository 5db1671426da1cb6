"""Every codec on a CUDA tensor: the work stays on the GPU and payloads are device-independent."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import ErrorFeedback, decode, decode_into, get_codec
from swarm.compression.indices import decode_indices, encode_indices

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:64",
    "int8:256:bnb",
    "topk:0.01",
    "topk:0.3",
    "topk:0.05:int8",
    "1bit",
    "1bit:64",
    "sparse",
    "sparse:64:2:2",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [0, 1, 1001, 300_007])
def test_cuda_round_trip_matches_cpu(spec, dtype, numel):
    codec = get_codec(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    on_gpu = codec.encode(x.cuda())
    y_gpu = decode(on_gpu, device="cuda")
    assert y_gpu.device.type == "cuda" and y_gpu.dtype == dtype and y_gpu.shape == x.shape
    y_cpu = decode(on_gpu, device="cpu")
    # Float results may differ in the last bit between devices (FMA, reduction order).
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y_gpu.cpu().float(), y_cpu.float(), rtol=rtol, atol=1e-6)
    # Same codec on the CPU gives the same reconstruction, up to rounding.
    reference = decode(codec.encode(x))
    ties = spec.startswith("topk") or (spec.startswith("sparse") and dtype != torch.float32)
    if ties and numel:
        # Ties (frequent among 16-bit values) may be broken differently: compare how many
        # both kept.
        assert (y_gpu.cpu() != 0).sum() == (reference != 0).sum()
    elif spec.endswith("bnb") and numel:
        # bnb's CPU and CUDA kernels may pick neighbouring codes of its non-linear map.
        assert float((y_cpu.float() - reference.float()).norm()) <= 0.05 * float(x.float().norm())
    elif numel:
        # Rounding on the two devices may differ by one int8 step or one 16-bit ulp.
        step = float(x.float().abs().max()) / 127 if "int8" in spec else 1e-6
        assert torch.allclose(y_cpu.float(), reference.float(), rtol=rtol, atol=step * 1.01)
    acc = torch.ones(numel, device="cuda")
    decode_into(on_gpu, acc, 0.5)
    # decode_into adds the fp32 reconstruction; decode rounds it to the original dtype.
    atol = rtol * (1 + (float(y_cpu.float().abs().max()) if numel else 0.0))
    assert torch.allclose(acc.cpu(), 1 + 0.5 * y_cpu.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("spec", SPECS)
def test_cuda_error_feedback(spec):
    ef = ErrorFeedback(get_codec(spec))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        x = torch.randn(10_000, device="cuda", generator=gen)
        old = torch.zeros_like(x) if ef.residual is None else ef.residual.clone()
        y = decode(ef.encode(x), device="cuda")
        assert ef.residual.device.type == "cuda"
        # the residual keeps feedback_decay of what was left out (sparse: 0.95)
        assert torch.allclose(y + ef.residual / ef.codec.feedback_decay, x + old, atol=1e-4)


def test_cuda_non_finite_refused():
    from swarm.errors import CompressionError

    x = torch.randn(1000, device="cuda")
    x[10] = float("nan")
    for spec in SPECS:
        with pytest.raises(CompressionError, match="1 non-finite"):
            get_codec(spec).encode(x)


def test_cuda_index_encodings():
    for idx, numel in [
        (list(range(0, 100_000, 100)), 100_000),
        ([*range(50), 90_000], 100_000),
        (list(range(0, 1000, 2)), 1000),
    ]:
        t = torch.tensor(idx, device="cuda")
        enc, width, raw = encode_indices(t, numel)
        assert raw.device.type == "cuda"
        assert torch.equal(decode_indices(enc, width, raw, len(idx), numel).cpu(), t.cpu())
        cpu = encode_indices(t.cpu(), numel)
        assert (enc, width) == cpu[:2] and torch.equal(raw.cpu(), cpu[2])
