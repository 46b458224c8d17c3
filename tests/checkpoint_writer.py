"""Run by test_checkpoint: write a good checkpoint, say so, then start a large one (which the test kills)."""
import sys

import torch

import minipar
from minipar import checkpoint
from minipar.train import make_optimizer

if __name__ == "__main__":
    path, cfg = sys.argv[1], minipar.GPTConfig.preset("tiny")
    model = minipar.GPT(cfg)
    good = checkpoint.gather(model, make_optimizer(model, 1e-3, 0.0), None, None, None, 7, cfg)
    checkpoint.save(good, path)
    print("saved", flush=True)
    checkpoint.save({**good, "padding": torch.ones(2**28)}, path)  # 1 GiB: long enough to be killed in
