"""The algorithms that rewrite the float model before calibration: equalization, SmoothQuant, then AWQ.

They run in ``calibrate`` and in ``quantize`` alike, so that statistics always describe the
model that gets quantized. Equalization (:mod:`.equalization`) depends on the weights only; the
statistics file records the pairs it equalized, and ``quantize --stats`` refuses a config that
equalizes others. SmoothQuant (:mod:`.smoothquant`) depends on the data (each activation channel's
abs max); those maxima are written into the statistics file, and ``quantize --stats`` smooths with
them instead of reading the data again. AWQ (:mod:`.awq`) reads its own float pass before quantizing.
SmoothQuant and AWQ share the graph edit (:mod:`.smoothing`) and the float-pass tap (:mod:`.channel_taps`).
"""
