"""Type stub of the compiled counting kernel (_counting.c)."""

from typing import Any

def scan(values: Any, radius: float, counts: Any, scratch: Any, /) -> tuple[float, float, bool]: ...
