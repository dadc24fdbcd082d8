"""A peer is light: guards for what keeps a peer's host memory small.

Each guard stands for tens of MB a peer, measured with `p2pdiloco.bench.proctree` on the benchmark model: the
inner AdamW without torch._dynamo (~70 MB in the peer, more in the DHT process whose pages it then stops
sharing), no torch_shm_manager process (~57 MB), and the objects made before the DHT process forks kept out of
the garbage collector (whose full collections would otherwise copy every page they share).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from p2pdiloco.training.optim import AdamW


def run_python(code: str, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter (this one has long imported everything) and return what it printed
    last, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_inner_adamw_steps_exactly_as_torchs():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    theirs.load_state_dict(ours.state_dict())
    kwargs = {"lr": 3e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    opt_ours, opt_theirs = AdamW(ours.parameters(), **kwargs), torch.optim.AdamW(theirs.parameters(), **kwargs)
    for _ in range(5):
        x = torch.randn(4, 16)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(opt_ours.state_dict()["state"], opt_theirs.state_dict()["state"], rtol=0, atol=0)
    assert isinstance(opt_ours, torch.optim.AdamW)  # checkpoints keep torch AdamW's flat layout


def test_inner_optimizer_runs_without_importing_torch_dynamo():
    code = """
import json, sys, torch
from p2pdiloco.config import InnerOptConfig
from p2pdiloco.training.optim import build_inner_optimizer
model = torch.nn.Linear(4, 4)
opt = build_inner_optimizer(model.parameters(), InnerOptConfig(), torch.device("cpu"))
hooked = []
opt.register_step_post_hook(lambda *_: hooked.append(1))
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
opt.load_state_dict(opt.state_dict())
print(json.dumps({"loaded": sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules), "hooks": len(hooked)}))
"""
    assert run_python(code) == {"loaded": [], "hooks": 2}


def test_methods_run_through_torch_dynamo_once_it_is_imported():
    """After run.compile (or anything else) imported torch._dynamo, torch's own wrapper decides again."""
    code = """
import json, torch
from p2pdiloco.training.optim import AdamW
opt = AdamW(torch.nn.Linear(2, 2).parameters())
import torch._dynamo
opt.zero_grad()
fn = torch.optim.Optimizer.zero_grad.__wrapped__
print(json.dumps({"wrapper": fn.__dynamo_disable.__module__}))
"""
    assert run_python(code)["wrapper"].startswith("torch._dynamo")


def test_the_dht_process_forks_light():
    """No torch_shm_manager beside the DHT, and the objects made before its fork are frozen."""
    code = """
import gc, json, psutil, torch
from p2pdiloco.config import SwarmConfig
from p2pdiloco.network.swarm import start_dht
dht = start_dht(SwarmConfig(host="127.0.0.1", port=0))
try:
    names = sorted(p.name() for p in psutil.Process().children(recursive=True))
    print(json.dumps({"children": names, "frozen": gc.get_freeze_count(),
                      "strategy": torch.multiprocessing.get_sharing_strategy()}))
finally:
    dht.shutdown()
"""
    got = run_python(code)
    assert "torch_shm_manager" not in got["children"] and "p2pd" in got["children"], got
    assert got["strategy"] == "file_descriptor"
    assert got["frozen"] > 10_000  # torch and hivemind's objects, at least
