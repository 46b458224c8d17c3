"""What the strategy explorer (explorer.py) draws, as Output widget outputs and HTML: set from any
thread, in any kernel, without a frontend's display machinery.

    text(s), png(fig)       one output each (the figure is closed)
    summary(est, best)      the estimate as a line of HTML, and as JSON in `data-estimate` (for
                            browser tests)
    ab(a, b)                layout A beside B: step, MFU, memory and each term, with B / A
    plots(est, best, pinned) the knobs' step-time bars beside the winner's and A's, memory per
                            stage, the simulated pipeline
    ranking(estimates)      the plan as a table, and why each runner-up loses
    measured(est, result)   a "Run here" run beside the prediction: memory per rank, the step, the
                            pipeline
"""
from __future__ import annotations

import base64
import html
import io
import json
import statistics
import time

import matplotlib.pyplot as plt

from minipar.lessons import viz, viz_pipeline, viz_planner
from minipar.mesh import Mesh
from minipar.pipeline import Timeline
from minipar.planner import TERMS, explain, format_table
from minipar.planner.cluster import flops_unit, memory_unit
from minipar.planner.published import checked_by

MAX_BOXES = 3000  # the Gantt draws one box per action: above this many it is left out (seconds)
SHAPE = ("n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden", "seq_len", "vocab_size")
SWEEPS = ("none", "micro_batch", "tp", "pp", "zero")  # what a sweep can move (`Explorer.sweep`)


def shape_of(cfg) -> dict:
    """The model's sizes as the dashboard shows them (key/value heads and FFN width resolved:
    GPTConfig's None means n_head and 4 d_model), its MLP and whether the embeddings are tied."""
    return {**{k: getattr(cfg, k) for k in SHAPE}, "n_kv_head": cfg.kv_heads,
            "ffn_hidden": cfg.ffn_dim, "mlp": cfg.mlp, "tie_embeddings": cfg.tie_embeddings}
KNOBS = ("dp", "tp", "pp", "schedule", "virtual_stages", "zero", "recompute", "precision",
         "sequence_parallel",
         "micro_batch", "dp_mode", "bucket_mb", "collectives", "reduce_fp32")


