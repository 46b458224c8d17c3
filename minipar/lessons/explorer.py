"""The strategy explorer: one ipywidgets dashboard to compare parallel strategies (`explorer()`).

Inputs: a model (a preset fills its sizes, key/value heads, FFN width, MLP and tied embeddings;
editing one makes it custom), a cluster (a GPU preset
and its nodes, plus optionally nodes of a second kind: `Cluster.mixed`; or "this machine", its CPU
cores as `ranks` local gloo ranks, calibrated: `planner.this_machine`), a global batch, and every
ParallelConfig knob (the micro-batch size b stands for `microbatches` = global batch / (dp b)). On
each change it shows the layout's `estimate`: step time, MFU and memory of the fullest GPU; the step
cut into the planner's terms beside the plan's winner and a pinned layout "A"; the memory per GPU of
each pipeline stage by category against its capacity; the pipeline as simulated (Gantt); the
planner's ranked layouts and the term that makes each lose (`explain`); the layout's step time and
memory against one knob (`sweep`); whether a measurement has checked such a prediction
(`planner.published.checked_by`). A layout that breaks a rule shows its ValueError message instead.

"Run here" (this machine, a small model) trains the knobs' layout with `minipar.train` in a
background thread, with a progress bar, then draws the measured memory of every rank beside the
predicted one and, with a pipeline, the measured timeline of the last step beside the predicted one.

`render()` draws the state into the current cell output (a notebook run without a browser shows it);
a change in the dashboard redraws into its own outputs. CSS classes name the parts for tests that
drive it in a browser (tests/test_browser.py): minipar-explorer (the whole), minipar-knob-<knob>,
minipar-model, minipar-cluster, minipar-batch, minipar-summary (its element with `data-estimate`:
the estimate as JSON), minipar-checked, minipar-error, minipar-sweep, minipar-plots,
minipar-ranking, minipar-pin, minipar-ab, minipar-run, minipar-progress, minipar-measured.
"""
from __future__ import annotations

import base64
import html
import threading

import ipywidgets as w
from IPython.display import display

from minipar.config import COLLECTIVES, DP_MODES, PRECISIONS, RECOMPUTE, SCHEDULES, ParallelConfig
from minipar.lessons import explorer_html
from minipar.lessons.explorer_html import KNOBS, SHAPE, SWEEPS, shape_of
from minipar.model import GPTConfig
from minipar.planner import estimate, plan, sweep, this_machine
from minipar.planner import published
from minipar.planner.cluster import Cluster
from minipar.train import train

PUBLISHED = published.SIZES  # Korthikanti et al.'s Table 5 models, beside minipar's presets
SIZES = {**GPTConfig.PRESETS, **PUBLISHED}
THIS = "this machine"
QUICK = dict(micro_batches=(1, 2), schedules=("1f1b", "interleaved-1f1b"), virtual_stages=(2,),
             zero=(0, 1))
HERE = dict(micro_batches=(1, 2), schedules=("gpipe", "1f1b"), zero=(0, 1))  # times each layer
HERE_MAX_PARAMS = 30e6  # "this machine" profiles the model's layers in this process: small only
RUN_STEPS, RUN_TIMEOUT = 4, 300


def explorer(model: str = "llama3-8b", cluster: str = "dgx-a100-80g", nodes: int = 1,
             global_batch: int = 64, precision: str = "bf16", search: str = "full") -> "Explorer":
    """The dashboard (module docstring), starting at `plan`'s winner; display it as a cell's last
    value. cluster: a `Cluster.PRESETS` name or "this machine" (then `nodes` is its local ranks)."""
    return Explorer(model, cluster, nodes, global_batch, precision, search)


