"""Codecs: round trips within their stated bounds, exact sizes, determinism, and error feedback."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.algorithm.codecs import Codec, CodecError, as_held, get_codec
from p2pdiloco.algorithm.feedback import ErrorFeedback
from p2pdiloco.config import CODECS
from p2pdiloco.network.allreduce import slice_bounds

LOSSY = [c for c in CODECS if c != "none"]


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [0, 1, 7, 128, 129, 4097, 50_001])
def test_roundtrip_within_stated_bound_and_exact_size(name, n):
    codec = get_codec(name)
    g = torch.Generator().manual_seed(n)
    # pseudo-gradient-like scales, plus a few large and tiny outliers that stress per-block scaling
    x = torch.randn(n, generator=g) * 1e-3
    if n > 10:
        x[::97] *= 1000
        x[5] = 0.0
    data, y = roundtrip(codec, x)
    assert len(data) == codec.encoded_size(n) if codec.exact_size else len(data) <= codec.encoded_size(n)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err, bound = (x - y).abs(), codec.error_bound(x)
    assert (err <= bound).all(), f"{name}: worst error {(err - bound).max():.3g} beyond the bound"
    if name == "none":
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", LOSSY)
def test_codecs_compress_and_are_deterministic(name):
    codec = get_codec(name)
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    a, b = codec.encode(x), codec.encode(x.clone())
    assert a == b  # members decoding one averaged slice must hold the same bits
    expected_ratio = {"fp16": 2, "bf16": 2, "int8": 3.99, "int4": 7.5, "sparseloco": 180}[name]
    assert 4 * x.numel() / len(a) >= expected_ratio
    assert torch.equal(codec.decode(a, x.numel()), codec.decode(bytes(a), x.numel()))


@pytest.mark.parametrize("name", CODECS)
def test_wrong_length_is_refused_not_misread(name):
    codec = get_codec(name)
    data = codec.encode(torch.ones(1000))
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(CodecError):
            codec.decode(bad, 1000)



def roundtrip(codec: Codec, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """(bytes sent, what the receiver decodes from them)."""
    data = codec.encode(x)
    return data, codec.decode(data, x.numel())

def test_int8_non_finite_block_scale_is_refused():
    codec = get_codec("int8")
    data = bytearray(codec.encode(torch.ones(10)))
    data[:4] = torch.tensor([float("inf")]).numpy().tobytes()
    with pytest.raises(CodecError, match="non-finite"):
        codec.decode(bytes(data), 10)


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_error_feedback_drives_accumulated_error_of_a_constant_signal_to_zero(name):
    """Send the same pseudo-gradient every round: without feedback the sum of what was sent drifts from the
    true sum by the same quantization error each round; with it, the drift stays one round's error."""
    codec = get_codec(name)
    signal = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e-2
    rounds = 200
    results = {}
    for enabled in (False, True):
        ef, total = ErrorFeedback(enabled), torch.zeros_like(signal)
        for _ in range(rounds):
            target = ef.compensate(signal)
            _, sent = roundtrip(codec, target)
            ef.commit(target, sent)
            total += sent
        results[enabled] = float((total / rounds - signal).norm() / signal.norm())
    one_round = float((roundtrip(codec, signal)[1] - signal).norm() / signal.norm())
    assert results[False] == pytest.approx(one_round, rel=1e-3)  # the same error, every round, never undone
    assert results[True] < one_round / 50  # mean error per round shrinks like 1/rounds
    ef = ErrorFeedback(True)
    ef.commit(signal, torch.zeros_like(signal))
    assert ef.norm() == pytest.approx(float(signal.norm()))  # a failed send (nothing arrived) is all residual


