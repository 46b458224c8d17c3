"""The accelerator catalogue: each kind's vendor figures, per chip, as an island (its scale-up
domain) that `Cluster.preset` turns into a cluster. Every figure's source is in docs/references.md
("Accelerators"); where sources disagree it says which is used here and why.

    peak        dense bf16 FLOP/s (no 2:4 sparsity): the MFU denominator
    hbm         bytes of HBM; vendors' "GB" is read as GiB (HBM stacks come in binary sizes; an
                H100's 80 GB is 80 GiB), except where a measurement says what is usable (H200)
    hbm_rate    HBM bytes/s
    fabric      the scale-up network, its bandwidth per chip per direction (`scale_up`, the sum
                over the chip's links: vendors often quote both directions, halved here) and the
                chips it joins (`domain`: an HGX board, a TPU slice, a Trainium2 instance)
    ring        the fraction of `scale_up` that one ring collective inside the domain can drive:
                1 on a switch (NVSwitch, UB); on a torus a ring along one axis uses 2 of the chip's
                4 (2D) or 6 (3D) ports (an approximation: XLA's multi-axis collectives use more)
    mesh        a full mesh of direct links (Infinity Fabric, Gaudi's RoCE ports): `scale_up` is
                the sum over the links to every other chip of the domain, and a group of k chips
                drives only the k - 1 links among them, (k - 1) / (domain - 1) of it (Cluster.link)
    scale_out   the NICs' bytes/s per chip, one direction (the compute fabric only)
    library     the collective library inside the island (NCCL, RCCL, HCCL...): kinds with
                different libraries share no TP group (`Cluster.mixed`)
    ceiling     the fraction of peak a full wave of matmul tiles reaches (gpu_time.matmul):
                measured or fitted for NVIDIA's A100, H100 and H200 (cluster.py says how),
                ASSUMED for the others (no measurement here; the planner's results on them are
                as good as that guess)
    units       matrix units computing 128 x 128 output tiles at once (gpu_time's waves): SMs
                on NVIDIA, CUs on AMD; for systolic arrays their count in 128 x 128 tiles,
                assumed (it only sets how full the last wave of a matmul is)

The link a collective gets is NCCL's 80% of the line rate (cluster.py) on every vendor's fabric,
assumed alike; latencies 1 us a step inside an island and 5 us across, assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2 ** 30
GB = 1e9
ASSUMED_CEILING = 0.75   # between the A100's fitted 0.77 and what vendors' GEMM tables suggest


@dataclass(frozen=True)
class Device:
    chip: str
    vendor: str
    peak: float
    hbm: float
    hbm_rate: float
    fabric: str
    scale_up: float
    domain: int
    scale_out: float
    library: str
    ceiling: float = ASSUMED_CEILING
    units: int = 108
    ring: float = 1.0
    mesh: bool = False


def _nv(chip, peak, hbm, rate, link, domain=8, units=132, ceiling=ASSUMED_CEILING, nic=50 * GB):
    return Device(chip, "NVIDIA", peak, hbm, rate, "NVLink + NVSwitch", link, domain, nic, "NCCL",
                  ceiling, units)


# name: one island of the kind (`Cluster.preset(name, nodes)` joins `nodes` of them)
CATALOGUE = {
    "dgx-a100-80g": _nv("A100 SXM 80GB", 312e12, 80 * GiB, 2.039e12, 300 * GB, units=108,
                        ceiling=0.77, nic=25 * GB),
    "dgx-h100": _nv("H100 SXM", 989e12, 80 * GiB, 3.35e12, 450 * GB, ceiling=0.82),
    "h200": _nv("H200 SXM", 989e12, 139 * GiB, 4.8e12, 450 * GB, ceiling=0.82),
    "hgx-b200": _nv("B200 (HGX)", 2.25e15, 180 * GiB, 8.0e12, 900 * GB, units=148),
    "gb200-nvl72": _nv("B200 in GB200 NVL72", 2.5e15, 186 * GiB, 8.0e12, 900 * GB, domain=72,
                       units=148),
    "mi300x": Device("Instinct MI300X", "AMD", 1307.4e12, 192 * GiB, 5.3e12,
                     "Infinity Fabric, full mesh of 7 links", 448 * GB, 8, 50 * GB, "RCCL",
                     units=304, mesh=True),
    "gaudi3": Device("Gaudi 3 (HL-325L)", "Intel", 1835e12, 128 * GiB, 3.67e12,
                     "RoCE, 21 x 200GbE, all-to-all", 525 * GB, 8, 75 * GB, "HCCL (Habana)",
                     units=32, mesh=True),
    "ascend-910b": Device("Ascend 910B2", "Huawei", 354e12, 64 * GiB, 1.6e12, "HCCS", 196 * GB, 8,
                          25 * GB, "HCCL (Huawei)", units=24),
    "cloudmatrix-384": Device("Ascend 910C", "Huawei", 752e12, 128 * GiB, 3.2e12,
                              "Unified Bus, two switch tiers", 392 * GB, 384, 50 * GB,
                              "HCCL (Huawei)", units=48),
    "tpu-v5e": Device("TPU v5e", "Google", 197e12, 16 * GiB, 0.819e12, "ICI, 2D torus",
                      200 * GB, 256, 25e9 / 8, "XLA (ICI)", units=4, ring=2 / 4),
    "tpu-v5p": Device("TPU v5p", "Google", 459e12, 95 * GiB, 2.765e12, "ICI, 3D torus",
                      600 * GB, 6144, 50e9 / 8, "XLA (ICI)", units=8, ring=2 / 6),
    "tpu-v6e": Device("TPU v6e (Trillium)", "Google", 918e12, 32 * GiB, 1.6e12, "ICI, 2D torus",
                      400 * GB, 256, 100e9 / 8, "XLA (ICI)", units=8, ring=2 / 4),
    "trn2": Device("Trainium2", "AWS", 667e12, 96 * GiB, 2.9e12, "NeuronLink-v3, 2D torus",
                   640 * GB, 16, 200e9 / 8, "Neuron CC", units=8, ring=2 / 4),
}


def preset(name: str) -> dict:
    """The Cluster fields of one island of `name` (Cluster.preset's)."""
    if name not in CATALOGUE:
        raise ValueError(f"unknown cluster preset {name!r}; choose from {sorted(CATALOGUE)}")
    d = CATALOGUE[name]
    return dict(gpus_per_node=d.domain, memory_per_gpu=d.hbm, peak_flops=d.peak,
                efficiency=d.ceiling, intra_bandwidth=0.8 * d.scale_up * d.ring,
                intra_latency=1e-6, inter_bandwidth=d.scale_out, inter_latency=5e-6,
                memory_bandwidth=d.hbm_rate, sms=d.units, intra_mesh=d.mesh, name=name)
