"""Worker of the distributed tests: one spawned job per rank runs every configuration.

``run(rank, world, outdir, configs, backend)`` initializes a process group (rendezvous through
``{outdir}/rendezvous``: a file, so no TCP port can be taken between choosing and binding it),
trains ``TinyGPT`` with HybridAdam (data parallel or FSDP2) for each configuration and writes
``{outdir}/{name}.rank{rank}.pt`` (losses, params, state sizes, or the error with its rank).
Each rank trains on its half of the global batch that the single-process reference uses.
A rank's stderr (with faulthandler's traceback of a fatal signal) goes to
``{outdir}/stderr.rank{rank}.txt``; ``{outdir}/done.rank{rank}`` marks a rank that destroyed its
process group after its last configuration.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from models import TinyGPT, make_batch  # noqa: E402

from tiermem.optim import HybridAdam  # noqa: E402

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 20
GLOBAL_BATCH = 4


def param_groups(model):
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]


def make_model(kind: str, device: torch.device, **kw):
    torch.manual_seed(0)
    model = TinyGPT(**kw).to(device)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


SCALES = {  # regime -> loss scale per step (sets the norm: tests/distributed/test_dp_speculate.py)
    "never": lambda s: 1e-2, "always": lambda s: 1.0,
    "alternate": lambda s: 10.0 if s % 2 else 1e-2,
    "nonfinite": lambda s: {2: 1e30, 7: float("nan")}.get(s, 1e-2)}


def train(model, opt, rank, world, device, steps=STEPS, accum=1, regime=None, spec=None):
    """Train; return the global losses (mean over ranks, as the single-process run sees them).
    ``regime``: a loss scale per step (``SCALES``); ``spec``: a list that gets each step's
    (speculated, rolled-back) chunk counts."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro, batch=GLOBAL_BATCH)
            mine = slice(rank * per, (rank + 1) * per)
            _, loss = model(idx[mine].to(device), tgt[mine].to(device))
            if regime is not None:
                loss = loss * SCALES[regime](step)
            (loss / accum).backward()
            value = loss.detach().clone()
            dist.all_reduce(value)
            total += value.item() / world / accum
        opt.step()
        if spec is not None:
            st = opt.step_stats()
            spec.append((st.get("speculated_chunks", 0), st.get("rolled_back_chunks", 0)))
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(total)
    return losses


def full_params(model):
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().clone()
    return out


def run_config(rank, world, outdir, cfg, device):
    kind = cfg["kind"]
    if kind == "errors":
        return run_errors(rank, world, outdir, device)
    model = make_model(kind, device)
    spill = os.path.join(outdir, f"spill-{cfg['name']}")
    os.makedirs(spill, exist_ok=True)
    opt = HybridAdam(param_groups(model), **HP, offload_fraction=cfg["fraction"],
                     state_tier=cfg["tier"], nvme_dir=spill, chunk_numel=1024,
                     data_parallel=kind == "dp" or None, bucket_numel=2048,
                     max_grad_norm=cfg.get("clip"), grad_accumulation_steps=cfg.get("accum", 1),
                     overlap=cfg.get("overlap", True), gpu_step_fraction=cfg.get("gpu", 0.0),
                     rollback_bytes=cfg.get("rollback", 0))
    res = {"numel": opt.state_numel(), "memory": opt.memory_bytes(),
           "total": sum(p.numel() for p in model.parameters())}
    res["spec"] = []
    res["losses"] = train(model, opt, rank, world, device, steps=cfg.get("steps", STEPS),
                          accum=cfg.get("accum", 1), regime=cfg.get("regime"), spec=res["spec"])
    res["params"] = full_params(model)
    if "rollback" in cfg:  # the whole state, bit for bit (state_dict: collective)
        res["state"] = {(i, k): t.detach().cpu().clone()
                        for i, st in opt.state_dict()["state"].items()
                        for k, t in st.items() if isinstance(t, torch.Tensor)}
    res["spill_dirs"] = sorted(os.listdir(spill))
    if cfg.get("state"):
        res.update(check_state(rank, world, outdir, cfg, model, opt, device))
    opt.close()
    return res


