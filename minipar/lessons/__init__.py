"""What the lessons use: the worker functions they launch, one plot module per lesson, their
controls and exercises, the explorer, and the static site (the CLI draws its loss curve with
viz.py, bench/ddp.py reuses demos' DP variants).

    demos.py, demos_dp.py, demos_precision.py, demos_zero.py, demos_tp.py, demos_pipeline.py,
    demos_3d.py, demos_debug.py, demos_hetero.py
                                             what the lessons measure (importable: ranks run them)
    viz.py                                   plots every lesson uses (loss curves, memory)
    viz_collectives.py (00)  viz_dp.py (01)  viz_zero.py (03)  viz_tp.py (04)  viz_pipeline.py (05)
    viz_3d.py (06)  viz_planner.py (07)      each lesson's own plots
    widgets.py                               controls over minipar's formulas (no processes)
    exercises.py (00, 05), exercises_dp.py (01), exercises_precision.py (02),
    exercises_zero.py (03), exercises_tp.py (04, 06), exercises_planner.py (07)
                                             graders; solutions.py: the reference answers
    explorer.py, explorer_html.py            the strategy explorer (08) and the HTML it shows
    site.py                                  `make docs`: the lessons as static pages
"""
