"""HybridAdam on torch.distributed (gloo, 2 processes): ZeRO-style data parallel and FSDP2.

One spawned 2-rank job per backend runs every configuration (module-scoped fixture); each
test checks one configuration against single-process ``torch.optim.AdamW(fused=True)`` on the
same global batch (each rank gets half of it).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _dist_worker as worker  # noqa: E402
from models import TinyGPT, make_batch  # noqa: E402

from tiermem.optim import HybridAdam  # noqa: E402
from tiermem.optim.distributed import plan_buckets, shard_bounds, shard_segments  # noqa: E402

WORLD = 2
TOL = dict(rtol=1e-6, atol=1e-6)
FRACTIONS = [0.0, 0.5, 1.0]
TIERS = ["cpu", "nvme"]


def configs():
    out = [dict(name=f"{kind}-{tier}-{f}", kind=kind, tier=tier, fraction=f)
           for kind in ("dp", "fsdp") for tier in TIERS for f in FRACTIONS]
    out += [dict(name="dp-clip-accum", kind="dp", tier="cpu", fraction=0.5, clip=0.05, accum=2),
            dict(name="dp-no-overlap", kind="dp", tier="cpu", fraction=0.5, overlap=False),
            dict(name="fsdp-clip", kind="fsdp", tier="cpu", fraction=0.5, clip=0.05),
            dict(name="dp-lane", kind="dp", tier="cpu", fraction=1.0, gpu=0.5),
            dict(name="fsdp-lane", kind="fsdp", tier="nvme", fraction=1.0, gpu=0.5),
            dict(name="dp-state", kind="dp", tier="cpu", fraction=0.5, state=True),
            dict(name="fsdp-state", kind="fsdp", tier="cpu", fraction=0.5, state=True),
            dict(name="errors", kind="errors")]
    for c in out:
        c["ref"] = (c.get("clip"), c.get("accum", 1))
    return out


def spawn_job(outdir, cfgs, backend="gloo", timeout=600.0):
    """Run the worker on WORLD ranks; return {name: [result of rank 0, rank 1]}.

    ``timeout`` only catches a job that never ends (a rank's collective already gives up after
    90 s): on a 2-core box shared with xdist's other worker or other jobs, this gloo job ran
    past the former 240 s (it had reached its fsdp-nvme configs) without hanging.

    Raises:
        RuntimeError: a rank died before it finished (the message holds every rank's stderr).
        TimeoutError: the job ran past ``timeout`` seconds.
    """
    ctx = mp.start_processes(worker.run, args=(WORLD, str(outdir), cfgs, backend),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed job did not finish within {timeout} s")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        logs = "\n".join(f"--- rank {r} stderr:\n{read_tail(outdir / f'stderr.rank{r}.txt')}"
                         for r in range(WORLD))
        if not all((outdir / f"done.rank{r}").exists() for r in range(WORLD)):
            raise RuntimeError(f"{exc}\n{logs}") from exc
        # every rank saved every result and destroyed its process group: the crash came at
        # interpreter exit, after anything the tests check (gloo's teardown: see the comment
        # at the end of _dist_worker.run); say so loudly, check the results
        warnings.warn(f"a rank crashed at exit after finishing: {exc}\n{logs}")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()  # only the ranks this test started
    results = {}
    for c in cfgs:
        results[c["name"]] = []
        for r in range(WORLD):
            path = os.path.join(outdir, f"{c['name']}.rank{r}.pt")
            results[c["name"]].append(torch.load(path, weights_only=False)
                                      if os.path.exists(path) else {"error": f"rank {r}: no result"})
    return results


def read_tail(path, nbytes=4000):
    """The last ``nbytes`` of a rank's log (or a note that it wrote none)."""
    if not path.exists():
        return "(no log)"
    return path.read_text(errors="replace")[-nbytes:]


def reference(clip=None, accum=1, device="cpu", steps=worker.STEPS, split=WORLD):
    """Single-process torch fused AdamW on the global batch: (losses, params, optimizer).

    ``split``: the global batch's gradient is accumulated from ``split`` equal parts, each
    loss scaled by ``1/split`` -- the mean over the global batch, summed in the order
    data parallelism sums it: each part accumulates its micro-batches on its own (as a rank
    does before the reduce), then the parts are added in rank order. (With ``split=1`` the
    attention's key bias, whose gradient is exactly zero in exact arithmetic, gets rounding
    noise that Adam normalises into different +-lr updates for every summation order: no
    distributed run can match those elements to 1e-6.)
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: the same kernels' blocking
    try:
        torch.manual_seed(0)
        model = TinyGPT().to(device)
        opt = torch.optim.AdamW(worker.param_groups(model), **worker.HP, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        per = worker.GLOBAL_BATCH // split
        losses = []
        for step in range(steps):
            total, part_grads = 0.0, []
            for part in range(split):
                mine = slice(part * per, (part + 1) * per)
                for micro in range(accum):
                    idx, tgt = make_batch(step * accum + micro, batch=worker.GLOBAL_BATCH)
                    _, loss = model(idx[mine].to(device), tgt[mine].to(device))
                    (loss / (accum * split)).backward()
                    total += loss.item() / (accum * split)
                part_grads.append([p.grad for p in model.parameters()])
                model.zero_grad(set_to_none=True)
            for p, *grads in zip(model.parameters(), *part_grads):
                p.grad = grads[0]
                for g in grads[1:]:
                    p.grad = p.grad + g  # rank order, like the reduce
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(total)
    finally:
        torch.set_num_threads(threads)
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}, opt


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    results = spawn_job(outdir, configs())
    print(f"distributed job: {time.monotonic() - t0:.1f} s")
    refs = {key: reference(*key) for key in {c["ref"] for c in configs()}}
    refs["full-batch"] = reference(split=1)
    return outdir, results, refs


def ok(results, name):
    for r, res in enumerate(results[name]):
        assert "error" not in res, res["error"]
    return results[name]


def key_bias(name: str, t: torch.Tensor) -> slice | None:
    """The key part of a fused QKV bias: its gradient is zero in exact arithmetic (softmax is
    invariant to the per-query constant q.b_k), so in floats it is rounding noise that Adam
    normalises; it only matches another run to 1e-6 when every gradient bit matches."""
    if name.endswith("attn.qkv.bias"):
        d = t.numel() // 3
        return slice(d, 2 * d)
    return None


def assert_parity(res, ref, tol=TOL, noise_atol=None):
    """Losses and params of every rank match the reference within ``tol``; with
    ``noise_atol`` the key biases (see :func:`key_bias`) within that instead."""
    ref_losses, ref_params, _ = ref
    for r in res:
        assert r["losses"] == pytest.approx(ref_losses, rel=tol["rtol"], abs=tol["atol"])
        for name, p in ref_params.items():
            got, want = r["params"][name].clone(), p.clone()
            kb = key_bias(name, p) if noise_atol is not None else None
            if kb is not None:
                torch.testing.assert_close(got[kb], want[kb], rtol=0, atol=noise_atol,
                                           msg=lambda m, name=name: f"{name}: {m}")
                got[kb] = want[kb] = 0
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_data_parallel_matches_single_process_adamw(job, tier, fraction):
    outdir, results, refs = job
    res = ok(results, f"dp-{tier}-{fraction}")
    assert_parity(res, refs[(None, 1)])
    for r in res:  # and the losses of one backward over the whole global batch
        assert r["losses"] == pytest.approx(refs["full-batch"][0], rel=1e-6, abs=1e-6)
    total = res[0]["total"]
    held = [r["numel"]["gpu"] + r["numel"]["offloaded"] for r in res]
    assert sum(held) == total and max(held) == -(-total // WORLD)  # 1/world each
    for r in res:  # the fraction applies within the shard
        assert abs(r["numel"]["offloaded"] - fraction * sum(r["numel"].values())) <= 1
        assert r["memory"]["gpu"] == 8 * r["numel"]["gpu"]  # fp32 params: 2 moments, no master
    if tier == "nvme":
        assert res[0]["spill_dirs"] == ["rank0", "rank1"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_fsdp2_matches_single_process_adamw(job, tier, fraction):
    outdir, results, refs = job
    res = ok(results, f"fsdp-{tier}-{fraction}")
    assert_parity(res, refs[(None, 1)])
    total = res[0]["total"]
    held = [r["numel"]["gpu"] + r["numel"]["offloaded"] for r in res]
    assert sum(held) == total and max(held) <= total // WORLD + 200  # row-wise shards
    if tier == "nvme":
        assert res[0]["spill_dirs"] == ["rank0", "rank1"]


@pytest.mark.parametrize("name,ref", [("dp-clip-accum", (0.05, 2)), ("dp-no-overlap", (None, 1)),
                                      ("fsdp-clip", (0.05, 1)), ("dp-lane", (None, 1)),
                                      ("fsdp-lane", (None, 1))])
def test_clipping_accumulation_and_overlap_off(job, name, ref):
    _, results, refs = job
    if ref[0] is None:
        assert_parity(ok(results, name), refs[ref])
        return
    # clipping: the global norm is summed per shard, not per param as torch sums it, so the
    # clip coefficient differs in its last bit; over 20 steps Adam turns that into ~1e-6 on a
    # few small-gradient elements, and the key biases' noise differs (see key_bias)
    assert_parity(ok(results, name), refs[ref], tol=dict(rtol=1e-5, atol=1e-5), noise_atol=1e-4)


def test_data_parallel_state_dict_is_full_and_reloads_anywhere(job):
    outdir, results, refs = job
    res = ok(results, "dp-state")
    assert all(r["state_roundtrip"] for r in res)
    sd = torch.load(os.path.join(outdir, "dp_state.pt"), weights_only=False)
    ref_state = refs[(None, 1)][2].state_dict()["state"]
    for sid, st in ref_state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][sid][k], st[k], rtol=1e-5, atol=1e-7)
        assert float(sd["state"][sid]["step"]) == float(st["step"])
    # the gathered state loads into a single-process HybridAdam (world size 2 -> 1)
    model = TinyGPT()
    opt = HybridAdam(worker.param_groups(model), **worker.HP, offload_fraction=0.3, chunk_numel=1024)
    opt.load_state_dict(sd)
    again = opt.state_dict()["state"]
    assert all(torch.equal(again[i]["exp_avg"], sd["state"][i]["exp_avg"]) for i in again)
    opt.close()


def test_fsdp2_state_dict_round_trips_through_dcp_and_reshards_to_one_process(job):
    import torch.distributed.checkpoint as dcp
    outdir, results, refs = job
    res = ok(results, "fsdp-state")
    assert all(r["dtensor_state"] and r["state_roundtrip"] for r in res)
    # load the 2-rank DCP checkpoint into a single-process HybridAdam: resharded by DCP
    opt = HybridAdam(worker.param_groups(TinyGPT()), **worker.HP, offload_fraction=0.5,
                     chunk_numel=1024)
    template = {"optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=os.path.join(outdir, "dcp"), no_dist=True)
    opt.load_state_dict(template["optim"])
    ref_state = refs[(None, 1)][2].state_dict()["state"]
    state = opt.state_dict()["state"]
    for sid, st in ref_state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[sid][k], st[k], rtol=1e-5, atol=1e-7)
    opt.close()


def test_errors_name_the_rank(job):
    _, results, _ = job
    res = ok(results, "errors")
    for r, out in enumerate(res):
        assert out["accum_error"].startswith(f"HybridAdam[rank {r}]: 2 backward passes")
        assert f"HybridAdam[rank {r}]: the ranks of the process group pass different" in out["mismatch_error"]
    assert res[1]["step_error"].startswith("HybridAdam[rank 1]: the CPU step failed: disk gone")
    assert res[0]["step_error"].startswith("HybridAdam[rank 0]: another rank's CPU step failed")


# ---------------------------------------------------------------------------- no processes


def test_shard_bounds_cover_the_flat_space_once():
    for total in (0, 1, 7, 8, 1001):
        for world in (1, 2, 3, 8):
            spans = [shard_bounds(total, world, r) for r in range(world)]
            assert sum(e - s for s, e, _ in spans) == total
            assert all(spans[r][1] == spans[r + 1][0] for r in range(world - 1))


def test_shard_segments_and_buckets():
    numels = [10, 5, 20]
    segs = shard_segments(numels, 8, 18)
    assert [(s.param, s.start, s.numel, s.flat_offset) for s in segs] == [(0, 8, 2, 8), (1, 0, 5, 10), (2, 0, 3, 15)]
    buckets = plan_buckets(numels, 12)
    assert [(b.params, b.lo, b.hi) for b in buckets] == [((2,), 15, 35), ((0, 1), 0, 15)]


def test_data_parallel_needs_torch_distributed():
    with pytest.raises(ValueError, match="data_parallel=True needs torch.distributed"):
        HybridAdam(TinyGPT().parameters(), data_parallel=True)
    with pytest.raises(ValueError, match="process_group is given but data_parallel=False"):
        HybridAdam(TinyGPT().parameters(), data_parallel=False, process_group=object())


# ---------------------------------------------------------------------------- 2 GPUs, NCCL


@pytest.mark.cuda
def test_nccl_two_gpus_match_single_gpu_adamw(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
    cfgs = [c for c in configs() if c["kind"] in ("dp", "fsdp") and not c.get("state")]
    cfgs += [dict(name="dp-clip", kind="dp", tier="cpu", fraction=0.5, clip=0.05, ref=(0.05, 1)),
             dict(name="dp-accum", kind="dp", tier="cpu", fraction=0.5, accum=2, ref=(None, 2))]
    results = spawn_job(tmp_path, cfgs, backend="nccl", timeout=540.0)
    refs, failures = {}, []
    # GPU kernels (attention backward) and NCCL's sums are not bitwise reproducible across
    # processes, so the key biases' gradients (rounding noise, see key_bias) differ, and Adam
    # turns any noise into steps of up to ~lr: those elements are only bounded by the sum of
    # their group's learning rates (lr 1e-3 under the LambdaLR schedule), twice for both runs
    noise_atol = 2 * sum(1e-3 / (1 + 0.1 * s) for s in range(worker.STEPS))
    for c in cfgs:
        refs.setdefault(c["ref"], reference(*c["ref"], device="cuda:0"))
        try:
            assert_parity(ok(results, c["name"]), refs[c["ref"]], noise_atol=noise_atol)
        except AssertionError as exc:
            failures.append(f"{c['name']}: {exc}")
    assert not failures, "\n\n".join(failures)