def _knob_controls(precision: str) -> dict:
    """One control per ParallelConfig knob (and the micro-batch), in KNOBS order."""
    small = dict(layout=w.Layout(width="200px"), style=dict(description_width="initial"))
    return {name: c.add_class(f"minipar-knob-{name}") for name, c in {
        "dp": w.BoundedIntText(min=1, max=4096, description="dp", **small),
        "tp": w.BoundedIntText(min=1, max=64, description="tp", **small),
        "pp": w.BoundedIntText(min=1, max=512, description="pp", **small),
        "schedule": w.Dropdown(options=SCHEDULES, description="schedule", **small),
        "virtual_stages": w.BoundedIntText(min=1, max=16, description="v", **small),
        "zero": w.Dropdown(options=[0, 1, 2, 3], description="ZeRO", **small),
        "recompute": w.Dropdown(options=RECOMPUTE, description="recompute", **small),
        "precision": w.Dropdown(options=PRECISIONS, value=precision, description="precision",
                                **small),
        "sequence_parallel": w.Checkbox(description="sequence parallel", indent=False, **small),
        "micro_batch": w.BoundedIntText(min=1, max=4096, description="micro-batch", **small),
        "dp_mode": w.Dropdown(options=DP_MODES, value="bucketed", description="DP mode",
                              **small),
        "bucket_mb": w.BoundedFloatText(value=25.0, min=0.01, max=1e6,
                                        description="bucket MiB", **small),
        "collectives": w.Dropdown(options=COLLECTIVES, description="collectives", **small),
        "reduce_fp32": w.Checkbox(value=True, description="reduce fp32 grads", indent=False,
                                  **small)}.items()}