def check_state(rank, world, outdir, cfg, model, opt, device):
    """Save the state (DP: gathered full tensors; FSDP2: DTensors via DCP), load it into an
    optimizer with another offload fraction and tier, and compare."""
    import torch.distributed.checkpoint as dcp
    sd = opt.state_dict()
    opt.close()  # its params are free for another HybridAdam (Note [one optimizer per param])
    out = {}
    other = HybridAdam(param_groups(model), **HP, offload_fraction=1.0 - cfg["fraction"] / 2,
                       state_tier="nvme", nvme_dir=os.path.join(outdir, "spill-load"),
                       chunk_numel=1024, data_parallel=cfg["kind"] == "dp" or None)
    os.makedirs(os.path.join(outdir, "spill-load"), exist_ok=True)
    if cfg["kind"] == "dp":
        if rank == 0:
            torch.save(sd, os.path.join(outdir, "dp_state.pt"))
        other.load_state_dict(sd)
    else:
        from torch.distributed.tensor import DTensor
        out["dtensor_state"] = all(isinstance(st[k], DTensor) for st in sd["state"].values()
                                   for k in ("exp_avg", "exp_avg_sq"))
        dcp.save({"optim": sd}, checkpoint_id=os.path.join(outdir, "dcp"))
        template = {"optim": other.state_dict()}
        dcp.load(template, checkpoint_id=os.path.join(outdir, "dcp"))
        other.load_state_dict(template["optim"])
    again = other.state_dict()
    same = True
    for sid, st in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = st[k], again["state"][sid][k]
            if hasattr(a, "to_local"):
                a, b = a.to_local(), b.to_local()
            same &= torch.equal(a, b)
        same &= float(st["step"]) == float(again["state"][sid]["step"])
    out["state_roundtrip"] = bool(same)
    other.close()
    return out


def run_errors(rank, world, outdir, device):
    """Errors name the rank; ranks that pass different models are refused."""
    out = {}
    model = make_model("dp", device)
    opt = HybridAdam(model.parameters(), **HP, data_parallel=True, grad_accumulation_steps=1,
                     overlap=False, chunk_numel=1024)
    for seed in range(2):
        idx, tgt = make_batch(seed)
        model(idx.to(device), tgt.to(device))[1].backward()
    try:
        opt.step()
    except RuntimeError as exc:
        out["accum_error"] = str(exc)
    opt.close()
    # a CPU step failing on rank 1 only: rank 1 reports it, rank 0 does not hang
    opt = HybridAdam(model.parameters(), **HP, data_parallel=True, offload_fraction=1.0,
                     chunk_numel=1024)
    if rank == 1:
        def fail(*args):
            raise OSError("disk gone")
        opt._worker._step_chunk = fail
    idx, tgt = make_batch(0)
    model(idx.to(device), tgt.to(device))[1].backward()
    try:
        opt.step()
    except RuntimeError as exc:
        out["step_error"] = str(exc)
    opt.close()
    other = make_model("dp", device, n_layers=2 + rank)
    try:
        HybridAdam(other.parameters(), data_parallel=True).close()
    except ValueError as exc:
        out["mismatch_error"] = str(exc)
    return out


def run(rank, world, outdir, configs, backend="gloo"):
    err = open(os.path.join(outdir, f"stderr.rank{rank}.txt"), "w")
    os.dup2(err.fileno(), 2)  # C++ aborts (std::terminate) print to fd 2: keep them for the test
    faulthandler.enable(err)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        for cfg in configs:
            try:
                res = run_config(rank, world, outdir, cfg, device)
            except Exception:
                res = {"error": f"rank {rank}: {traceback.format_exc()}"}
            torch.save(res, os.path.join(outdir, f"{cfg['name']}.rank{rank}.pt"))
    finally:
        # Gloo (torch 2.13, CPU) aborts some ranks at interpreter exit after collectives,
        # tiermem or not: a job of two plain all_reduces then destroy_process_group aborted in
        # 8 of 45 runs, none without collectives (0 of 40); a barrier first: 1 of 45
        dist.barrier()
        dist.destroy_process_group()
    open(os.path.join(outdir, f"done.rank{rank}"), "w").close()
