"""Graph transforms that change the float model before calibration: equalization, SmoothQuant, AWQ."""
