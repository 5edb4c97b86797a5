"""The measured choices, above evaluation/: the placement choice, the sensitivity search and tune.

Each builds candidate models through the plan and the rewrite (``qtool.quantization``), measures
them (``qtool.evaluation``) and keeps one: ``selection`` (the placement candidates, their timing,
the activation range rule, validation on held-out samples), ``search`` (the float fallback's
greedy sensitivity search) and ``tune`` (tune's search of per-node formats).
"""
