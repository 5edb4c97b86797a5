"""The plan: config + graph -> per-node schemes and placement.

Roles, placement, integer chains, activation qparams, kernel predictions and what inspect shows.
"""
