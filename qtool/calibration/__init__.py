"""Model + data -> statistics: sample folders, image preprocessing, the calibration pass."""
