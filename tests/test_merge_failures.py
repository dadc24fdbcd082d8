"""A member that gives up a merge over one owner's answer still serves the slice it owns, so its mates merge without
it (allreduce.py, `AllReduce._serve_out`); real mergers on loopback DHTs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2pdiloco.config import GuardConfig
from p2pdiloco.network.merger import Contribution
from p2pdiloco.network.rpc import MergeFailed
from tests.conftest import flat, merge_config, running_mergers

pytestmark = pytest.mark.integration

N = 3001


def _offer(delta: torch.Tensor) -> Contribution:
    return Contribution(pseudo_grad=delta, weight=1.0, global_params=torch.zeros(N), momentum=torch.zeros(N),
                        state_digest="same", state_weight=1.0)


def test_a_member_refusing_one_owners_average_leaves_its_mates_merging(bootstrap_dht, net_loop):
    cfg = merge_config(run_id="refuser", merge_window_s=3, merge_timeout_s=8, codec="none", sync=True)
    with running_mergers(bootstrap_dht, net_loop, 3, cfg, N, guard=GuardConfig(aggregate="mean")) as mergers:
        refuser, owner, late = mergers
        refused = net_loop.run(_event(), 5)
        accept = refuser.allreduce.reducer.accept

        def refuse_one_owner(group, index, averaged, mine):
            if group.members[index] == owner.peer_id:
                refused.set()
                raise MergeFailed(f"member {owner.peer_id[-6:]} returned a bad average (norm)")
            accept(group, index, averaged, mine)

        refuser.allreduce.reducer.accept = refuse_one_owner
        call = late.allreduce.rpc.call

        async def part_after_the_refusal(peer, op, header, *args, **kwargs):
            if op == "part" and peer == refuser.peer_id:  # its part reaches the refuser only once it refused
                await asyncio.wait_for(refused.wait(), 20)
            return await call(peer, op, header, *args, **kwargs)

        late.allreduce.rpc.call = part_after_the_refusal
        vecs = [torch.full((N,), float(i + 1)) for i in range(3)]
        futures = [m.submit(_offer(v)) for m, v in zip(mergers, vecs, strict=True)]
        results = [flat(f.result(timeout=60)) for f in futures]
    assert refused.is_set()
    assert results[0].alone and "bad average" in results[0].failure  # the refuser merges alone
    for r in results[1:]:  # its mates got its slice's average, and merged together
        assert r.failure == "" and not r.alone and len(r.group) == 3, r.failure
        assert torch.allclose(r.pseudo_grad, torch.full((N,), 2.0))
    assert torch.equal(results[1].pseudo_grad, results[2].pseudo_grad)


async def _event() -> asyncio.Event:
    return asyncio.Event()
