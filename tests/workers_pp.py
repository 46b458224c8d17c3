"""Worker for test_pipeline_runtime: train with the pipeline executor, one case after another.

Also runs in the test process itself when p = 1 (no process group needed)."""
import torch

from minipar import comm
from minipar import data as dataset
from minipar.mesh import Mesh
from minipar.model import GPT
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank, free_unused
from minipar.train import make_optimizer


def make_opt(model, optim, lr):
    return torch.optim.SGD(model.parameters(), lr=lr) if optim == "sgd" else make_optimizer(model, lr, 0.1)


def train_pipeline(cfg, plan, virtual, steps, batch, optim="adamw", lr=1e-3, pp_rank=0, group=None):
    """Train with the action lists `plan` (one per pipeline rank); return what this rank saw."""
    torch.manual_seed(0)
    model = GPT(cfg)  # the full single-device init, then cut: every layout has the same weights
    pp, m = len(plan), 1 + max(a.microbatch for rank in plan for a in rank)
    chunks = chunks_for_rank(model, pp, pp_rank, virtual)
    free_unused(model, chunks.values())
    optimizer = make_opt(model, optim, lr)
    sent = comm.CommStats()
    ex = PipelineExecutor(chunks, plan, (batch // m, cfg.seq_len, cfg.d_model), group, stats=sent)
    losses, grads, events = [], None, []
    for step in range(steps):
        x, y = dataset.global_batch("synthetic", step, batch, cfg.seq_len, cfg.vocab_size, 0)
        inputs = [dataset.shard(x, 0, 1, j, m) for j in range(m)]
        targets = [dataset.shard(y, 0, 1, j, m) for j in range(m)]
        loss, step_events = ex.step(inputs, targets)
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        events.append(step_events)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, grads=grads, state=state, events=events, peak=ex.peak_in_flight,
                bytes=sent.bytes_sent["p2p"], calls=sent.calls["p2p"])


def pipeline_cases(cfg, cases, steps, batch):
    """Each case (plan, virtual, optim) on the pipeline group of this launch (world = pp)."""
    mesh = Mesh.build(pp=len(cases[0][0]))
    return [train_pipeline(cfg, plan, virtual, steps, batch, optim, pp_rank=mesh.pp_rank, group=mesh.pp_group)
            for plan, virtual, optim in cases]
