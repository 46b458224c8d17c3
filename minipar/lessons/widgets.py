"""Something to play with in lessons 01, 02, 03, 04, 06 and 10: ipywidgets controls over minipar's
own formulas (and, in 10, its simulator). No processes, and a change redraws at once. Each widget
returns an ipywidgets VBox, with its controls in `.controls`, its Output in `.out` and its redraw
in `.redraw`. Under each widget is the pure function that computes what it draws, so tests can
check the numbers without a browser.

    bucket_overlap(...)        (01) each bucket's all-reduce on a timeline against backward, by
      bucket_timeline(...)          bucket size and link: demos_dp.predict_exposed at
                                    data_parallel.split's buckets
    loss_scale(grads)          (02) the histogram of |gradient| x 2^k cast to fp16 (x.half()),
      fp16_fates(g, k)              with what rounds to 0, what is subnormal, what overflows
    zero_memory_widget()       (03) model states per device by category over Psi, N_d, the stage
      zero_memory(psi, ...)         and the precision: memory.model_states at memory.layout_bytes
    tp_comm()                  (04) one layer's TP bytes, 8 b s h e (t-1)/t, and its communication
      tp_layer(t, h, s, b, ...)     time over its compute time, over a link (NVLink, InfiniBand...)
    layout_3d_widget(world)    (06) a dp x tp x pp layout of a world, valid factorisations only:
      layout_3d(dp, tp, pp)         each rank's Mesh coordinates and its groups, on viz_3d's grid
      factorisations(world)
    schedule(traces, clusters) (10) a trace, a cluster mix and a policy: scheduler.simulate's
                                    Result as a Gantt chart over each kind's occupancy, with its
                                    metrics (viz_scheduler.panel)
"""
from __future__ import annotations

import ipywidgets as w
import matplotlib.pyplot as plt
import numpy as np
import torch

from minipar import memory, scheduler
from minipar.data_parallel import split
from minipar.lessons import viz_3d, viz_scheduler
from minipar.lessons.demos_dp import backward_per_bucket, predict_exposed
from minipar.lessons.explorer_html import png, text
from minipar.mesh import Mesh

FP16_MIN_NORMAL, FP16_ZERO, FP16_INF = 2.0**-14, 2.0**-25, 65520.0  # fp16: x <= 2^-25 -> 0
PRECISIONS = {"fp32": ("fp32", True), "bf16, fp32 grads": ("bf16", True),
              "bf16, 16-bit grads": ("bf16", False)}  # label: memory.layout_bytes' arguments
LINKS = {"NVLink 4 (H100)": 450.0, "InfiniBand NDR": 50.0, "PCIe 4 x16": 25.0}  # GB/s, lesson 04
ACHIEVED = 989e12 * 0.5  # lesson 04: H100 SXM dense bf16 peak at 50% utilisation, FLOP/s
GB = 1e9


def _panel(controls: dict, draw, extra: tuple = ()) -> w.VBox:
    """A VBox of the controls (and `extra` widgets) above an Output that `draw(**values)` fills
    with Output outputs; any control's change redraws."""
    out = w.Output()

    def redraw(_=None):
        out.outputs = tuple(draw(**{k: c.value for k, c in controls.items()}))

    for c in controls.values():
        c.observe(redraw, names="value")
    rows = [w.HBox(list(controls.values())[i:i + 3]) for i in range(0, len(controls), 3)]
    box = w.VBox([*rows, *extra, out])
    box.controls, box.out, box.redraw = controls, out, redraw
    redraw()
    return box


# ----------------------------------------------------------------------------- 01: buckets

def bucket_timeline(numels: list[int], arrivals: list[float], bucket_mb: float, alpha: float,
                    beta: float, n: int = 2, element_bytes: int = 4) -> list[dict]:
    """`demos_dp.predict_exposed` for buckets of `bucket_mb` MiB cut by `data_parallel.split` (as
    GradBuckets cuts them) from parameters of `numels` elements (model order) whose gradients
    arrive `arrivals` seconds after backward began; each row also has "params", its indices."""
    buckets = split(numels, int(bucket_mb * 2**20), element_bytes)
    sizes = [element_bytes * sum(numels[i] for i in b) for b in buckets]
    rows = predict_exposed(sizes, backward_per_bucket(arrivals, buckets), alpha, beta, n)
    return [dict(row, params=b) for row, b in zip(rows, buckets)]


