"""Worker for test_data_parallel: many DP variants in one launch (one launch per world size)."""
from minipar.train import train_rank


def train_variants(cfg, variants, steps, global_batch):
    """Run train_rank for each ParallelConfig in `variants`; return what each rank saw, by variant."""
    return [train_rank(cfg, par, steps, global_batch, 1e-3, 0.1, 0, "synthetic", True)
            for par in variants]



def zero_fp16_overflow(cfg):
    """Two ZeRO-1 fp16 steps; rank 1 poisons its first gradient. Returns (params changed?, scale) a step."""
    import torch
    import torch.distributed as dist

    from minipar.model import GPT, cross_entropy
    from minipar.precision import MixedPrecision
    from minipar.zero import ZeroOptimizer
    torch.manual_seed(0)
    model = GPT(cfg)
    zero = ZeroOptimizer(model, stage=1, dtype=torch.float16, master=True)
    mp = MixedPrecision(model, "fp16", masters=False)
    zero.scaler = mp.scaler
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    changed, scales = [], []
    for step in range(2):
        before = zero.flat.clone()
        with mp.autocast():
            loss = cross_entropy(model(x), x)
        mp.scale(loss).backward()
        if step == 0 and dist.get_rank() == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        zero.step()
        zero.zero_grad()
        changed.append(not torch.equal(before, zero.flat))
        scales.append(mp.scaler.scale)
    return changed, scales
