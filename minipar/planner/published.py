"""Published training runs the cost model is checked against, as data: each with its source, its
layout, what the source leaves open, and the figure it reports (docs/references.md has every one).

    RUNS                  name -> Run
    predict(run)          the planner's figure for it: the best, over the knobs the source leaves
                          open, of the layouts that fit, in the source's own unit and FLOP
                          convention (`Run.metric`)
    compare()             {name: (predicted, published, predicted / published - 1)}

One preset per GPU kind, nothing tuned per row: the A100 rows run on `dgx-a100-80g` (BLOOM's with
Jean Zay's slower network), the torchtitan rows on `h100-torchtitan` (MACHINES). Each is timed with
the overlaps of the code it ran (`Run.overlap`): Megatron-LM's for Korthikanti's,
Megatron-DeepSpeed's pipeline engine for BLOOM's and MT-NLG's.

Metrics:
    step_s          seconds a step
    hfu_tflops      TFLOP/s per GPU counting the recomputed forward, Megatron-DeepSpeed's log
                    formula: 24 c B s l h^2 (1 + s/(6h) + V/(16 l h)) a step, c = 4 with full
                    recomputation (3 without)
    tokens_per_gpu  tokens a second per GPU, torchtitan's "wps" per GPU
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from minipar.config import ParallelConfig
from minipar.model import GPTConfig
from minipar.planner.cluster import Cluster
from minipar.planner.predict import estimate

KORTHIKANTI = dict(vocab_size=51200, seq_len=2048)
SIZES = {"22B": dict(n_layer=48, n_head=64, d_model=6144, **KORTHIKANTI),  # Table 5's models
         "175B": dict(n_layer=96, n_head=96, d_model=12288, **KORTHIKANTI),
         "530B": dict(n_layer=105, n_head=128, d_model=20480, **KORTHIKANTI),
         "1T": dict(n_layer=128, n_head=160, d_model=25600, **KORTHIKANTI)}


@dataclass(frozen=True)
class Run:
    cfg: GPTConfig
    cluster: str              # a Cluster.PRESETS name, or one of MACHINES (below)
    nodes: int
    layouts: tuple            # ParallelConfigs: one, or those the source leaves open
    global_batch: int         # sequences a step
    micro_batches: tuple      # sequences a micro-batch: one, or those left open
    metric: str               # "step_s", "hfu_tflops" or "tokens_per_gpu"
    published: float
    source: str
    attention: str = "materialized"  # Megatron-LM before FlashAttention; torchtitan: "flash"
    overlap: str = "production"      # whose overlaps it ran (gpu_time.OVERLAPS): Megatron-LM's;
                                     #   torchtitan's FSDP prefetches as all do; "deepspeed"
    float8: bool = False             # its linear layers ran in float8 (torchao; estimate's float8)


# Machines of their own: the GPU kind's preset with what the source says differs.
# torchtitan's benchmark H100s: the SXM part's peak, SMs and NVLink (its 500 W parts may run below
# that peak: not stated), 96 GB of HBM2e at 2.4 TB/s and 400 Gb/s RDMA a GPU. Jean Zay, where BLOOM
# trained: A100 80 GB nodes of 8 with 4 x 100 Gb/s Omni-Path links a node, 6.25 GB/s a GPU.
MACHINES = {"h100-torchtitan": ("dgx-h100", dict(memory_per_gpu=96e9, memory_bandwidth=2.4e12,
                                                 inter_bandwidth=50e9)),
            "jean-zay-a100": ("dgx-a100-80g", dict(inter_bandwidth=4 * 12.5e9 / 8))}


def cluster_of(run: Run) -> Cluster:
    if run.cluster in MACHINES:
        kind, changes = MACHINES[run.cluster]
        return dataclasses.replace(Cluster.preset(kind, run.nodes), name=run.cluster, **changes)
    return Cluster.preset(run.cluster, nodes=run.nodes)


def _table_5(name: str, recompute: str, published: float) -> Run:
    pp, gpus, batch, b, v = {"22B": (1, 8, 4, 4, 1), "175B": (8, 64, 64, 1, 2),
                             "530B": (35, 280, 280, 1, 1), "1T": (64, 512, 512, 1, 1)}[name]
    par = ParallelConfig(tp=8, pp=pp, schedule="interleaved-1f1b" if v > 1 else "1f1b",
                         virtual_stages=v, sequence_parallel=True, precision="bf16",
                         recompute=recompute)
    return Run(GPTConfig(**SIZES[name]), "dgx-a100-80g", gpus // 8, (par,), batch, (b,), "step_s",
               published, "Korthikanti et al. 2022, Table 5 (v = 2 assumed for 175B)")


BLOOM = GPTConfig(n_layer=70, n_head=112, d_model=14336, vocab_size=250880, seq_len=2048)
MT_NLG = GPTConfig(n_layer=105, n_head=128, d_model=20480, vocab_size=51200, seq_len=2048)
MEGATRON_DEEPSPEED = dict(zero=1, precision="bf16", recompute="full")  # no SP in 2021-22
RUNS = {
    **{f"Table 5 {n} {rc}": _table_5(n, rc, t)
       for n, (sel, full) in {"22B": (1.10, 1.42), "175B": (13.75, 18.13),
                              "530B": (37.83, 49.05), "1T": (71.49, 94.42)}.items()
       for rc, t in (("selective", sel), ("full", full))},
    "BLOOM-176B 384 GPUs": Run(
        BLOOM, "jean-zay-a100", 48, (ParallelConfig(dp=8, tp=4, pp=12, **MEGATRON_DEEPSPEED),),
        2048, (2,), "hfu_tflops", 150.0,
        "BigScience BLOOM model card and training logbook (about 150 TFLOP/s a GPU); micro-batch "
        "2, full recomputation, from its training script; modelled untied (minipar's pipeline "
        "does not tie the embedding across stages)", overlap="deepspeed"),
    **{f"MT-NLG 530B {gpus} GPUs": Run(
        MT_NLG, "dgx-a100-80g", gpus // 8,
        (ParallelConfig(dp=gpus // 280, tp=8, pp=35, **MEGATRON_DEEPSPEED),), 1920, (1,),
        "step_s", step, "Smith et al. 2022, Megatron-Turing NLG 530B, throughput table",
        overlap="deepspeed")
       for gpus, step in ((2240, 60.1), (2800, 50.2), (3360, 44.4))},
    **{f"torchtitan Llama 3 8B {gpus} GPUs": Run(
        GPTConfig.preset("llama3-8b"), "h100-torchtitan", gpus // 8,
        tuple(ParallelConfig(dp=gpus, zero=3, precision="bf16", recompute=rc)
              for rc in ("selective", "full")),  # torchtitan's per-op selective AC: no peer
        2 * gpus, (2,), "tokens_per_gpu", wps,
        "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (FSDP, local batch 2, "
        "selective AC, no torch.compile)", attention="flash")
       for gpus, wps in ((8, 5762.0), (128, 5605.0))},
    **{f"torchtitan Llama 3 8B CP {cp} {seq // 1024}K": Run(
        GPTConfig.preset("llama3-8b", seq_len=seq), "h100-torchtitan", 1,
        (ParallelConfig(dp=8 // cp, cp=cp, zero=3, precision="bf16", recompute="full",
                        cp_method="all-gather"),),   # PyTorch's CP: K/V all-gathered by default
        8 // cp, (1,), "tokens_per_gpu", wps,
        "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (FSDP x CP on 8 GPUs, "
        "local batch 1, full AC, torch.compile, Float8)", attention="flash", float8=True)
       for cp, seq, wps in ((1, 32768, 3890.0), (2, 65536, 2540.0), (4, 131072, 1071.0),
                            (8, 262144, 548.0))},
}


def hfu_flops(cfg: GPTConfig, global_batch: int, recompute: str) -> float:
    """FLOPs a step as Megatron-DeepSpeed's log counts them (module docstring)."""
    l, h, s, V = cfg.n_layer, cfg.d_model, cfg.seq_len, cfg.vocab_size
    c = 4 if recompute == "full" else 3
    return 24 * c * global_batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predict(run: Run):
    """(the figure in run.metric, the Estimate behind it): the fastest of the layouts and
    micro-batches the source leaves open that fit."""
    cluster = cluster_of(run)
    ests = [estimate(run.cfg, par, cluster, run.global_batch, b, run.attention, run.overlap,
                     run.float8)
            for par, b in itertools.product(run.layouts, run.micro_batches)]
    best = min((e for e in ests if e.fits), key=lambda e: e.step_time, default=None) or \
        min(ests, key=lambda e: e.step_time)
    if run.metric == "step_s":
        return best.step_time, best
    if run.metric == "hfu_tflops":
        flops = hfu_flops(run.cfg, run.global_batch, best.par.recompute)
        return flops / best.step_time / best.par.world / 1e12, best
    return run.global_batch * run.cfg.seq_len / best.step_time / best.par.world, best


