"""Worker for test_data_parallel: many DP variants in one launch (one launch per world size)."""
import torch
import torch.distributed as dist

from minipar.model import GPT, cross_entropy
from minipar.precision import LossScaler, MixedPrecision
from minipar.train import train_layouts
from minipar.zero import ZeroOptimizer


def train_variants(cfg, variants, steps, global_batch):
    """Train each ParallelConfig in `variants`; return this rank's RankResult, by variant."""
    return train_layouts(variants, cfg=cfg, steps=steps, global_batch=global_batch, lr=1e-3,
                         weight_decay=0.1, return_state=True)



def zero_fp16_overflow(cfg):
    """Two ZeRO-1 fp16 steps; rank 1 poisons its first gradient. Returns (params changed?, scale) a step."""
    torch.manual_seed(0)
    model = GPT(cfg)
    scaler = LossScaler()  # shared: ZeRO unscales by the scale the loss was multiplied by
    zero = ZeroOptimizer(model, stage=1, dtype=torch.float16, master=True, scaler=scaler)
    mp = MixedPrecision(model, "fp16", masters=False, scaler=scaler)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    changed, scales = [], []
    for step in range(2):
        before = torch.cat([full for _, full, _ in zero.flats])
        with mp.autocast():
            loss = cross_entropy(model(x), x)
        mp.scale(loss).backward()
        if step == 0 and dist.get_rank() == 1:
            zero.grads.buckets[0].buffer[0] = float("inf")  # where the gradients accumulate
        zero.step()
        zero.zero_grad()
        changed.append(not torch.equal(before, torch.cat([full for _, full, _ in zero.flats])))
        scales.append(mp.scaler.scale)
    return changed, scales
