"""The exact difference codec (algorithm/exact_delta.py) and the catch-up fetch that uses it (network/catch_up.py):
lossless on every bit pattern, smaller than fp32 where the two states are close, and a payload that is not what the
fetcher asked for is refused, its holder struck."""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch

from p2pdiloco.algorithm.codecs import CodecError
from p2pdiloco.algorithm.exact_delta import decode_exact_delta, encode_exact_delta
from p2pdiloco.algorithm.guards import FORGED, GuardBook
from p2pdiloco.algorithm.outer import state_digest
from p2pdiloco.network.catch_up import CatchUp
from p2pdiloco.network.group import Group
from p2pdiloco.network.rpc import MergeFailed
from p2pdiloco.network.session import MergeSession

N = 10_000


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _close_pair(seed: int, rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=gen)
    return base, base * (1 + rel * torch.randn(N, generator=gen))


def test_every_bit_pattern_comes_back_exactly():
    """NaNs (with their payloads), infinities, -0.0, subnormals, sign changes and unrelated values: the decoded
    vector has the target's bits, whatever the base."""
    base, target = _close_pair(0, 1e-3)
    target[:8] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-42, -1e-42, 3e38, -3e38])
    target[8:12] = -base[8:12]
    target[12] = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)[0]  # a NaN with a payload
    for b in (base, torch.zeros(N), -target, torch.full((N,), float("nan"))):
        assert torch.equal(_bits(decode_exact_delta(encode_exact_delta(target, b), b)), _bits(target))


def test_close_states_cost_well_under_fp32_and_a_state_its_own_base_almost_nothing():
    base, target = _close_pair(1, 1e-4)
    assert len(encode_exact_delta(target, base)) < 0.6 * 4 * N
    assert len(encode_exact_delta(base, base)) < 0.01 * 4 * N
    assert len(encode_exact_delta(target, torch.zeros(N))) < 1.01 * 4 * N + 100  # no base: about fp32, never much more


@pytest.mark.parametrize("forged", ["larger than fp32", "not deflate", "short", "long", "trailing", "bomb"])
def test_a_forged_payload_is_refused(forged):
    """Each payload no honest encoder makes raises CodecError, and decoding never inflates past 4 bytes a value."""
    base, target = _close_pair(2, 1e-3)
    good = encode_exact_delta(target, base)
    payload = {
        "larger than fp32": b"\0" * (4 * N + 1),
        "not deflate": b"this is not a deflate stream",
        "short": zlib.compress(b"\0" * (4 * N - 4)),
        "long": zlib.compress(b"\0" * (4 * N + 4)),
        "trailing": good + b"\0",
        "bomb": zlib.compress(b"\0" * (400 * N), 9),
    }[forged]
    with pytest.raises(CodecError):
        decode_exact_delta(payload, base)


def test_mismatched_lengths_and_dtypes_are_refused():
    with pytest.raises(ValueError):
        encode_exact_delta(torch.zeros(N), torch.zeros(N + 1))
    with pytest.raises(ValueError):
        encode_exact_delta(torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64))


# ---- the fetcher's side of a catch-up: what it does with what a holder serves ----

class _Holder:
    """An rpc whose 'catchup' reply is fixed: what the test makes the holder serve."""

    def __init__(self, reply: dict, payload: bytes):
        self.reply, self.payload, self.asked = reply, payload, []

    async def call(self, peer, op, header, payload=b"", max_reply=0, phase=None):
        self.asked.append(header)
        return self.reply, self.payload


def _fetch(reply: dict, payload: bytes, anchors: dict[str, torch.Tensor], majority: torch.Tensor,
           book: GuardBook | None = None):
    """The fetcher (member 1, outside a majority of 2) asks holder 0 and gets `reply`, `payload`."""
    n = majority.numel()
    digest = state_digest(majority[: n // 2], majority[n // 2:])
    group = Group("g", ["h0", "f", "h1"], [1.0] * 3, [1.0] * 3, True, {"s": n}, digests=[digest, "other", digest])
    holder, book = _Holder(reply, payload), book or GuardBook(0, "f")

    async def find_session(gid: str) -> MergeSession:
        raise AssertionError("a fetcher serves nothing")

    async def main() -> torch.Tensor:
        return await CatchUp(holder, find_session, 2.0, book).agree(MergeSession(group, 1, 0), torch.zeros(n), anchors)

    return asyncio.run(main()), holder.asked, book


@pytest.mark.parametrize("served", ["from an anchor", "from zeros", "fp32"])
def test_a_fetcher_rebuilds_the_majoritys_model_from_what_a_holder_serves(served):
    """From its difference to an anchor the fetcher offered, from zeros (no anchor in common), or fp32 (what a holder
    of the version before serves, whatever the fetcher offered)."""
    anchor, majority = _close_pair(3, 1e-3)
    reply, payload = {
        "from an anchor": ({"ok": True, "base": "A"}, encode_exact_delta(majority, anchor)),
        "from zeros": ({"ok": True, "base": ""}, encode_exact_delta(majority, torch.zeros(N))),
        "fp32": ({"ok": True}, majority.numpy().tobytes()),
    }[served]
    (state, shares), asked, book = _fetch(reply, payload, {"A": anchor, "B": torch.ones(N)}, majority)
    assert torch.equal(_bits(state), _bits(majority)) and shares == [0.0] * 3
    assert asked[0]["anchors"] == ["A", "B"] and not book.strikes  # newest first, as it holds them


@pytest.mark.parametrize("forged", ["another model", "a base not offered", "undecodable", "fp32 of another length"])
def test_a_fetcher_refuses_what_is_not_the_majoritys_model_and_strikes_its_holder(forged):
    anchor, majority = _close_pair(4, 1e-3)
    reply, payload = {
        "another model": ({"ok": True, "base": "A"}, encode_exact_delta(-majority, anchor)),
        "a base not offered": ({"ok": True, "base": "Z"}, encode_exact_delta(majority, anchor)),
        "undecodable": ({"ok": True, "base": ""}, b"garbage"),
        "fp32 of another length": ({"ok": True}, majority[:-1].numpy().tobytes()),
    }[forged]
    book = GuardBook(0, "f")
    with pytest.raises(MergeFailed, match="served"):
        _fetch(reply, payload, {"A": anchor}, majority, book)
    if forged == "fp32 of another length":  # a short or long fp32 copy is a failed fetch, not a strike
        assert not book.strikes
    else:
        assert book.rejected[FORGED] == 1 and book.strikes == {"h0": 1}
