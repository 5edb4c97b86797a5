"""The orchestration: one workspace per model, passes, calibration, the placement choice, builds, tune.

:mod:`qtool.api` holds the public signatures and calls in here. A run opens a
:class:`~qtool.pipeline.workspace.Workspace` (the prepared model, its weights, the config and
the plans), runs the passes (:mod:`qtool.pipeline.passes`), gets statistics
(:mod:`qtool.pipeline.calibrate`), chooses a placement (:mod:`qtool.pipeline.choose`) and builds
the model (:mod:`qtool.pipeline.build`).
"""
