"""Models + data -> measurements: accuracy metrics, per-layer error, latency per provider, gates."""
