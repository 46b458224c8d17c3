"""ParallelConfig: how one training job is laid out over ranks, validated before any process starts.

Every field is checked on construction (types and ranges); `check(cfg, global_batch)` then checks
the rules that need the model and the batch. Each error is a `ValueError` that names the field and
the rule, so a notebook user sees what to change instead of a hang in rank 3.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from minipar.context_parallel import positions
from minipar.pipeline.schedules import validate

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
PRECISIONS = ("fp32", "bf16", "fp16", "pure-bf16")
RECOMPUTE = ("none", "selective", "full")
DP_MODES = ("naive", "bucketed")
COLLECTIVES = ("minipar", "torch")
CP_METHODS = ("ring", "all-gather", "ulysses")   # context_parallel.METHODS


def tp_sizes(cfg) -> dict[str, int]:
    """The model's sizes that tensor parallelism cuts, each of which tp must divide."""
    return {"n_head": cfg.n_head, "n_kv_head": cfg.kv_heads, "ffn_hidden": cfg.ffn_dim,
            "vocab_size": cfg.vocab_size}


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"ParallelConfig.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1                      # data-parallel replicas; each takes global_batch
                                     #   / dp rows (or dp_shares)
    tp: int = 1                      # tensor-parallel ranks per layer (Megatron);
                                     #   innermost in the grid
    pp: int = 1                      # pipeline stages
    zero: int = 0                    # ZeRO stage over the DP group: 0 none, 1
                                     #   optimizer, 2 +grads, 3 +params
    microbatches: int = 1            # per DP rank: pipeline micro-batches, or accumulation steps
                                     #   when pp = 1
    schedule: str = "1f1b"           # pipeline schedule, one of SCHEDULES
    virtual_stages: int = 1          # model chunks per pipeline rank (> 1 only
                                     #   for "interleaved-1f1b")
    sequence_parallel: bool = False  # shard LayerNorm/dropout activations along the sequence (needs
                                     #   tp > 1)
    precision: str = "fp32"          # "fp32"; "bf16" 16-bit weights, fp32 masters; "fp16" + loss
                                     #   scaling; "pure-bf16" no masters (the contrast)
    recompute: str = "none"          # activation recomputation: "none", "selective"
                                     #   (attention), "full"
    dp_mode: str = "bucketed"        # gradient reduction: "naive" (after backward: one all-reduce
                                     #   per parameter; ZeRO-1/2 one flat reduce-scatter) or
                                     #   "bucketed" (buckets overlapped with backward)
    bucket_mb: float = 25.0          # bucket size in MiB for "bucketed" (DDP's default is 25)
    collectives: str = "minipar"     # whose all-reduce: "minipar" (comm.py's ring)
                                     #   or "torch" (the backend's)
    reduce_fp32: bool = True         # bf16/fp16: accumulate and reduce the gradients in fp32
                                     #   (True: the masters' .grad) or in 16 bits (half the
                                     #   bytes, 16-bit sums)
    stage_layers: tuple | None = None  # layers of each pipeline chunk, in chunk
                                       #   order (pp * virtual_stages
                                     #   of them, each >= 1, summing to n_layer): uneven, e.g. the
                                     #   planner's split for stages of different speed; None: as
                                     #   even as possible
    dp_shares: tuple | None = None   # rows of the global batch each DP rank takes a step (dp of
                                     #   them, each >= 1 and divisible by microbatches, summing to
                                     #   global_batch); the gradient average is weighted by them.
                                     #   None: global_batch / dp each
    stage_tp: tuple | None = None    # the TP degree of each pipeline stage (pp of them): uneven,
                                     #   e.g. more chips on a slower kind's stages (`tp` is then
                                     #   their largest); None: tp on every stage
    cp: int = 1                      # context-parallel ranks: each sequence's tokens split over
                                     #   them (context_parallel.py); between tp and dp in the grid
    cp_method: str = "ring"          # how attention reaches the other ranks' tokens: "ring",
                                     #   "all-gather" or "ulysses" (CP_METHODS)
    ep: int = 1                      # expert-parallel ranks: each MoE layer's experts cut over ep
                                     #   consecutive DP ranks (expert_parallel.py); ep divides dp

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "microbatches", "virtual_stages", "cp", "ep"):
            _positive_int(name, getattr(self, name))
        _one_of("cp_method", self.cp_method, CP_METHODS)
        if not isinstance(self.zero, int) or isinstance(self.zero, bool) or \
                self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("recompute", self.recompute, RECOMPUTE)
        _one_of("dp_mode", self.dp_mode, DP_MODES)
        _one_of("collectives", self.collectives, COLLECTIVES)
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb,
                                                              (int,
                                                               float)) or not self.bucket_mb > 0:
            raise ValueError("ParallelConfig.bucket_mb must be a positive number, got "
                             f"{self.bucket_mb!r}")
        default_bucket = ParallelConfig.__dataclass_fields__["bucket_mb"].default
        if self.zero == 3 and (self.dp_mode != "bucketed" or self.bucket_mb != default_bucket):
            raise ValueError("ParallelConfig.dp_mode and bucket_mb have no effect with zero=3: "
                             "ZeRO-3 reduce-scatters each unit (module) as soon as its gradients "
                             "are in; leave them at their defaults")
        if self.dp_mode == "naive" and self.bucket_mb != default_bucket:
            raise ValueError("ParallelConfig.bucket_mb has no effect with dp_mode='naive' (a "
                             "bucket per parameter for DP, one flat buffer for ZeRO-1/2); use "
                             "dp_mode='bucketed'")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError("ParallelConfig.sequence_parallel must be True or False, got "
                             f"{self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelConfig.sequence_parallel=True needs tp > 1: it cuts what "
                             "tensor parallelism replicates")
        if self.sequence_parallel and self.zero == 3:
            raise ValueError("ParallelConfig.zero=3 does not combine with sequence_parallel: "
                             "ZeRO-3 reduce-scatters each unit's gradients during backward, before "
                             "the partial gradients of the sequence-sharded LayerNorms are summed "
                             "over the TP group; use zero <= 2")
        if not isinstance(self.reduce_fp32, bool):
            raise ValueError("ParallelConfig.reduce_fp32 must be True or False, got "
                             f"{self.reduce_fp32!r}")
        if not self.reduce_fp32 and self.precision not in ("bf16", "fp16"):
            raise ValueError("ParallelConfig.reduce_fp32=False needs precision 'bf16' or 'fp16' "
                             "(fp32 masters "
                             f"to reduce instead of), got {self.precision!r}")
        self._check_splits()
        if self.zero == 3 and self.pp > 1 and self.schedule == "zb-h1":
            raise ValueError("ParallelConfig.zero=3 does not combine with schedule='zb-h1': its "
                             "deferred weight gradients need weights ZeRO-3 has already freed; use "
                             "zero <= 2 or another schedule")
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(f"ParallelConfig.virtual_stages={self.virtual_stages} needs "
                             "schedule='interleaved-1f1b', "
                             f"got {self.schedule!r}")

    def _check_experts(self, cfg) -> None:
        """Expert parallelism's rules, and what a mixture of experts does not combine with yet."""
        if self.ep > 1 and not cfg.n_expert:
            raise ValueError(f"ParallelConfig.ep ({self.ep}) cuts the experts: it needs a mixture "
                             "of experts (GPTConfig.n_expert > 0)")
        if self.ep > 1 and (self.dp % self.ep or cfg.n_expert % self.ep):
            raise ValueError(f"ParallelConfig.ep ({self.ep}) must divide dp ({self.dp}: EP runs "
                             f"inside the DP group) and n_expert ({cfg.n_expert})")
        if self.ep > 1 and self.zero:
            raise ValueError("ParallelConfig.ep > 1 combines with dp, tp, pp, micro-batches, "
                             "precision and recomputation; not yet with ZeRO (its flat shards "
                             "would mix the experts that differ between EP ranks)")
        if cfg.n_expert and (self.cp > 1 or self.sequence_parallel):
            raise ValueError("a mixture of experts (GPTConfig.n_expert > 0) does not combine yet "
                             "with cp > 1 or sequence_parallel: a rank would route part of each "
                             "sequence, and the balance loss and capacity are the sequence's")

    def _check_splits(self) -> None:
        """The uneven splits: layers per chunk, rows per DP rank, TP degrees per stage."""
        self._check_split("stage_layers", self.pp * self.virtual_stages, "pp * virtual_stages")
        self._check_split("dp_shares", self.dp, "dp")
        if self.dp_shares and any(share % self.microbatches for share in self.dp_shares):
            raise ValueError(f"ParallelConfig.dp_shares {self.dp_shares} must each divide by "
                             "microbatches "
                             f"({self.microbatches}): every DP rank cuts its rows into that many "
                             "micro-batches")
        self._check_split("stage_tp", self.pp, "pp")
        if self.stage_tp and (len(set(self.stage_tp)) == 1 or self.tp != max(self.stage_tp)
                              or self.sequence_parallel):
            raise ValueError(f"ParallelConfig.stage_tp {self.stage_tp} needs degrees that differ "
                             f"(else give tp), tp = their largest ({max(self.stage_tp)}, got "
                             f"{self.tp}) and no sequence parallelism (stages of different tp "
                             "would cut the sequence differently)")

    def _check_split(self, name: str, length: int, rule: str) -> None:
        """stage_layers, dp_shares, stage_tp: None, or a tuple (a list is taken as
        one) of `length` positive integers."""
        value = getattr(self, name)
        if value is None:
            return
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(self, name, value)  # frozen: a tuple keeps the config hashable
        if not isinstance(value,
                          tuple) or not all(isinstance(v, int) and not isinstance(v, bool)
                                            and v >= 1
                                                   for v in value):
            raise ValueError(f"ParallelConfig.{name} must be None or a tuple of positive integers, "
                             f"got {value!r}")
        if len(value) != length:
            what = {"stage_layers": "chunk", "dp_shares": "DP rank"}.get(name, "stage")
            raise ValueError(f"ParallelConfig.{name} needs one value per {what}: {rule} = {length} "
                             "of them, "
                             f"got {len(value)}")

    @property
    def world(self) -> int:
        return self.dp * self.cp * (sum(self.stage_tp) if self.stage_tp else self.tp * self.pp)

    def tp_at(self, pp_rank: int) -> int:
        """The TP degree of pipeline stage `pp_rank`."""
        return self.stage_tp[pp_rank] if self.stage_tp else self.tp

    def at_stage(self, pp_rank: int) -> "ParallelConfig":
        """This layout as one stage sees it: tp its own degree (the sizes of its shards, its TP
        collectives, its DP groups'), stage_tp dropped; itself when uniform."""
        return self._stages[pp_rank] if self.stage_tp else self

    @functools.cached_property
    def _stages(self) -> tuple:
        """at_stage of every stage, made once (the planner asks for them with every split)."""
        views = {t: self.replace(tp=t, stage_tp=None) for t in set(self.stage_tp)}
        return tuple(views[t] for t in self.stage_tp)

    @property
    def bucket_bytes(self) -> int | None:
        """bucket_mb in bytes for dp_mode "bucketed"; None for "naive" (data_parallel.split)."""
        return int(self.bucket_mb * 2**20) if self.dp_mode == "bucketed" else None

    @property
    def reductions(self) -> int:
        """Times a step reduces each gradient bucket (ZeRO-3: unit): every micro-batch in bucketed
        ZeRO-2 and in ZeRO-3, else once (DP and ZeRO-1 accumulate first)."""
        every = self.zero == 3 or (self.zero == 2 and self.dp_mode == "bucketed")
        return self.microbatches if every else 1

    @property
    def label(self) -> str:
        """The fields that differ from the defaults, e.g. "dp=2 microbatches=4"
        ("single process" if none)."""
        default = ParallelConfig()
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return " ".join(changed) or "single process"

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def dp_rows(self, global_batch: int) -> list[int]:
        """Rows of the global batch each DP rank takes a step: dp_shares,
        or global_batch / dp each."""
        return list(self.dp_shares) if self.dp_shares else [global_batch // self.dp] * self.dp

    def check(self, cfg, global_batch: int) -> None:
        """The rules that need the model config and the global batch; raises ValueError."""
        if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
        if self.dp_shares and sum(self.dp_shares) != global_batch:
            raise ValueError(f"ParallelConfig.dp_shares {self.dp_shares} must sum to global_batch "
                             f"({global_batch}), "
                             f"not {sum(self.dp_shares)}")
        if not self.dp_shares and global_batch % (self.dp * self.microbatches):
            raise ValueError(f"global_batch ({global_batch}) must divide by dp * microbatches "
                             f"({self.dp} * {self.microbatches} = {self.dp * self.microbatches})")
        for name, size in tp_sizes(cfg).items():
            if size % self.tp or any(size % t for t in self.stage_tp or ()):
                which = f"stage_tp {self.stage_tp}, each" if self.stage_tp else f"tp ({self.tp})"
                raise ValueError(f"ParallelConfig.{which} must divide the model's {name} "
                                 f"({size})" + (": minipar splits the key/value heads, it does "
                                                "not replicate them" if name == "n_kv_head"
                                                else ""))
        if cfg.tie_embeddings and self.pp > 1:
            raise ValueError("GPTConfig.tie_embeddings needs pp = 1: the embedding and the head "
                             "would sit on different stages, whose copies of the weight need a "
                             "gradient all-reduce between them (Megatron's embedding group), which "
                             "minipar does not have")
        if cfg.tie_embeddings and self.zero == 3:
            raise ValueError("GPTConfig.tie_embeddings needs zero <= 2: ZeRO-3 gathers and frees "
                             "each module's parameters, and the embedding's weight would belong "
                             "to two units (the embedding and the head)")
        if self.pp * self.virtual_stages > cfg.n_layer:
            raise ValueError(f"pp * virtual_stages ({self.pp} * {self.virtual_stages}) must not "
                             "exceed the "
                             f"model's n_layer ({cfg.n_layer}): every stage needs a layer")
        if self.stage_layers and sum(self.stage_layers) != cfg.n_layer:
            raise ValueError(f"ParallelConfig.stage_layers {self.stage_layers} must sum to the "
                             "model's n_layer "
                             f"({cfg.n_layer}), not {sum(self.stage_layers)}")
        if self.pp > 1:  # the schedule's own rules (the micro-batches it needs...), named here
            try:
                validate(self.schedule, self.pp, self.microbatches, self.virtual_stages)
            except ValueError as e:
                raise ValueError(f"ParallelConfig (pp = stages = {self.pp}): {e}") from None
        self._check_experts(cfg)
        if self.cp > 1 and cfg.seq_len < 2 * self.cp:
            raise ValueError(f"ParallelConfig.cp ({self.cp}) cuts seq_len ({cfg.seq_len}) into "
                             f"2 cp chunks (the causal balance): seq_len must be >= {2 * self.cp}")
        if self.cp > 1 and cfg.dropout:
            raise ValueError("ParallelConfig.cp > 1 needs GPTConfig.dropout 0: the CP ranks would "
                             "drop other attention weights than the single device")
        heads = self.cp * self.tp   # Ulysses splits a TP rank's heads over the CP ranks
        if self.cp_method == "ulysses" and (cfg.n_head % heads or cfg.kv_heads % heads):
            raise ValueError(f"ParallelConfig.cp_method='ulysses' splits the heads: n_head "
                             f"({cfg.n_head}) and n_kv_head ({cfg.kv_heads}) must divide by cp "
                             f"* tp ({self.cp} * {self.tp})")
        held = [len(positions(cfg.seq_len, self.cp, r)) for r in range(self.cp)] \
            if self.sequence_parallel and self.cp > 1 else [cfg.seq_len]
        if self.sequence_parallel and any(n % self.tp for n in held):
            what = f"seq_len ({cfg.seq_len})" if self.cp == 1 else \
                f"the tokens each CP rank holds ({held}: seq_len {cfg.seq_len} over cp {self.cp})"
            raise ValueError(f"sequence_parallel needs {what} to divide by tp ({self.tp})")
