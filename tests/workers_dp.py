"""Worker for test_data_parallel: many DP variants in one launch (one launch per world size)."""
from minipar.train import train_rank


def train_variants(cfg, variants, steps, global_batch):
    """Run train_rank for each ParallelConfig in `variants`; return what each rank saw, by variant."""
    return [train_rank(cfg, par, steps, global_batch, 1e-3, 0.1, 0, "synthetic", True)
            for par in variants]

