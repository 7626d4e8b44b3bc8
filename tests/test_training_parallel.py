"""Expert parallelism and row-owner Engram on 2 CPU ranks (gloo) against single-process references.

Each pytest case launches this file under ``torchrun --nproc_per_node 2``; the worker half below runs the
case on both ranks and exits non-zero on any mismatch.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script: Path, *args, timeout=180, nproc=2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result.stdout


@pytest.mark.parametrize("routing", ["random", "all_to_rank0"])
def test_expert_parallel_matches_local(routing):
    assert "EP OK" in run_torchrun(Path(__file__), "ep", routing)


def test_row_owner_engram_matches_single_table():
    assert "ENGRAM OK" in run_torchrun(Path(__file__), "engram")


# ----------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)
# ----------------------------------------------------------------------------------------------------


def _ep_case(routing: str):
    import copy

    import torch
    import torch.distributed as dist

    from deepseek_v41.moe import RoutedExperts
    from deepseek_v41.training.expert_parallel import AllToAllDispatcher, shard_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SimpleNamespace(n_routed_experts=4, hidden_size=8, moe_intermediate_size=16, swiglu_limit=10.0)
    torch.manual_seed(0)  # identical data and weights on both ranks
    full = RoutedExperts(cfg, {"experts": "torch_mm"}).float()
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.3)
    n, k = 6, 2
    x_all = torch.randn(world * n, 8)
    if routing == "random":
        ids_all = torch.stack([torch.randperm(4)[:k] for _ in range(world * n)])
    else:  # every token of every rank goes to rank 0's experts: rank 1 receives nothing
        ids_all = torch.tensor([[0, 1]] * (world * n))
    w_all = torch.rand(world * n, k)
    g_all = torch.randn(world * n, 8)

    # single-process reference over every rank's tokens
    ref = copy.deepcopy(full)
    x_ref, w_ref = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    out_ref = ref(x_ref, ids_all, w_ref)
    (out_ref * g_all).sum().backward()

    # EP=2: this rank's tokens, this rank's experts
    ep = copy.deepcopy(full)
    shard_experts(ep, rank, world)
    ep.dispatcher = AllToAllDispatcher(dist.group.WORLD)
    rows = slice(rank * n, (rank + 1) * n)
    x, w = x_all[rows].clone().requires_grad_(), w_all[rows].clone().requires_grad_()
    out = ep(x, ids_all[rows], w)
    (out * g_all[rows]).sum().backward()

    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, out_ref[rows], **tol)
    torch.testing.assert_close(x.grad, x_ref.grad[rows], **tol)
    torch.testing.assert_close(w.grad, w_ref.grad[rows], **tol)
    e_local = 4 // world
    assert ep.expert_offset == rank * e_local and ep.w1.shape[0] == e_local
    for name in ("w1", "w2", "w3"):
        # an expert's gradient = the sum over both ranks' tokens routed to it
        torch.testing.assert_close(getattr(ep, name).grad, getattr(ref, name).grad[rank * e_local:(rank + 1) * e_local], **tol)
    print("EP OK", flush=True)


def _engram_case():
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    from deepseek_v41.training.engram_owner import apply_row_owner_engram
    from deepseek_v41.training.loop import average_summed_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    rows, d = 37, 4  # local = ceil(37 / 2) = 19: rank 1 holds rows 19..36 and one zero padding row
    torch.manual_seed(0)
    table = torch.randn(rows, d)
    ids_all = torch.randint(0, rows, (world, 2, 5, 3))
    ids_all[1, 0, 0, 0] = rows - 1  # the last real row is used
    g_all = torch.randn(world, 2, 5, 3, d)

    # single process: one table, the global-batch mean loss (sum over all tokens / token count)
    ref = table.clone().requires_grad_()
    (F.embedding(ids_all, ref) * g_all).sum().div(ids_all.numel()).backward()

    class FakeEngram(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(rows, d)
            self.table_lookup = None

    model = nn.Module()
    model.engram = FakeEngram()
    model.engram.embed.weight.data.copy_(table)
    tables = apply_row_owner_engram(model, dist.group.WORLD)
    local = -(-rows // world)
    block = model.engram.embed.weight
    assert block.shape == (local, d)
    start, stop = rank * local, min(rows, (rank + 1) * local)
    torch.testing.assert_close(block[: stop - start].detach(), table[start:stop], rtol=0, atol=0)
    assert torch.all(block[stop - start:] == 0)

    found = model.engram.table_lookup(ids_all[rank])
    torch.testing.assert_close(found, F.embedding(ids_all[rank], table), rtol=0, atol=0)
    # the trainer's per-rank loss: local sum * W / global count (FSDP averages over ranks)
    (found * g_all[rank]).sum().mul(world / ids_all.numel()).backward()
    average_summed_gradients([], tables, world)  # the owner divisor, applied once
    torch.testing.assert_close(block.grad[: stop - start], ref.grad[start:stop], rtol=1e-6, atol=1e-7)
    assert torch.all(block.grad[stop - start:] == 0)
    print("ENGRAM OK", flush=True)


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        case = sys.argv[1]
        if case == "ep":
            _ep_case(sys.argv[2])
        elif case == "engram":
            _engram_case()
        else:
            raise SystemExit(f"unknown case {case}")
    finally:
        dist.destroy_process_group()
