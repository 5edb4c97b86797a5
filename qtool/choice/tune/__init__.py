"""``qtool tune``: per-node sensitivity, a budgeted allocation of precisions, and the verification loop.

:mod:`space` (what a node may get), :mod:`sensitivity` (measured one node at a time),
:mod:`allocation` (the Lagrangian knapsack), :mod:`loop` (verify and move the budget),
:mod:`candidates` (scoring the builds), :mod:`configs` (allocations as QConfigDicts),
:mod:`metric` (the user's task metric). :func:`qtool.api.tune` joins them to calibration and the rewrite.
"""