class Explorer:
    """The dashboard of `explorer()`. `widget` is the box to display; `estimates` the ranked plan
    (empty when nothing fits: `plan_error` says why), `current` the knobs' estimate (None when they
    break a rule: `error` is its message), `pinned` layout A's, `result` the last "Run here"
    TrainResult."""

    def __init__(self, model="llama3-8b", cluster="dgx-a100-80g", nodes=1, global_batch=64,
                 precision="bf16", search="full"):
        if model not in SIZES or cluster not in [*Cluster.PRESETS, THIS]:
            raise ValueError(f"model must be one of {list(SIZES)} and cluster one of "
                             f"{[*Cluster.PRESETS, THIS]}, got {model!r}, {cluster!r}")
        self.model = w.Dropdown(options=[*SIZES, "custom"], value=model,
                                description="model").add_class("minipar-model")
        self.shape = {k: w.BoundedIntText(min=1, max=1_000_000, description=k,
                                          layout=w.Layout(width="180px"))
                      for k in SHAPE}
        self.mlp = w.Dropdown(options=["gelu", "swiglu"], description="mlp",
                              layout=w.Layout(width="180px"))
        self.tie = w.Checkbox(description="tied embeddings", indent=False,
                              layout=w.Layout(width="180px"))
        self.sweep_knob = w.Dropdown(options=SWEEPS, value="micro_batch",
                                     description="sweep").add_class("minipar-sweep")
        self.kind = w.Dropdown(options=[*Cluster.PRESETS, THIS], value=cluster,
                               description="cluster")
        self.kind.add_class("minipar-cluster")
        self.nodes = w.BoundedIntText(value=nodes, min=1, max=128, description="nodes")
        self.kind2 = w.Dropdown(options=["none", *Cluster.PRESETS], value="none",
                                description="+ nodes of")
        self.nodes2 = w.BoundedIntText(value=1, min=1, max=128, description="nodes")
        self.batch = w.BoundedIntText(value=global_batch, min=1, max=1_000_000,
                                      description="global batch",
                                      style=dict(description_width="initial"))
        self.batch.add_class("minipar-batch")
        self.search = w.ToggleButtons(options=["full", "quick"], value=search, description="search")
        self.pick = w.BoundedIntText(value=1, min=1, max=1, description="load plan #")
        self.knobs = _knob_controls(precision)
        self.summary = w.HTML().add_class("minipar-summary")
        self.error_box = w.HTML().add_class("minipar-error")
        self.pin_button = w.Button(description="pin as A", tooltip="keep this layout to compare")
        self.pin_button.add_class("minipar-pin")
        self.ab = w.HTML().add_class("minipar-ab")
        self.plots = w.Output().add_class("minipar-plots")
        self.ranking = w.Output().add_class("minipar-ranking")
        self.run_button = w.Button(description="Run here",
                                   button_style="success").add_class("minipar-run")
        self.progress = w.IntProgress(value=0, min=0, max=RUN_STEPS,
                                      description="steps").add_class("minipar-progress")
        self.measured = w.Output().add_class("minipar-measured")
        self.estimates, self.current, self.pinned, self._swept = [], None, None, (None, None, [])
        self.placement = None   # a mixed cluster's part order, from the plan entry loaded last
        self.error, self.plan_error = None, None
        self.result, self.run_error, self._thread, self._quiet = None, None, None, False
        self._fill_shape(SIZES[model])
        self.widget = self._layout()
        self._wire()
        self.replan()
        self.refresh()

    def _layout(self) -> w.VBox:
        """The dashboard: inputs, knobs, outputs, top to bottom."""
        widget = w.VBox([
            w.HTML("<b>Model, cluster, batch</b> (a preset fills the sizes; editing a size makes "
                   "the model custom; on this machine <i>nodes</i> counts local ranks)"),
            w.HBox([self.model, self.batch, self.search]),
            w.HBox([self.shape[k] for k in SHAPE[:4]]),
            w.HBox([*(self.shape[k] for k in SHAPE[4:]), self.mlp, self.tie]),
            w.HBox([self.kind, self.nodes, self.kind2, self.nodes2]),
            w.HTML("<b>The layout</b> (starts at the plan's winner; change any knob)"), self.pick,
            *(w.HBox([self.knobs[k] for k in KNOBS[i:i + 5]]) for i in range(0, len(KNOBS), 5)),
            self.summary, self.error_box, w.HBox([self.pin_button, self.ab]), self.sweep_knob,
            self.plots,
            w.HBox([self.run_button, self.progress]), self.measured,
            w.HTML("<b>The planner's ranking</b> and why each runner-up loses"), self.ranking])
        return widget.add_class("minipar-explorer")

    def _wire(self) -> None:
        """Every control redraws what it changes."""
        self.model.observe(self._on_model, names="value")
        for c in [*self.shape.values(), self.mlp, self.tie, self.kind, self.nodes, self.kind2,
                  self.nodes2, self.batch, self.search]:
            c.observe(self._on_plan, names="value")
        self.sweep_knob.observe(lambda _: self.refresh(), names="value")
        self.pick.observe(self._on_pick, names="value")
        for c in self.knobs.values():
            c.observe(self._on_knob, names="value")
        self.pin_button.on_click(lambda _: (self.pin(), self.refresh()))
        self.run_button.on_click(self._on_run)

    def _ipython_display_(self):
        display(self.widget)

    # --------------------------------------------------------------------- state

    def config(self) -> GPTConfig:
        return GPTConfig(**{k: self.shape[k].value for k in SHAPE}, mlp=self.mlp.value,
                         tie_embeddings=self.tie.value)

    def cluster(self, world: int | None = None) -> Cluster:
        """The cluster of the inputs; for this machine, calibrated for `world` ranks (or nodes)."""
        if self.kind.value == THIS:
            if self.config().num_params > HERE_MAX_PARAMS:
                raise ValueError("this machine times the model's own layers here: choose a model "
                                 f"of at most {HERE_MAX_PARAMS / 1e6:.0f}M parameters (tiny, "
                                 "small-cpu), or a "
                                 "GPU cluster")
            return this_machine(world=world or self.nodes.value)
        first = Cluster.preset(self.kind.value, nodes=self.nodes.value)
        if self.kind2.value == "none":
            return first
        return Cluster.mixed([first, Cluster.preset(self.kind2.value, nodes=self.nodes2.value)])

    def layout(self) -> tuple[ParallelConfig, int]:
        """(ParallelConfig, micro-batch size) of the knobs; ValueError if they break a rule."""
        k = {name: c.value for name, c in self.knobs.items()}
        b = k.pop("micro_batch")
        rows = k["dp"] * b
        if self.batch.value % rows:
            raise ValueError(f"the global batch ({self.batch.value}) must be a multiple of dp x "
                             f"micro-batch ({k['dp']} x {b} = {rows})")
        return ParallelConfig(**k, microbatches=self.batch.value // rows), b

    def replan(self) -> None:
        """Search again (model, cluster, batch, search or precision changed) and load the winner."""
        self.estimates, self.plan_error = [], None
        try:
            here = self.kind.value == THIS
            search = HERE if here else QUICK if self.search.value == "quick" else {}
            self.estimates = plan(self.config(), self.cluster(), self.batch.value,
                                  precision=self.knobs["precision"].value, **search)
        except ValueError as e:  # NoFeasiblePlan, a model size GPTConfig refuses, a model too big
                                 #   to time here
            self.plan_error = f"{type(e).__name__}: {e}"
        self._quiet = True
        self.pick.max = max(1, len(self.estimates))
        self._quiet = False
        self.load(1)

    def load(self, k: int) -> None:
        """Put plan #k's layout into the knobs (nothing to load when no plan fits)."""
        self._set(pick=k)
        e = self.estimates[k - 1] if self.estimates else None
        self.placement = e.cluster if e and e.cluster.groups else None   # (plan.placements)
        if e:
            self._set(**{f: getattr(e.par, f) for f in KNOBS if f != "micro_batch"},
                      micro_batch=e.micro_batch)
        self.update()

    def set(self, **knobs) -> None:
        """Set knobs by name (KNOBS) and re-estimate, without redrawing;
        then `render()` or `refresh()`."""
        unknown = set(knobs) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown knobs {sorted(unknown)}; choose from {KNOBS}")
        self._set(**knobs)
        self.update()

    def update(self) -> None:
        """The knobs' estimate, or the message of the rule they break."""
        self.current, self.error = None, None
        try:
            par, b = self.layout()
            on = self.placement or self.cluster(par.world)   # the loaded plan entry's part order
            self.current = estimate(self.config(), par, on, self.batch.value, b)
        except ValueError as e:
            self.error = f"ValueError: {e}"

    def sweep(self, knob: str) -> list[tuple]:
        """The knobs' layout with `knob` moved over its values (planner.sweep), once an estimate."""
        if knob == "none" or self.current is None:
            return []
        if self._swept[0] is not self.current or self._swept[1] != knob:
            cur, on = self.current, self.placement or self.cluster(self.current.par.world)
            self._swept = (cur, knob, sweep(self.config(), cur.par, on, self.batch.value,
                                            cur.micro_batch, knob))
        return self._swept[2]

    def pin(self) -> None:
        """Keep the knobs' estimate as layout A, shown beside every later one."""
        self.pinned = self.current

    def why_not_run(self) -> str | None:
        """Why "Run here" cannot train the knobs' layout now (None: it can)."""
        if self.kind.value != THIS:
            return "Run here trains on this machine: choose the cluster 'this machine'"
        if self.current is None:
            return "the layout breaks a rule"
        if not self.current.fits:
            return "the layout does not fit this machine's memory"
        if self._thread is not None and self._thread.is_alive():
            return "a run is in progress"
        return None

    def run_here(self, steps: int = RUN_STEPS, wait: bool = False) -> threading.Thread:
        """Train the knobs' layout here for `steps` steps in a background thread (wait: join it)."""
        reason = self.why_not_run()
        if reason:
            raise ValueError(f"cannot run here: {reason}")
        self.result, self.run_error, self.run_button.disabled = None, None, True
        self.progress.value, self.progress.max = 0, steps
        self.measured.outputs = (explorer_html.text(f"training {self.current.label} for {steps} "
                                                    "steps ..."),)
        self._thread = threading.Thread(target=self._run,
                                        args=(self.config(), self.current, steps), daemon=True)
        self._thread.start()
        if wait:
            self._thread.join()
        return self._thread

    def _run(self, cfg, est, steps) -> None:
        try:
            self.result = train(cfg, est.par, steps=steps, global_batch=est.global_batch,
                                timeout=RUN_TIMEOUT, on_step=lambda loss, tokens: setattr(
                                    self.progress, "value", self.progress.value + 1))
            self.measured.outputs = tuple(explorer_html.measured(est, self.result))
        except Exception as e:  # shown in the dashboard; the job's own traceback went to the log
            self.run_error = f"{type(e).__name__}: {e}"
            self.measured.outputs = (explorer_html.text(f"the run failed: {self.run_error}"),)
        finally:
            self.run_button.disabled = False

    # --------------------------------------------------------------------- drawing

    def outputs(self) -> tuple[list, list]:
        """(plots, ranking) as Output widget outputs: the knobs' figures and sweep, the plan."""
        best, knob = (self.estimates or [None])[0], self.sweep_knob.value
        of = self.current if knob == "micro_batch" else getattr(self.current, "par", None)
        return (explorer_html.plots(self.current, best, self.pinned)
                + explorer_html.sweep(knob, self.sweep(knob), getattr(of, knob, None)),
                explorer_html.ranking(self.estimates, self.plan_error))

    def refresh(self) -> None:
        """Redraw the dashboard's own outputs; the summary last, so that
        its numbers mean all is drawn."""
        error = f"<pre style='color:#b00'>{html.escape(self.error)}</pre>" if self.error else ""
        self.error_box.value = error
        self.ab.value = explorer_html.ab(self.pinned, self.current)
        reason = self.why_not_run()
        self.run_button.disabled = reason is not None
        self.run_button.tooltip = reason or "train it here"
        plots, ranking = self.outputs()
        self.plots.outputs, self.ranking.outputs = tuple(plots), tuple(ranking)
        self.summary.value = explorer_html.summary(self.current, (self.estimates or [None])[0])

    def render(self, ranking: bool = True) -> None:
        """Draw the state into the current cell output (for notebooks run without a browser)."""
        plots, ranked = self.outputs()
        if self.error:
            print(self.error)
        elif self.current is not None:
            display(w.HTML(explorer_html.summary(self.current, (self.estimates or [None])[0])))
        for out in plots + (ranked if ranking else []):
            if out["output_type"] == "stream":
                print(out["text"], end="")
            else:
                display({"image/png": base64.b64decode(out["data"]["image/png"])}, raw=True)

    # --------------------------------------------------------------------- callbacks

    def _set(self, **values) -> None:
        self._quiet = True
        try:
            for name, value in values.items():
                (self.pick if name == "pick" else self.knobs[name]).value = value
        finally:
            self._quiet = False

    def _fill_shape(self, sizes: dict) -> None:
        self._quiet = True
        try:
            shape = shape_of(GPTConfig(**sizes))
            for k in SHAPE:
                self.shape[k].value = shape[k]
            self.mlp.value, self.tie.value = shape["mlp"], shape["tie_embeddings"]
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
        if change["owner"] in (*self.shape.values(), self.mlp, self.tie):
            self._quiet = True
            self.model.value = "custom"
            self._quiet = False
        self.nodes.description = "ranks" if self.kind.value == THIS else "nodes"
        self.replan()
        self.refresh()

    def _on_pick(self, change) -> None:
        if not self._quiet:
            self.load(change["new"])
            self.refresh()

    def _on_run(self, _) -> None:
        try:
            self.run_here()
        except ValueError as e:  # the layout changed since the button was drawn
            self.measured.outputs = (explorer_html.text(str(e)),)

    def _on_knob(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.knobs["precision"]:  # what fits changes: rank again,
                                                        #   keep the knobs
            knobs = {name: c.value for name, c in self.knobs.items()}
            self.replan()
            self._set(**knobs)
        self.update()
        self.refresh()