def compare(names=None) -> dict[str, tuple[float, float, float]]:
    """{name: (predicted, published, predicted / published - 1)} for these runs (default: all)."""
    out = {}
    for name in names or RUNS:
        got = predict(RUNS[name])[0]
        out[name] = (got, RUNS[name].published, got / RUNS[name].published - 1)
    return out


def _gpt2(e) -> bool:
    """GPT-2's shapes (4h GELU MLP, full multi-head attention) in bf16, attention in memory: the
    Megatron runs'."""
    cfg = e.cfg
    return (cfg.mlp == "gelu" and cfg.kv_heads == cfg.n_head and cfg.ffn_dim == 4 * cfg.d_model
            and e.par.precision == "bf16" and e.attention == "materialized")


def _llama(e) -> bool:
    """Llama's shapes (SwiGLU, grouped-query attention), bf16, fused attention: torchtitan's."""
    return (e.cfg.mlp == "swiglu" and e.cfg.kv_heads < e.cfg.n_head and e.par.precision == "bf16"
            and e.attention == "flash")


# What a measurement has checked, by GPU kind, model shape and technique: (what, which estimates it
# covers). Everything else the planner predicts, no measurement has checked (the explorer marks it).
CHECKED = [
    ("Korthikanti et al. 2022 Table 5 (A100, GPT shapes, TP 8 with SP, PP, recomputation): within "
     "10%",
     lambda e: e.cluster.name == "dgx-a100-80g" and _gpt2(e) and e.par.tp == 8
     and e.par.sequence_parallel and e.par.dp == 1 and e.par.zero == 0
     and e.par.recompute != "none"),
    ("BLOOM-176B, MT-NLG 530B (A100, GPT shapes, TP x PP x DP, ZeRO-1, full recomputation, "
     "Megatron-DeepSpeed): predicted 14% more TFLOP/s (BLOOM) and 25-28% shorter steps (MT-NLG) "
     "than ran",
     lambda e: e.cluster.name in ("dgx-a100-80g", "jean-zay-a100") and _gpt2(e) and e.par.tp > 1
     and e.par.pp > 1 and e.par.zero <= 1 and e.par.recompute == "full"
     and e.overlap == "deepspeed"),
    ("torchtitan Llama 3 8B (H100, Llama shapes, FSDP, full recomputation): within 5% on 128 "
     "GPUs, 16% on 8",
     lambda e: e.cluster.name in ("dgx-h100", "h100-torchtitan") and _llama(e) and e.par.zero == 3
     and e.par.tp == e.par.pp == e.par.cp == 1 and e.par.recompute == "full" and not e.float8),
    ("torchtitan Llama 3 8B context-parallel sweep (H100, FSDP x CP, full recomputation, float8 "
     "linears, 32K-256K tokens): within 8% at 32K, 128K and 256K, 22% slow at 64K",
     lambda e: e.cluster.name in ("dgx-h100", "h100-torchtitan") and _llama(e) and e.float8
     and e.par.zero == 3 and e.par.tp == e.par.pp == 1 and e.par.recompute == "full"),
    ("this machine, 2 and 4 ranks (tests/test_planner_measured.py)",
     lambda e: e.cluster.cpu is not None and e.par.world in (2, 4)),
]


def checked_by(est) -> str | None:
    """Which measurement has checked predictions like `est` (CHECKED), or None: none has."""
    return next((what for what, covers in CHECKED if covers(est)), None)