def text(s: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": s.rstrip("\n") + "\n"}


def png(fig) -> dict:
    """A figure as an Output widget's output (PNG), and closed: set from any thread, in any kernel.
    Drawn at 120 dpi, shown at 72 px an inch: the dashboard's layout, sharp on any screen."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    width = round(fig.get_figwidth() * 72)
    return {"output_type": "display_data", "metadata": {"image/png": {"width": width}},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                     "text/plain": "<Figure>"}}


def summary(est, best) -> str:
    """The estimate as a line of text, and as JSON in `data-estimate`
    (for tests that read the page)."""
    if est is None:
        return ""
    par, cfg = est.par, est.cfg
    data = dict(label=est.label, step_time=est.step_time, mfu=est.mfu, tflops=est.tflops_per_gpu,
                memory=est.peak_memory, capacity=est.capacity, fits=est.fits,
                micro_batch=est.micro_batch,
                global_batch=est.global_batch, cluster=est.cluster.name, nodes=est.cluster.nodes,
                gpus=est.cluster.world, breakdown=est.breakdown,
                model=shape_of(cfg), checked=checked_by(est),
                **{k: getattr(par, k) for k in KNOBS if k != "micro_batch"})
    vs = f", {est.step_time / best.step_time:.3f}x the winner's" if best else ""
    fits = "fits" if est.fits else "<b style='color:#b00'>does NOT fit</b>"
    attribute = html.escape(json.dumps(data), quote=True)
    check = (f"checked: {html.escape(data['checked'])}" if data["checked"] else
             "<b style='color:#b60'>&#9888; unchecked</b>: no measurement has checked this "
             "combination's prediction")
    return (f"<div data-estimate='{attribute}'><b>{html.escape(est.label)}</b> "
            f"({html.escape(par.precision)}) on {html.escape(est.cluster.name)}: step "
            f"<b>{est.step_time:.4g} s</b>{vs}; MFU <b>{est.mfu:.1%}</b>, "
            f"{rate(est.flops_per_gpu)} a GPU; fullest GPU "
            f"<b>{size(est.peak_memory)}</b> of {size(est.capacity)} usable: {fits}"
            f"<br><span class='minipar-checked'>{check}</span></div>")


def size(n: float) -> str:
    unit, name = memory_unit(n)
    return f"{n / unit:.2f} {name}"


def rate(flops: float) -> str:
    unit, name = flops_unit(flops)
    return f"{flops / unit:.3g} {name}"


def ab(a, b) -> str:
    """Layout A (pinned) beside B (the knobs): step, MFU, memory and each term, with B / A."""
    if a is None or b is None:
        return "<i>pin a layout as A to compare it with the knobs' (B) side by side</i>"
    unit, name = memory_unit(a.peak_memory, b.peak_memory)
    rows = [("step s", a.step_time, b.step_time), ("MFU", a.mfu, b.mfu),
            (name, a.peak_memory / unit, b.peak_memory / unit)]
    rows += [(t, a.breakdown[t], b.breakdown[t]) for t in TERMS]
    cells = "".join(f"<tr><td>{name}</td><td>{x:.4g}</td><td>{y:.4g}</td>"
                    f"<td>{f'{y / x:.3f}' if x else '-'}</td></tr>" for name, x, y in rows)
    return (f"<table><tr><th></th><th>A: {html.escape(a.label)}</th><th>B: "
            f"{html.escape(b.label)}</th><th>B / A</th>"
            f"</tr>{cells}</table>")


def _calibration(est) -> str:
    """How old the calibration is that `est` was timed with (this machine's cores and gloo)."""
    cpu = est.cluster.cpu
    if cpu is None or not cpu.measured_at:
        return "calibrated at an unknown time" if cpu else "a GPU preset, not this machine"
    return (f"this machine calibrated {(time.time() - cpu.measured_at) / 60:.0f} min ago "
            "(planner.this_machine(refresh=True) measures it again)")


def measured(est, res) -> list[dict]:
    """A run's measurements beside `est`'s predictions: memory of every rank (`memory.predict`, per
    rank: the planner's per-stage figure is its DP rank 0, the fullest
    under ZeRO), the step, the pipeline."""
    par = est.par
    coords = [Mesh(par.dp, par.tp, par.pp, rank=r).coords() for r in range(par.world)]
    predicted = res.predicted_memory or [est.stages[c.pp_rank] for c in coords]
    pairs = {f"rank {r}": pair for r, pair in enumerate(zip(predicted, res.peak_memory))}
    steps = res.step_times[1:] or res.step_times
    median = statistics.median(steps)
    out = [text(f"{res.summary()}\nstep: predicted {est.step_time * 1e3:.1f} ms, measured "
                f"{median * 1e3:.1f} ms (median of {len(steps)}), measured / predicted "
                f"{median / est.step_time:.2f}; {_calibration(est)}"),
           png(viz.memory_compare({"predicted (left) and measured (right)": pairs},
                                  title="memory per rank"))]
    if par.pp > 1:  # the last step's pipeline of replica 0, measured, over the predicted one
        first = [r for r, c in enumerate(coords) if c.dp_rank == 0 and c.tp_rank == 0]
        measured = Timeline.from_events([res.spans[r]
                                         for r in sorted(first, key=lambda r: coords[r].pp_rank)])
        predicted = est.timeline
        fig, axes = plt.subplots(2, 1, figsize=(10, 1.6 + 0.9 * par.pp), sharex=True,
                                 layout="constrained")
        viz_pipeline.gantt(predicted, ax=axes[0], unit="s",
                           title=f"predicted: {predicted.makespan:.4f} s")
        viz_pipeline.gantt(measured, ax=axes[1], unit="s",
                           title=f"measured (last step): {measured.makespan:.4f} s")
        axes[0].set_xlabel("")  # the shared time axis is labelled once, under the bottom panel
        axes[1].set_xlim(0, max(predicted.makespan, measured.makespan))
        out.append(png(fig))
    return out


def plots(est, best, pinned) -> list[dict]:
    """The knobs' estimate drawn: its step cut into terms beside the plan's winner and the pinned
    layout A, its memory per GPU of each stage, and its pipeline as simulated
    (left out above MAX_BOXES actions)."""
    if est is None:
        return []
    bars = {"winner: " + best.label: best} if best else {}
    if pinned is not None:
        bars["A: " + pinned.label] = pinned
    bars["knobs: " + est.label] = est
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 3.4), width_ratios=[3, 2],
                                     layout="constrained")
    viz_planner.breakdown(bars, ax=ax_t)
    viz_planner.memory_stages(est, ax=ax_m, title="memory per GPU of each stage (the knobs)")
    out = [png(fig)]
    ops = 3 if est.par.schedule == "zb-h1" else 2  # F, B (and W) per micro-batch and chunk
    boxes = est.par.pp * est.par.virtual_stages * max(est.shares) * ops
    if boxes > MAX_BOXES:
        return out + [text(f"(the Gantt chart is left out: {boxes} actions to draw)")]
    tl = est.timeline
    title = f"{est.label}, simulated: bubble {tl.bubble:.1%}"
    return out + [png(viz_pipeline.gantt(tl, title=title, unit="s"))]


