"""Weight rounding and bias correction during the rewrite, from the inputs the calibration pass collected.

GPTQ, AdaRound, empirical and analytic bias correction.
"""