def _bucket_draw(numels, arrivals, n, element_bytes, bucket_mb: float, bandwidth: float,
                 latency: float) -> list:
    rows = bucket_timeline(numels, arrivals, bucket_mb, latency * 1e-6, bandwidth * GB, n,
                           element_bytes)
    end, exposed = rows[-1]["ready"], sum(r["exposed"] for r in rows)
    fig, ax = plt.subplots(figsize=(8, 3.1), layout="constrained")
    ms = 1e3
    for k, r in enumerate(rows):  # backward, cut where each bucket is complete
        before = rows[k - 1]["ready"] if k else 0.0
        ax.barh(1, (r["ready"] - before) * ms, left=before * ms, height=0.5, ec="white", lw=0.5,
                color="tab:orange" if k % 2 == 0 else "moccasin")
        hidden = r["all_reduce"] - r["exposed"]
        ax.barh(0, hidden * ms, left=r["start"] * ms, height=0.5, color="tab:green", ec="white",
                lw=0.5)
        ax.barh(0, r["exposed"] * ms, left=(r["start"] + hidden) * ms, height=0.5,
                color="tab:red", ec="white", lw=0.5)
    ax.axvline(end * ms, color="black", lw=0.8, ls="--")
    ax.set_yticks([0, 1], ["all-reduce\n(comm thread)", "backward\n(a bucket each)"])
    patch = lambda c: plt.Rectangle((0, 0), 1, 1, color=c)  # noqa: E731
    ax.legend([patch("tab:orange"), patch("moccasin"), patch("tab:green"), patch("tab:red"),
               plt.Line2D([], [], color="black", lw=0.8, ls="--")],
              ["backward: a bucket's gradients", "(shades alternate by bucket)",
               "all-reduce hidden under backward", "all-reduce exposed (after backward)",
               "backward ends"],
              fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set(xlabel="time from backward's start (ms)", ylim=(-0.6, 1.6),
           title=f"{len(rows)} buckets of at most {bucket_mb:.3g} MiB: exposed "
                 f"{exposed * ms:.2f} ms after backward ({end * ms:.1f} ms)")
    ax.grid(axis="x", alpha=0.3)
    return [png(fig), text(
        f"{len(rows)} buckets, {sum(r['bytes'] for r in rows):,} B; link {bandwidth:.3g} GB/s, "
        f"{latency:.3g} µs a step, {n} ranks: all-reduces "
        f"{sum(r['all_reduce'] for r in rows) * ms:.2f} ms in all, exposed {exposed * ms:.2f} ms "
        "(red: after backward's end, dashed)")]


def bucket_overlap(numels: list[int], arrivals: list[float], alpha: float, beta: float,
                   n: int = 2, bucket_mb: float = 0.1, element_bytes: int = 4) -> w.VBox:
    """The bucket size (MiB, log), the link's bandwidth (GB/s) and latency (µs a ring step),
    alpha and beta by default: `bucket_timeline`'s buckets on a timeline against backward, the
    part of each all-reduce after backward ends in red, their total in the title."""
    gbs = min(max(beta / GB, 1e-3), 1e3)  # (a fit can give beta = inf: no bandwidth limit seen)
    controls = {
        "bucket_mb": w.FloatLogSlider(value=bucket_mb, base=2, min=-12, max=3, step=0.25,
                                      description="bucket MiB", readout_format=".3g"),
        "bandwidth": w.FloatLogSlider(value=gbs, base=10, min=-3, max=3, step=0.05,
                                      description="link GB/s", readout_format=".3g"),
        "latency": w.FloatLogSlider(value=min(max(alpha * 1e6, 0.1), 1e4), base=10, min=-1,
                                    max=4, step=0.05, description="latency µs",
                                    readout_format=".3g")}
    return _panel(controls, lambda **v: _bucket_draw(numels, arrivals, n, element_bytes, **v))


# ----------------------------------------------------------------------------- 02: loss scaling

def fp16_fates(g: torch.Tensor, log2_scale: float) -> dict:
    """|g| x 2^log2_scale, in fp32, cast to fp16 by torch (x.half()): the share of elements that
    become 0 (at or below 2^-25), stay subnormal (below 2^-14), are normal, become inf (at or
    above 65520), and the mean relative error of the nonzero finite ones, unscaled."""
    x = g.detach().abs().float().flatten()
    x = x[x > 0]
    scaled = x * 2.0**log2_scale
    h = scaled.half().float()
    share = lambda mask: mask.float().mean().item()  # noqa: E731
    finite = torch.isfinite(h) & (h != 0)
    return dict(zero=share(h == 0), subnormal=share((h != 0) & (h < FP16_MIN_NORMAL)),
                normal=share(finite & (h >= FP16_MIN_NORMAL)), overflow=share(torch.isinf(h)),
                rel_error=((h[finite] - scaled[finite]).abs() / scaled[finite]).mean().item()
                if finite.any() else float("nan"), count=x.numel())


def _loss_scale_draw(g: torch.Tensor, name: str, log2_scale: int) -> list:
    fates = fp16_fates(g, log2_scale)
    x = g.detach().abs().float().flatten()
    log2 = x[x > 0].log2().numpy()
    bins = np.arange(-40, 26, 0.5)
    fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
    ax.hist(log2, bins, alpha=0.35, color="grey", label="unscaled")
    ax.hist(log2 + log2_scale, bins, alpha=0.7, label=f"× 2^{log2_scale}")
    ax.axvspan(bins[0], -25, color="crimson", alpha=0.12, label="fp16 → 0 (≤ 2^-25)")
    ax.axvspan(-25, -14, color="orange", alpha=0.12, label="fp16 subnormal")
    ax.axvspan(np.log2(FP16_INF), bins[-1], color="crimson", alpha=0.25,
               label="fp16 → inf (≥ 65520)")
    ax.set(xlabel="log2 |gradient × scale| (log2 of the value)", ylabel="count (elements)",
           title=f"{name} × 2^{log2_scale}: → 0 {fates['zero']:.1%}, subnormal "
                 f"{fates['subnormal']:.1%}, inf {fates['overflow']:.1%}")
    ax.legend(fontsize="small", loc="upper left")
    return [png(fig), text(
        f"scale 2^{log2_scale}, {fates['count']:,} nonzero gradients in fp16: → 0 "
        f"{fates['zero']:.2%}, subnormal {fates['subnormal']:.2%}, normal {fates['normal']:.2%}, "
        f"→ inf {fates['overflow']:.2%}; mean relative error {fates['rel_error']:.2e}")]


def loss_scale(grads, log2_scale: int = 16) -> w.VBox:
    """A loss-scale slider (log2 S, 0..24) over `grads` (a tensor, or {name: tensor} with a
    picker): the histogram of |g| x S and what fp16 makes of it (`fp16_fates`)."""
    grads = grads if isinstance(grads, dict) else {"gradients": grads}
    controls = {"name": w.Dropdown(options=list(grads), description="gradients"),
                "log2_scale": w.IntSlider(value=log2_scale, min=0, max=24,
                                          description="log2 scale")}
    return _panel(controls, lambda name, log2_scale: _loss_scale_draw(grads[name], name,
                                                                       log2_scale))


# ----------------------------------------------------------------------------- 03: ZeRO memory

def zero_memory(psi: float = 7.5e9, n_d: int = 64, stage: int = 3,
                precision: str = "bf16, 16-bit grads") -> dict[str, float]:
    """Model states per device, bytes by category: `memory.model_states` at
    `memory.layout_bytes`' bytes a parameter for `precision` (a key of PRECISIONS). The default
    is the ZeRO paper's 7.5B parameters on 64 GPUs, stage 3: 16 Psi / 64 = 1.875 GB."""
    return memory.model_states(psi, n_d, stage, memory.layout_bytes(*PRECISIONS[precision]))


def _zero_draw(psi: float, n_d: int, stage: int, precision: str) -> list:
    fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    names = ["DP (0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for s in range(4):
        states, bottom = zero_memory(psi, n_d, s, precision), 0.0
        for (cat, v), colour in zip(states.items(), colours):
            ax.bar(s, v / GB, 0.6, bottom=bottom, color=colour,
                   alpha=1.0 if s == stage else 0.35, ec="black" if s == stage else "none")
            bottom += v / GB
        ax.text(s, bottom, f"{bottom:,.3g} GB", ha="center", va="bottom", fontsize=8)
    for gb, gpu in ((32, "V100 32 GB"), (80, "A100/H100 80 GB")):
        ax.axhline(gb, ls="--", color="grey", lw=0.8)
        ax.text(3.45, gb, gpu, fontsize=7, va="bottom", ha="right", color="dimgrey")
    ax.set_xticks(range(4), names)
    ax.set(ylabel="model states per device (GB, 1e9 bytes)",
           title=f"Ψ = {psi:.3g} parameters, N_d = {n_d}, {precision}\n"
                 f"(chosen stage solid, others faded)")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colours[:len(states)]], list(states),
              fontsize="small", loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    got, per = zero_memory(psi, n_d, stage, precision), memory.layout_bytes(*PRECISIONS[precision])
    return [png(fig), text(f"stage {stage}, {' + '.join(map(str, per.values()))} bytes a "
                           f"parameter: " + ", ".join(f"{c} {v / GB:,.4g} GB" for c, v in
                                                       got.items())
                           + f"; total {sum(got.values()) / GB:,.4g} GB per device")]


def zero_memory_widget(psi: float = 7.5e9, n_d: int = 64, stage: int = 3,
                       precision: str = "bf16, 16-bit grads") -> w.VBox:
    """Psi (1e8..1e12, log), N_d (powers of 2 to 1024), the stage and the precision: model
    states per device, stacked by category, for every stage (the chosen one solid)."""
    controls = {
        "psi": w.FloatLogSlider(value=psi, base=10, min=8, max=12, step=0.025,
                                description="Ψ (params)", readout_format=".3g"),
        "n_d": w.SelectionSlider(options=[2**i for i in range(11)], value=n_d,
                                 description="N_d (GPUs)"),
        "stage": w.ToggleButtons(options=[("DP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2),
                                          ("ZeRO-3", 3)], value=stage, description="stage"),
        "precision": w.Dropdown(options=list(PRECISIONS), value=precision,
                                description="precision")}
    return _panel(controls, _zero_draw)


# ----------------------------------------------------------------------------- 04: TP traffic

def tp_layer(t: int = 8, h: int = 12288, s: int = 2048, b: int = 1, bandwidth: float = 450.0,
             e: int = 2, achieved: float = ACHIEVED) -> dict[str, float]:
    """Lesson 04's `per_layer`, one layer and micro-batch on a TP rank: `sent` = 8 b s h e (t-1)/t
    bytes (four all-reduces of b s h e bytes), `comm` = sent / bandwidth (GB/s) seconds,
    `compute` = 72 b s h^2 (1 + s / (6h)) / t FLOPs at `achieved` FLOP/s, `ratio` = comm /
    compute = e (t-1) achieved / (9 h bandwidth (1 + s / (6h)))."""
    sent = 8 * b * s * h * e * (t - 1) / t
    compute = 72 * b * s * h * h * (1 + s / (6 * h)) / t / achieved
    comm = sent / (bandwidth * GB)
    return dict(sent=sent, comm=comm, compute=compute, ratio=comm / compute)


def _tp_draw(t: int, h: int, s: int, b: int, bandwidth: float, e: int) -> list:
    degrees = list(range(2, 17))
    fig, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
    same = [k for k, gbs in LINKS.items() if np.isclose(gbs, bandwidth, rtol=0.01)]
    for (link, gbs), style in zip(LINKS.items(), (":", "-.", "--")):
        if link not in same:  # a preset the chosen link is not: it would hide under the blue line
            ax.plot(degrees, [tp_layer(d, h, s, b, gbs, e)["ratio"] for d in degrees], style,
                    color="grey", label=f"{link}, {gbs:g} GB/s")
    ax.plot(degrees, [tp_layer(d, h, s, b, bandwidth, e)["ratio"] for d in degrees], "-",
            lw=2, label=f"this link{' (' + same[0] + ')' if same else ''}, {bandwidth:.3g} GB/s")
    got = tp_layer(t, h, s, b, bandwidth, e)
    if t > 1:
        ax.plot([t], [got["ratio"]], "o", color="crimson", ms=8, label=f"t = {t}")
    ax.axhline(1, color="black", lw=0.8)
    ax.axvline(8, color="green", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.text(8.1, 0.02, " 8 GPUs: one NVLink node", fontsize=7, va="bottom",
            transform=ax.get_xaxis_transform())  # x in data, y in axes coordinates
    ax.set(xlabel="tensor-parallel degree t", ylabel="communication time / compute time",
           title=f"one layer: h {h}, s {s}, b {b}, {e} bytes an element")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, which="both")
    return [png(fig), text(
        f"t = {t}: {got['sent'] / 1e6:,.2f} MB sent per layer and micro-batch, comm "
        f"{got['comm'] * 1e3:.3f} ms at {bandwidth:.3g} GB/s, compute {got['compute'] * 1e3:.3f} "
        f"ms at {ACHIEVED / 1e12:.0f} TFLOP/s: comm / compute {got['ratio']:.3f}")]


def tp_comm(t: int = 8, h: int = 12288, s: int = 2048, b: int = 1,
            bandwidth: float = 450.0) -> w.VBox:
    """t, h, s, b, bytes an element and the link (presets or GB/s): `tp_layer`'s comm / compute
    by t for this link and the presets, the chosen t marked. GPT-3 175B over NVLink by default."""
    hs = [768, 1024, 1600, 2048, 2560, 4096, 5120, 8192, 12288, 16384, 20480]
    controls = {"t": w.IntSlider(value=t, min=1, max=16, description="t (TP ranks)"),
                "h": w.SelectionSlider(options=sorted({*hs, h}), value=h, description="h"),
                "s": w.SelectionSlider(options=sorted({512, 1024, 2048, 4096, 8192, s}), value=s,
                                       description="s (tokens)"),
                "b": w.IntSlider(value=b, min=1, max=16, description="b (micro-batch)"),
                "bandwidth": w.FloatLogSlider(value=bandwidth, base=10, min=0, max=3,
                                              step=0.01, description="link GB/s",
                                              readout_format=".3g"),
                "e": w.ToggleButtons(options=[("bf16", 2), ("fp32", 4)], value=2,
                                     description="elements")}
    preset = w.ToggleButtons(options=[(f"{k} ({v:g} GB/s)", v) for k, v in LINKS.items()],
                             value=None, description="link preset")
    preset.observe(lambda c: c.new and setattr(controls["bandwidth"], "value", c.new),
                   names="value")
    return _panel(controls, _tp_draw, (preset,))


# ----------------------------------------------------------------------------- 06: 3D layouts

def factorisations(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp x tp x pp = world, in order."""
    return [(d, t, world // (d * t)) for d in range(1, world + 1) for t in range(1, world + 1)
            if world % (d * t) == 0]


def layout_3d(dp: int, tp: int, pp: int) -> dict:
    """Mesh(dp, tp, pp): "coords", each rank's (dp_rank, tp_rank, pp_rank), and "groups",
    {axis: Mesh.axis_groups(axis)}, and "member", {axis: [the index of each rank's group]}."""
    mesh = Mesh(dp, tp, pp)
    groups = {axis: mesh.axis_groups(axis) for axis in ("tp", "dp", "pp")}
    member = {axis: [next(i for i, g in enumerate(gs) if r in g) for r in range(mesh.world)]
              for axis, gs in groups.items()}
    coords = [mesh.coords(r) for r in range(mesh.world)]
    return dict(coords=[(c.dp_rank, c.tp_rank, c.pp_rank) for c in coords], groups=groups,
                member=member)


def _layout_draw(layout: tuple[int, int, int]) -> list:
    dp, tp, pp = layout
    got = layout_3d(dp, tp, pp)
    labels = {r: f"TP group {got['member']['tp'][r]}\nDP group {got['member']['dp'][r]}\n"
                 f"PP group {got['member']['pp'][r]}" for r in range(dp * tp * pp)}
    fig = viz_3d.rank_grid(Mesh(dp, tp, pp), labels)
    lines = [f"rank {r:>2}: dp {c[0]}, tp {c[1]}, pp {c[2]}" for r, c in enumerate(got["coords"])]
    lines += [f"{axis} groups: {gs}" for axis, gs in got["groups"].items()]
    return [png(fig), text("\n".join(lines))]


def layout_3d_widget(world: int = 8, layout: tuple[int, int, int] = (2, 2, 2)) -> w.VBox:
    """A world size (1..16) and one of its dp x tp x pp factorisations (only those are offered):
    viz_3d's rank grid with each rank's groups, and each rank's coordinates printed."""
    name = lambda f: f"dp {f[0]} × tp {f[1]} × pp {f[2]}"  # noqa: E731
    pick = w.Dropdown(options=[(name(f), f) for f in factorisations(world)],
                      value=layout if layout in factorisations(world) else None,
                      description="layout")
    size = w.IntSlider(value=world, min=1, max=16, description="world (ranks)")
    quiet = {"on": False}  # while the world changes the options: one redraw, at the end
    box = _panel({"layout": pick},
                 lambda layout: box.out.outputs if quiet["on"] else _layout_draw(layout), (size,))

    def on_world(change):
        shapes = factorisations(change.new)
        quiet["on"] = True
        try:
            pick.options = [(name(f), f) for f in shapes]
            pick.value = min(shapes, key=lambda f: (max(f) - min(f), f))  # the most even one
        finally:
            quiet["on"] = False
        box.redraw()

    size.observe(on_world, names="value")
    box.controls = {"layout": pick, "world": size}
    return box


# ----------------------------------------------------------------------------- 10: scheduling

def schedule(traces: dict, clusters: dict, trace: str | None = None, cluster: str | None = None,
             policy: str = "minipar", rate=None, done: dict | None = None) -> w.VBox:
    """A trace ({name: jobs}), a cluster mix ({name: {kind: chips}}) and a policy picked:
    `scheduler.simulate`'s Result drawn (viz_scheduler.panel), or why it cannot run. rate(job
    type, kind, count): the throughput matrix's (default: the planner's, scheduler.rate); done:
    {(trace, cluster, policy): Result} already simulated, where each new one is kept too."""
    done = {} if done is None else done

    def draw(trace: str, cluster: str, policy: str) -> list:
        key = (trace, cluster, policy)
        if key not in done:
            jobs, caps = traces[trace], clusters[cluster]
            try:
                matrix = scheduler.throughput_matrix(jobs, caps, rate=rate or scheduler.rate)
                done[key] = scheduler.simulate(jobs, caps, policy, rates=matrix)
            except ValueError as e:   # e.g. a job whose scale fits no kind of the mix
                return [text(f"{policy} on {cluster}, {trace}: {e}")]
        return viz_scheduler.panel(done[key], traces[trace], f"{policy} on {cluster}, {trace}")

    pick = lambda name, options, value: w.Dropdown(  # noqa: E731
        options=list(options), value=value or next(iter(options)), description=name)
    controls = {"trace": pick("trace", traces, trace),
                "cluster": pick("cluster", clusters, cluster),
                "policy": pick("policy", scheduler.POLICIES, policy)}
    return _panel(controls, draw)
