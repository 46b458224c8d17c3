"""Interactive explorers for the lessons (ipywidgets), built here so that a notebook cell stays one line.

    PlannerExplorer   lesson 07: a model size, a cluster (or two GPU kinds mixed) and a global batch give the
                      planner's ranked layouts (`plan`, `format_table`, `explain`); the layout's knobs (dp, tp,
                      pp, schedule, virtual stages, ZeRO, recompute, micro-batch, sequence parallel) start at
                      the winner and give its `estimate`: step-time breakdown beside the winner's, memory per
                      stage, and the simulated pipeline (Gantt). A rule the layout breaks prints its message.

`render()` draws the current state into the current cell output, so a notebook executed without a browser
(nbval, nbconvert) shows it; moving a control redraws into the explorer's own output area (a live kernel).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import ipywidgets as w
from IPython.display import display

from minipar import viz, viz_planner
from minipar.config import RECOMPUTE, SCHEDULES, ParallelConfig
from minipar.cost import GiB, Cluster
from minipar.model import GPTConfig
from minipar.planner import estimate, explain, format_table, plan

# the sizes of Korthikanti et al. 2022 Table 5 (V 51200, s 2048), beside the GPT-2 presets
PUBLISHED = {"22B": dict(n_layer=48, n_head=64, d_model=6144), "175B": dict(n_layer=96, n_head=96, d_model=12288),
             "530B": dict(n_layer=105, n_head=128, d_model=20480), "1T": dict(n_layer=128, n_head=160, d_model=25600)}
SIZES = {**{k: v for k, v in GPTConfig.PRESETS.items() if k.startswith("gpt2")},
         **{k: dict(v, vocab_size=51200, seq_len=2048) for k, v in PUBLISHED.items()}}
SHAPE = ("n_layer", "n_head", "d_model", "seq_len", "vocab_size")
QUICK = dict(micro_batches=(1, 2), schedules=("1f1b", "interleaved-1f1b"), virtual_stages=(2,), zero=(0, 1))
KNOBS = ("dp", "tp", "pp", "schedule", "virtual_stages", "zero", "recompute", "sequence_parallel", "micro_batch")
MAX_BOXES = 3000  # the Gantt draws one box per action: above this many it is left out (seconds to draw)


class PlannerExplorer:
    """The explorer of lesson 07 (module docstring). `widget` is the box to display; `estimates` the ranked
    plan, `current` the knobs' estimate (None when they break a rule) and `error` that rule's message."""

    def __init__(self, model: str = "gpt2-xl", cluster: str = "dgx-a100-80g", nodes: int = 1,
                 global_batch: int = 64, search: str = "full"):
        presets = list(Cluster.PRESETS)
        self.model = w.Dropdown(options=[*SIZES, "custom"], value=model, description="model")
        self.shape = {k: w.BoundedIntText(min=1, max=1_000_000, description=k, layout=w.Layout(width="180px"))
                      for k in SHAPE}
        self.kind = w.Dropdown(options=presets, value=cluster, description="GPUs")
        self.nodes = w.BoundedIntText(value=nodes, min=1, max=128, description="nodes")
        self.kind2 = w.Dropdown(options=["none", *presets], value="none", description="+ GPUs")
        self.nodes2 = w.BoundedIntText(value=1, min=1, max=128, description="nodes")
        self.batch = w.BoundedIntText(value=global_batch, min=1, max=1_000_000, description="global batch")
        self.search = w.ToggleButtons(options=["full", "quick"], value=search, description="search")
        self.pick = w.BoundedIntText(value=1, min=1, max=1, description="load plan #")
        opts = dict(layout=w.Layout(width="190px"))
        self.knobs = {"dp": w.BoundedIntText(min=1, max=4096, description="dp", **opts),
                      "tp": w.BoundedIntText(min=1, max=64, description="tp", **opts),
                      "pp": w.BoundedIntText(min=1, max=512, description="pp", **opts),
                      "schedule": w.Dropdown(options=SCHEDULES, description="schedule", **opts),
                      "virtual_stages": w.BoundedIntText(min=1, max=16, description="v", **opts),
                      "zero": w.Dropdown(options=[0, 1, 2, 3], description="ZeRO", **opts),
                      "recompute": w.Dropdown(options=RECOMPUTE, description="recompute", **opts),
                      "sequence_parallel": w.Checkbox(description="sequence parallel", **opts),
                      "micro_batch": w.BoundedIntText(min=1, max=4096, description="micro-batch", **opts)}
        self.out = w.Output()
        self.estimates, self.current, self.error, self.plan_error = [], None, None, None
        self._quiet = False
        self._fill_shape(SIZES[model])
        self.widget = w.VBox([
            w.HTML("<b>Model and cluster</b> (a preset fills the sizes; editing a size makes it custom)"),
            w.HBox([self.model, self.batch, self.search]),
            w.HBox([self.shape[k] for k in SHAPE]),
            w.HBox([self.kind, self.nodes]), w.HBox([self.kind2, self.nodes2]),
            w.HTML("<b>The layout</b> (starts at the plan's winner; change any knob)"), self.pick,
            w.HBox([self.knobs[k] for k in KNOBS[:4]]), w.HBox([self.knobs[k] for k in KNOBS[4:]]), self.out])
        self.model.observe(self._on_model, names="value")
        for c in [*self.shape.values(), self.kind, self.nodes, self.kind2, self.nodes2, self.batch, self.search]:
            c.observe(self._on_plan, names="value")
        self.pick.observe(self._on_pick, names="value")
        for c in self.knobs.values():
            c.observe(self._on_knob, names="value")
        self.replan()

    # --------------------------------------------------------------------- state

    def config(self) -> GPTConfig:
        return GPTConfig(**{k: self.shape[k].value for k in SHAPE})

    def cluster(self) -> Cluster:
        first = Cluster.preset(self.kind.value, nodes=self.nodes.value)
        if self.kind2.value == "none":
            return first
        return Cluster.mixed([first, Cluster.preset(self.kind2.value, nodes=self.nodes2.value)])

    def replan(self) -> None:
        """Search again (model, cluster, batch or search changed) and load the winner into the knobs."""
        self.estimates, self.plan_error = [], None
        try:
            self.estimates = plan(self.config(), self.cluster(), self.batch.value,
                                  **(QUICK if self.search.value == "quick" else {}))
        except ValueError as e:  # NoFeasiblePlan, or a model size GPTConfig refuses
            self.plan_error = f"{type(e).__name__}: {e}"
        self._quiet = True
        self.pick.max = max(1, len(self.estimates))
        self._quiet = False
        self.load(1)

    def load(self, k: int) -> None:
        """Put plan #k's layout into the knobs (nothing to load when no plan fits)."""
        self._set(pick=k)
        if self.estimates:
            e = self.estimates[k - 1]
            self._set(**{f: getattr(e.par, f) for f in KNOBS[:-1]}, micro_batch=e.micro_batch)
        self.update()

    def set(self, **knobs) -> None:
        """Set knobs by name (KNOBS) and re-estimate, without redrawing; then `render()` (here) or
        `refresh()` (the widget)."""
        unknown = set(knobs) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown knobs {sorted(unknown)}; choose from {KNOBS}")
        self._set(**knobs)
        self.update()

    def update(self) -> None:
        """The knobs' estimate, or the message of the rule they break."""
        self.current, self.error = None, None
        try:
            k = {name: c.value for name, c in self.knobs.items()}
            b = k.pop("micro_batch")
            par = ParallelConfig(**k, precision="bf16")
            self.current = estimate(self.config(), par, self.cluster(), self.batch.value, b)
        except ValueError as e:
            self.error = f"ValueError: {e}"

    # --------------------------------------------------------------------- drawing

    def render(self, ranking: bool = True) -> None:
        """Draw the ranked plan (unless ranking=False) and the knobs' layout into the current output."""
        try:
            cfg, cluster = self.config(), self.cluster()
        except ValueError:  # a custom size GPTConfig refuses: plan_error says why
            cfg = None
        if cfg is not None and ranking:
            each = "the smallest" if cluster.groups else "each"
            print(f"{cfg.num_params / 1e9:.2f}B parameters (l {cfg.n_layer}, h {cfg.d_model}, a {cfg.n_head}, "
                  f"s {cfg.seq_len}, V {cfg.vocab_size}) on {cluster.world} GPUs ({cluster.name}, "
                  f"{cluster.memory_per_gpu / GiB:.0f} GiB {each}), global batch {self.batch.value}, bf16\n")
        if self.plan_error:
            print(self.plan_error)
        elif ranking:
            print(f"{len(self.estimates)} layouts fit; the fastest ten:\n{format_table(self.estimates, top=10)}\n")
            print(explain(self.estimates) + "\n")
        if self.error:
            print(f"The layout in the knobs: {self.error}")
            return
        est, best = self.current, (self.estimates or [None])[0]
        print(f"The layout in the knobs: {est!r}" + ("" if est.fits else f", does NOT fit "
              f"{est.capacity / GiB:.0f} GiB") + (f"; {est.step_time / best.step_time:.3f}x the winner's step"
                                                  if best else ""))
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 3.4), width_ratios=[3, 2], layout="constrained")
        viz_planner.breakdown({"winner: " + best.label: best, "knobs: " + est.label: est} if best else
                              {est.label: est}, ax=ax_t)
        viz_planner.memory_stages(est, ax=ax_m, title="memory per GPU of each stage (the knobs)")
        display(fig)
        plt.close(fig)
        boxes = est.par.pp * est.par.virtual_stages * max(est.shares) * (3 if est.par.schedule == "zb-h1" else 2)
        if boxes > MAX_BOXES:
            print(f"(the Gantt chart is left out: {boxes} actions to draw)")
            return
        tl = viz_planner.timeline(est)
        print(f"The slowest replica's pipeline below takes {tl.makespan:.4g} s; then dp_comm "
              f"{est.breakdown['dp_comm']:.3g} s and the optimizer {est.breakdown['optimizer']:.3g} s")
        fig = viz.gantt(tl, title=f"{est.label}, simulated (s): bubble {tl.bubble:.1%}")
        display(fig)
        plt.close(fig)

    def refresh(self) -> None:
        """Redraw into the explorer's own output area."""
        with self.out:
            self.out.clear_output(wait=True)
            self.render()

    # --------------------------------------------------------------------- callbacks

    def _set(self, **values) -> None:
        self._quiet = True
        try:
            for name, value in values.items():
                control = self.pick if name == "pick" else self.knobs[name]
                control.value = value
        finally:
            self._quiet = False

    def _fill_shape(self, sizes: dict) -> None:
        self._quiet = True
        try:
            for k in SHAPE:
                self.shape[k].value = sizes.get(k, GPTConfig.PRESETS["gpt2-small"][k])
        finally:
            self._quiet = False

    def _on_model(self, change) -> None:
        if self._quiet or change["new"] == "custom":
            return
        self._fill_shape(SIZES[change["new"]])
        self.replan()
        self.refresh()

    def _on_plan(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] in self.shape.values():
            self._quiet = True
            self.model.value = "custom"
            self._quiet = False
        self.replan()
        self.refresh()

    def _on_pick(self, change) -> None:
        if not self._quiet:
            self.load(change["new"])
            self.refresh()

    def _on_knob(self, change) -> None:
        if not self._quiet:
            self.update()
            self.refresh()
