"""Statistics + config -> rewritten model: the plan, qparams math, Q/DQ rewrite, kernel prediction."""
