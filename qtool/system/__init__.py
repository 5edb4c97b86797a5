"""The machine and the file system: bounded reads, committed outputs, environment, stage timings."""