def test_error_feedback_disabled_or_mismatched_shape_passes_through():
    ef = ErrorFeedback(False)
    x = torch.ones(4)
    ef.commit(x, torch.zeros(4))
    assert ef.residual is None and torch.equal(ef.compensate(x), x)
    ef = ErrorFeedback(True)
    ef.commit(torch.ones(3), torch.zeros(3))
    assert torch.equal(ef.compensate(x), x)  # a residual of another model's shape is never added


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_blockwise_codes_are_bitsandbytes_maps_nearest_code_and_its_layout(name):
    """The plain-torch blockwise codec uses bitsandbytes' maps and byte layout: bitsandbytes' own dequantizer
    reads our bytes to our values, and each code is the nearest one (|error| ≤ half the gap around it)."""
    import bitsandbytes.functional as F  # a core dependency: a broken install fails here, it does not skip

    from p2pdiloco.algorithm.codecs import DYNAMIC_MAP, NF4_MAP, BlockwiseCodec

    assert torch.equal(DYNAMIC_MAP, F.create_dynamic_map().float())
    _, state = F.quantize_4bit(torch.zeros(64), blocksize=64, quant_type="nf4")
    assert torch.equal(NF4_MAP, state.code.float())
    codec = BlockwiseCodec(name)
    x = torch.randn(3 * codec.blocksize + 5, generator=torch.Generator().manual_seed(0))
    data = codec.encode(x)
    ours = codec.decode(data, x.numel())
    blocks = codec._blocks(x.numel())
    absmax = torch.frombuffer(bytearray(data[: 4 * blocks]), dtype=torch.float32)
    codes = torch.frombuffer(bytearray(data[4 * blocks:]), dtype=torch.uint8)
    if name == "int8":
        st = F.QuantState(absmax=absmax, code=DYNAMIC_MAP, blocksize=codec.blocksize, shape=x.shape, dtype=torch.float32)
        theirs = F.dequantize_blockwise(codes, st).float()
    else:
        st = F.QuantState(absmax=absmax, shape=x.shape, code=NF4_MAP, blocksize=codec.blocksize, quant_type="nf4",
                          dtype=torch.float32)
        theirs = F.dequantize_4bit(codes.view(-1, 1), st).float().reshape(-1)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    # nearest: no other code of the map is closer to x ÷ absmax than the one chosen
    scale = absmax.repeat_interleave(codec.blocksize)[: x.numel()]
    dist = ((x / scale)[:, None] - codec.code[None, :]).abs()
    chosen = ((ours / scale)[:, None] - codec.code[None, :]).abs().argmin(dim=1)
    assert torch.equal(dist.gather(1, chosen[:, None]).squeeze(1), dist.min(dim=1).values)


