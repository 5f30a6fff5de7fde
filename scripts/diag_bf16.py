"""Diagnostic: where does HybridAdam (bf16 params, CUDA) first diverge from the reference?"""
import copy, sys
sys.path.insert(0, "tests")
import torch
from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
for overlap in (False,):
    torch.manual_seed(0)
    model = TinyGPT(d_model=64, n_layers=4).cuda().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(masters, **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=4096, overlap=overlap)
    names = [n for n, _ in model.named_parameters()]
    for step in range(4):
        idx, tgt = make_batch(step)
        _, loss = model(idx.cuda(), tgt.cuda()); loss.backward()
        _, ref_loss = ref_model(idx.cuda(), tgt.cuda()); ref_loss.backward()
        gd = [(n, (p.grad.float() - q.grad.float()).abs().max().item()) for n, p, q in zip(names, model.parameters(), ref_model.parameters())]
        pd = [(n, (p.float() - q.float()).abs().max().item()) for n, p, q in zip(names, model.parameters(), ref_model.parameters())]
        print("step", step, "loss", loss.item(), ref_loss.item())
        print("  grad diffs nonzero:", [x for x in gd if x[1] > 0][:5])
        print("  param diffs nonzero:", [x for x in pd if x[1] > 0][:5])
        opt.step(); opt.zero_grad()
        for m, p in zip(masters, ref_model.parameters()): m.grad = p.grad.float()
        ref_opt.step(); ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()): p.copy_(m); p.grad = None
        st = opt.state_dict()["state"]
        md = [(names[i], (st[i]["master"] - m.detach().cpu()).abs().max().item()) for i, m in enumerate(masters)]
        print("  master diffs > 1e-6:", [x for x in md if x[1] > 1e-6][:5])
        torch.cuda.synchronize()
        pd = [(n, (p.float() - q.float()).abs().max().item()) for n, p, q in zip(names, model.parameters(), ref_model.parameters())]
        print("  param diffs after step:", [x for x in pd if x[1] > 0][:5])