def sweep(knob: str, points: list, current) -> list[dict]:
    """Step time and memory of the knobs' layout against one knob (`Explorer.sweep`'s points:
    (value, Estimate or the rule it breaks)), the usable memory as a line (in the legend when
    over 20x the fullest), the knobs' value marked; values that break a rule are listed under
    the plot."""
    good = [(v, e) for v, e in points if not isinstance(e, str)]
    if knob == "none" or not good:
        return []
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 2.8), layout="constrained")
    values = [v for v, _ in good]
    xs = [str(v) for v in values]
    peaks, capacity = [e.peak_memory for _, e in good], good[0][1].capacity
    off = 0 < 20 * max(peaks) < capacity  # a line that far up would flatten the points: words
    unit, name = memory_unit(*peaks) if off else memory_unit(*peaks, capacity)
    ax_t.plot(xs, [e.step_time for _, e in good], "o-", color="#4c72b0")
    ax_m.plot(xs, [p / unit for p in peaks], "o-", color="#dd8452")
    if off:
        ax_m.plot([], [], ls="none", label=f"usable: {capacity / unit:,.0f} {name}, off the scale")
    else:
        ax_m.axhline(capacity / unit, color="black", lw=1, ls="--", label="usable")
    for ax, what in ((ax_t, "step time (s)"), (ax_m, f"{name} on the fullest GPU")):
        ax.set(xlabel=knob, ylabel=what)
        ax.grid(alpha=0.3)
        if current in values:
            ax.axvline(xs[values.index(current)], color="#999", lw=6, alpha=0.3)
    ax_m.legend(fontsize=7)
    ax_t.set_title(f"the knobs' layout with {knob} swept (grey: now)", fontsize=10, loc="left")
    broken = [f"{knob}={v}: {e}" for v, e in points if isinstance(e, str)]
    return [png(fig)] + ([text("not shown:\n" + "\n".join(broken))] if broken else [])


def ranking(estimates: list, plan_error: str | None) -> list[dict]:
    """The planner's ranked layouts (the fastest ten) and `explain`'s reasons, or why none fits."""
    if plan_error:
        return [text(plan_error)]
    return [text(f"{len(estimates)} layouts fit; the fastest ten:\n"
                 f"{format_table(estimates, top=10)}\n\n" + explain(estimates))]
