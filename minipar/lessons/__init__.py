"""What the lessons use: the worker functions they launch, one plot module per lesson, the
explorer (the CLI draws its loss curve with viz.py, bench/ddp.py reuses demos' DP variants).

    demos.py, demos_3d.py, demos_hetero.py, demos_pipeline.py, demos_tp.py, demos_dp.py
                                             small worker functions (importable: ranks run them)
    viz.py                                   plots every lesson uses (loss curves, memory)
    viz_collectives.py (00)  viz_dp.py (01)  viz_zero.py (03)  viz_tp.py (04)  viz_pipeline.py (05)
    viz_3d.py (06)  viz_planner.py (07)      each lesson's own plots
    explorer.py, explorer_html.py            the strategy explorer (08) and the HTML it shows
"""