def test_a_peer_merging_with_int4_does_not_import_bitsandbytes():
    """bitsandbytes pulls in torch._dynamo (5–12 s of a peer's start-up): the codecs need none of it."""
    import subprocess
    import sys

    code = ("import sys, torch; from p2pdiloco.algorithm.codecs import get_codec; c = get_codec('int4'); "
            "c.decode(c.encode(torch.randn(1000)), 1000); import p2pdiloco.network.p2p_merger; "
            "print(sorted(m for m in sys.modules if m.startswith(('bitsandbytes', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("inner", ["int8", "int8-linear"])
def test_deflated_int8_is_int8_exactly_smaller_on_sparse_vectors_and_refuses_bombs(inner):
    """The codec of members' differences from an anchor (p2p_merger.STATE_DIFF_CODEC: linear int8, deflated)."""
    import zlib

    from p2pdiloco.algorithm.codecs import BlockwiseCodec, DeflatedCodec, LinearInt8Codec

    codec = DeflatedCodec(inner=BlockwiseCodec("int8") if inner == "int8" else LinearInt8Codec())
    n = 100_000
    x = torch.zeros(n)
    x[::50] = torch.randn(n // 50, generator=torch.Generator().manual_seed(0))  # 2 % non-zero, as after sparse merges
    data = codec.encode(x)
    assert torch.equal(codec.decode(data, n), codec.inner.decode(codec.inner.encode(x), n))  # int8's bits exactly
    assert len(data) < codec.inner.encoded_size(n) / 10
    dense = torch.randn(n, generator=torch.Generator().manual_seed(1))
    assert len(codec.encode(dense)) <= codec.encoded_size(n)  # the bound holds for incompressible codes too
    with pytest.raises(CodecError):
        codec.decode(zlib.compress(bytes(10 * n)), n)  # inflates past the int8 size: stopped there
    with pytest.raises(CodecError):
        codec.decode(zlib.compress(bytes(n)), n)  # too short
    with pytest.raises(CodecError):
        codec.decode(b"not deflate", n)
    with pytest.raises(CodecError):
        codec.decode(data + b"trailing", n)


def test_linear_int8_is_within_its_bound_deterministic_and_refuses_what_it_cannot_hold():
    """The codec of agreements' states (p2p_merger.STATE_CODEC): per 256 values one fp32 scale and round(x ÷ scale)."""
    from p2pdiloco.algorithm.codecs import LinearInt8Codec, NonFiniteError

    codec, gen = LinearInt8Codec(), torch.Generator().manual_seed(3)
    for n in (0, 1, 255, 256, 257, 10_000):
        x = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n) if n else torch.empty(0)
        data = codec.encode(x)
        assert len(data) == codec.encoded_size(n) == 4 * -(-n // 256) + n  # 1 byte a value and a scale a block
        y = codec.decode(data, n)
        assert (y - x).abs().le(codec.error_bound(x)).all()  # off by at most absmax/254 of its block
        assert codec.encode(x) == data and torch.equal(codec.decode(data, n), y)
    block = torch.tensor([1.27, -0.635, 0.0, 0.004] + [0.0] * 252)  # scale 0.01: codes 127, -64 (half to even), 0, 0
    assert codec.decode(codec.encode(block), 256)[:4].tolist() == pytest.approx([1.27, -0.64, 0.0, 0.0])
    assert torch.equal(codec.decode(codec.encode(torch.zeros(300)), 300), torch.zeros(300))
    with pytest.raises(CodecError):
        codec.decode(data[:-1], 10_000)
    bad = torch.tensor([float("inf")], dtype=torch.float32).numpy().tobytes() + bytes(10)
    with pytest.raises(NonFiniteError):
        codec.decode(bad, 10)


def _sliced_rounds(codec_name: str, owner_feedback: bool, rounds: int = 40, n_members: int = 4, n: int = 4096):
    """The sliced all-reduce's arithmetic (network/allreduce.py) with error feedback, `rounds` times, without a
    network: each member sends its target's other slices through the codec; a slice's owner averages its own part
    exact with the others' decoded ones and sends the average back through the codec, which every member applies.

    Returns:
        (Σ of the applied averages − Σ of the exact means of the members' pseudo-gradients; the members' mean
        residual at the end).
    """
    codec, g = get_codec(codec_name), torch.Generator().manual_seed(11)
    feedback = [ErrorFeedback() for _ in range(n_members)]
    drift = torch.zeros(n)
    for r in range(rounds):
        deltas = [torch.randn(n, generator=g) * 1e-2 + 3e-3 for _ in range(n_members)]
        targets = [f.compensate(d) for f, d in zip(feedback, deltas, strict=True)]
        sent = [t.clone() for t in targets]
        applied = torch.empty(n)
        for k, (lo, hi) in enumerate(slice_bounds(n, n_members)):
            owner = (k + r) % n_members  # ownership rotates from merge to merge, as allreduce.owned_slice does
            parts = []
            for i, t in enumerate(targets):
                part = t[lo:hi] if i == owner else codec.decode(codec.encode(t[lo:hi]), hi - lo)
                sent[i][lo:hi] = part
                parts.append(part)
            exact = torch.stack(parts).mean(0)
            held = codec.decode(codec.encode(exact), hi - lo)
            if owner_feedback:
                sent[owner][lo:hi] = as_held(targets[owner][lo:hi], exact, held, 1 / n_members, n_members)
            applied[lo:hi] = held
        for f, t, s in zip(feedback, targets, sent, strict=True):
            f.commit(t, s)
        drift += applied - torch.stack(deltas).mean(0)
    return drift, torch.stack([f.residual for f in feedback]).mean(0)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_owner_error_feedback_keeps_the_rounding_of_averages_from_adding_up(name):
    """What the applied averages lack against the exact means is, with the owner's rounding charged to its
    residual, exactly the members' mean residual at the end (Σ held = Σ mean(Δ + e_before − e_after), telescoping),
    so it does not grow with the rounds; without it every round's rounding of the averages adds up."""
    with_owner, residual = _sliced_rounds(name, owner_feedback=True)
    without, _ = _sliced_rounds(name, owner_feedback=False)
    torch.testing.assert_close(with_owner, -residual, rtol=0, atol=1e-5)
    one_round = _sliced_rounds(name, owner_feedback=False, rounds=1)[0].norm()
    assert float(with_owner.norm()) < 2 * float(one_round)  # bounded by about one round's rounding
    assert float(without.norm()) > 3 * float(with_owner.norm())  # 40 rounds of rounding, a random walk


def test_as_held_charges_the_rounding_to_the_owner_within_its_share_floor():
    part, exact, held = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    # weighted by the share, what the held average took of the owner's part: share·(part − x) = share·part − r
    torch.testing.assert_close(as_held(part, exact, held, 0.5, 4), part - (exact - held) / 0.5)
    # a small share is charged at most n times the rounding, a part left out nothing
    torch.testing.assert_close(as_held(part, exact, held, 0.01, 4), part - (exact - held) * 4)
    assert torch.equal(as_held(part, exact, held, 0.0, 4), part)
