"""The rewrite: a plan and its qparams -> the model with Q/DQ nodes.

Stored weight copies in their forms, the rewrite's report and the quantized key/value cache.
"""
