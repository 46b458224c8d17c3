"""minipar: the techniques that train large models on many accelerators,
from scratch on torch.distributed.

    import minipar
    cfg = minipar.GPTConfig.preset("tiny")
    res = minipar.train(cfg, minipar.ParallelConfig(), steps=20, global_batch=8, data="shakespeare")
"""
from minipar import comm, pipeline, tensor_parallel
from minipar.config import ParallelConfig
from minipar.launch import WorkerError, WorkerTimeout, heartbeat, launch, prestart
from minipar.lessons import demos
from minipar.mesh import Mesh
from minipar.model import GPT, GPTConfig
from minipar.planner import Estimate, NoFeasiblePlan, estimate, explain, format_table, plan
from minipar.planner.cluster import Cluster
from minipar.train import NonFiniteLoss, TrainResult, train

__all__ = ["comm", "demos", "pipeline", "tensor_parallel",
           "Cluster", "Estimate", "GPT", "GPTConfig", "Mesh", "NoFeasiblePlan", "NonFiniteLoss",
           "ParallelConfig", "TrainResult", "WorkerError", "WorkerTimeout", "estimate", "explain",
           "format_table", "heartbeat", "launch", "plan", "prestart", "train"]
