"""Fresh tensor and node names: the one rule every rewrite uses to avoid a clash."""

from __future__ import annotations


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, else ``base_2``, ``base_3``, ...: the first not in ``taken``, which it joins."""
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
