"""The sparseloco codec's math: which values are kept and how, exact position coding, byte sizes, error feedback,
and the group reduction that every member computes alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pdiloco.algorithm.codecs import CodecError, NonFiniteError, get_codec
from p2pdiloco.algorithm.feedback import ErrorFeedback
from p2pdiloco.algorithm.guards import cosines_to
from p2pdiloco.algorithm.sparse import SparseCodec, rice_decode, rice_encode, rice_parameter
from p2pdiloco.algorithm.trust import trusted
from p2pdiloco.config import GuardConfig
from p2pdiloco.network.rpc import MergeFailed
from p2pdiloco.network.sparse_exchange import decode_part, reduce_parts


def test_keeps_the_top_k_of_each_chunk_with_their_signs_and_two_magnitudes():
    codec = SparseCodec(chunk=16, keep=4)
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, 0.3, -1.0, 0.05, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.4,
                      1.0, -2.0, 0.5])  # a chunk of 16, then one of 3 (keeps all 3)
    y = codec.decode(codec.encode(x), x.numel())
    kept = y != 0
    assert kept.nonzero().flatten().tolist() == [1, 3, 6, 8, 16, 17, 18]
    assert torch.equal(torch.sign(y[kept]), torch.sign(x[kept]))
    # chunk 0 kept |x| 5, 3, 2, 1: the upper half takes their mean 4, the lower half 1.5 (exact in bf16)
    assert y[:16][kept[:16]].abs().tolist() == [4.0, 4.0, 1.5, 1.5]
    # chunk 1 kept 1, 2, 0.5: the upper half is the largest alone (2), the lower the mean of 1 and 0.5
    assert y[16:].tolist() == [0.75, -2.0, 0.75]


def test_a_value_alone_in_its_chunk_or_half_keeps_its_magnitude():
    codec = SparseCodec(chunk=8, keep=1)
    y = codec.decode(codec.encode(torch.tensor([0.0, -0.25, 0.125, 0, 0, 0, 0, 0])), 8)
    assert y.tolist() == [0.0, -0.25, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("n", [1, 63, 64, 4096, 4097, 30_000, 100_003])
def test_positions_round_trip_exactly_and_size_is_within_its_bound(n):
    codec = SparseCodec()
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    data = codec.encode(x)
    assert len(data) <= codec.encoded_size(n)
    y = codec.decode(data, n)
    expected = torch.zeros(n, dtype=torch.bool)
    for start in range(0, n, codec.chunk):  # the top-k of each chunk, by magnitude
        chunk = x[start:start + codec.chunk].abs()
        expected[start + chunk.topk(min(codec.keep, chunk.numel())).indices] = True
    assert torch.equal(y != 0, expected)
    assert codec.encode(x.clone()) == data  # deterministic


def test_rice_coding_is_exact_for_any_gaps():
    rng = np.random.default_rng(0)
    for r in (0, 1, 5, 8):
        gaps = np.concatenate([rng.geometric(1 / 64, 500) - 1, [0, 0, 4031, 1]]).astype(np.int64)
        low, unary = rice_encode(gaps, r)
        assert len(low) == r * len(gaps) and len(unary) == int((gaps >> r).sum()) + len(gaps)
        assert np.array_equal(rice_decode(low, unary, len(gaps), r), gaps)
    with pytest.raises(CodecError):
        rice_decode(low, unary[:-1], len(gaps), 8)  # a truncated unary field
    assert rice_parameter(4096, 64) == 5


def test_bits_per_value_beat_raw_indices_and_the_paper():
    codec = SparseCodec()
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    bits = 8 * len(codec.encode(x)) / x.numel()
    raw = 64 / 4096 * (12 + 2) + 32 / 4096  # 12-bit indices, 2-bit values, the two bf16 scales
    assert bits < 0.9 * raw
    assert 32 / bits > 180  # SparseLoCo reports 146× with 12-bit indices


def test_malformed_bytes_are_refused_not_misread():
    codec = SparseCodec()
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    data = bytearray(codec.encode(x))
    for bad in (bytes(data[:-1]), bytes(data) + b"\x00", b"", b"\xff\xff\xff\xff" + bytes(data[4:])):
        with pytest.raises(CodecError):
            codec.decode(bad, 10_000)
    unary_start = len(data) - (int.from_bytes(data[:4], "little") + 7) // 8
    flipped = bytearray(data)
    flipped[unary_start:] = b"\x00" * (len(data) - unary_start)  # every gap 0 and too many of them
    with pytest.raises(CodecError):
        codec.decode(bytes(flipped), 10_000)
    nan = torch.randn(10_000)
    nan[7] = float("nan")
    with pytest.raises(NonFiniteError):
        codec.decode(codec.encode(nan), 10_000)


def test_error_feedback_accumulates_what_was_dropped_and_sends_it_later():
    codec = get_codec("sparseloco")
    signal = torch.randn(8192, generator=torch.Generator().manual_seed(2)) * 1e-2
    ef = ErrorFeedback(True)
    target = ef.compensate(signal)
    sent = codec.decode(codec.encode(target), signal.numel())
    ef.commit(target, sent)
    dropped = sent == 0
    assert torch.equal(ef.residual[dropped], signal[dropped])  # every dropped value is kept whole
    total, rounds = sent.clone(), 300
    for _ in range(rounds - 1):
        target = ef.compensate(signal)
        sent = codec.decode(codec.encode(target), signal.numel())
        ef.commit(target, sent)
        total += sent
    # without feedback the same 98 % of the signal would never be sent; with it the mean per round converges
    assert float((total / rounds - signal).norm() / signal.norm()) < 0.1
    assert float((sent - signal).norm() / signal.norm()) > 0.5


def test_group_reduction_screens_alike_for_every_member_and_leaves_out_bad_parts():
    codec = SparseCodec()
    g = torch.Generator().manual_seed(4)
    vecs = [torch.randn(9000, generator=g) for _ in range(3)]
    vecs[2] = vecs[2] * 100  # a norm far beyond the median's bound
    encoded = [codec.encode(v) for v in vecs] + [b"garbage"]
    decoded = [decode_part(codec, d, 9000) for d in encoded]
    assert decoded[3][1] == "shape" and decoded[0][1] == ""
    parts, flags = [d[0] for d in decoded], [d[1] for d in decoded]
    avg, reasons, shares = reduce_parts(parts, flags, [1.0, 3.0, 1.0, 1.0], GuardConfig())
    assert reasons == ["", "", "norm", "shape"] and shares == [0.25, 0.75, 0.0, 0.0]
    torch.testing.assert_close(avg, 0.25 * parts[0] + 0.75 * parts[1])
    with pytest.raises(MergeFailed):
        reduce_parts(parts, flags, [1.0] * 4, None)  # no guards: a bad part fails the merge


def test_two_members_are_judged_from_the_smaller_part_by_both():
    small, large = torch.ones(100), torch.ones(100) * 10
    for order in ([small, large], [large, small]):
        _, reasons, _ = reduce_parts(order, ["", ""], [1.0, 1.0], GuardConfig(norm_bound=4.0))
        assert reasons == ["" if p is small else "norm" for p in order]


def _sparse_swarm(n: int = 40_000, honest: int = 3, seed: int = 6):
    """(the momentum, honest members' decoded sparse parts, each pointing partly along it, a sign-flipped one,
    a same-norm noise one)."""
    codec, g = SparseCodec(), torch.Generator().manual_seed(seed)
    momentum = torch.randn(n, generator=g)
    deltas = [0.3 * momentum + torch.randn(n, generator=g) for _ in range(honest)]
    noise = torch.randn(n, generator=g) * (deltas[0].norm() / n ** 0.5)
    coded = [codec.decode(codec.encode(d), n) for d in [*deltas, -deltas[0], noise]]
    return momentum, coded[:honest], coded[honest], coded[honest + 1]


def test_trust_screen_leaves_out_sign_flipped_and_noise_parts_for_every_member_alike():
    momentum, honest, flipped, noise = _sparse_swarm()
    parts = [flipped, honest[0], noise, honest[1], flipped.clone(), honest[2]]
    reasons = trusted(parts, [""] * 6, momentum)
    assert reasons == ["trust", "", "trust", "", "trust", ""]
    avg, reasons, shares = reduce_parts(parts, [""] * 6, [1.0] * 6, GuardConfig(), momentum)
    assert reasons == ["trust", "", "trust", "", "trust", ""] and shares == [0.0, 1 / 3, 0.0, 1 / 3, 0.0, 1 / 3]
    torch.testing.assert_close(avg, (honest[0] + honest[1] + honest[2]) / 3)
    # the same decision from a momentum that differs slightly (members of a fork that this merge's agreement
    # mends): all or nothing, so they still average the same parts
    nudged = momentum + 1e-3 * torch.randn(momentum.numel(), generator=torch.Generator().manual_seed(1))
    assert trusted(parts, [""] * 6, nudged) == reasons
    # trust_decay -1 turns the screen off, as for the default codec
    _, off, _ = reduce_parts(parts, [""] * 6, [1.0] * 6, GuardConfig(trust_decay=-1), momentum)
    assert off == [""] * 6


def test_trust_screen_stands_aside_without_a_momentum_or_against_a_majority():
    momentum, honest, flipped, _ = _sparse_swarm()
    parts = [honest[0], honest[1], flipped]
    assert trusted(parts, ["", "", ""], None) == ["", "", ""]
    # a majority points against the momentum: it is the momentum that is wrong (guards.trust_factors)
    assert trusted(parts, ["", "", ""], -momentum) == ["", "", ""]
    # parts left out for another reason keep it and are not part of the median
    assert trusted(parts, ["norm", "", ""], momentum) == ["norm", "", "trust"]


def test_without_a_momentum_a_part_few_others_point_with_is_left_out():
    """The run's first merge (momentum all zeros): its average becomes the reference of every later merge, so
    sign-flipped parts must not make it; a part counts if as many others point with it as the upper median."""
    momentum, honest, flipped, _ = _sparse_swarm()
    zeros = torch.zeros_like(momentum)
    parts = [flipped, honest[0], honest[1], flipped.clone(), honest[2]]
    assert trusted(parts, [""] * 5, zeros) == ["trust", "", "", "trust", ""]
    assert trusted(honest, [""] * 3, zeros) == ["", "", ""]  # honest parts all point alike
    assert trusted([honest[0], flipped], ["", ""], zeros) == ["", ""]  # two: nothing to tell them apart by
    assert trusted([honest[0], honest[1], flipped], ["", "", "norm"], zeros) == ["", "", "norm"]


def test_a_momentum_no_better_than_chance_keeps_only_its_sign_and_a_fork_is_judged_by_support():
    momentum, honest, flipped, _ = _sparse_swarm()
    parts = [flipped, honest[0], honest[1], flipped.clone(), honest[2]]
    n = momentum.numel()
    # a reference orthogonal to every part, nudged toward the honest ones: their cosines are positive, below 1/√n
    used = torch.stack(parts).abs().sum(0) > 0
    blind = torch.randn(n, generator=torch.Generator().manual_seed(7)).masked_fill(used, 0.0)
    toward = sum(honest) / len(honest)
    reference = blind + toward * (0.5 / n ** 0.5) * float(blind.norm() / toward.norm())
    cosines = cosines_to(parts, reference)
    assert all(0 < cosines[i] < n ** -0.5 for i in (1, 2, 4)) and cosines[0] < 0
    # the floor 1/√n used to leave out every part here (the merge failed for all); now only those pointing against
    assert trusted(parts, [""] * 5, reference) == ["trust", "", "", "trust", ""]
    # members of a fork hold different momenta; whatever each holds (here one against the majority, which alone
    # would leave nothing out), they decide by the parts alike
    for held in (momentum, -momentum, momentum + 1e-2 * torch.randn(n, generator=torch.Generator().manual_seed(2))):
        assert trusted(parts, [""] * 5, held, forked=True) == ["trust", "", "", "trust", ""]
    avg, reasons, _ = reduce_parts(parts, [""] * 5, [1.0] * 5, GuardConfig(), -momentum, forked=True)
    assert reasons == ["trust", "", "", "trust", ""]
    torch.testing.assert_close(avg, (honest[0] + honest[1] + honest[2]) / 3)


def test_decayed_error_feedback_scales_the_residual_before_adding_it():
    ef = ErrorFeedback(True, decay=0.5)
    ef.commit(torch.full((4,), 2.0), torch.zeros(4))
    assert torch.equal(ef.compensate(torch.ones(4)), torch.full((4,), 2.0))  # 1 + 0.5 × 2
