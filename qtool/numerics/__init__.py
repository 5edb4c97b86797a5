"""The numbers: qparams and QuantizeLinear arithmetic.

Also 2/4/8-bit packing for MatMulNBits and the int8 weight fit to the AVX2 pair limit.
"""
