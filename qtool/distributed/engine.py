"""The engine interface: run a function over items on workers, with progress and clear failures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from qtool.errors import QtoolError

Item = TypeVar("Item")
Result = TypeVar("Result")
# Runs on a worker: (item, report) -> result; ``report(n)`` says n more units of the item are done.
Work = Callable[[Item, Callable[[int], None]], Result]


@dataclass(frozen=True)
class EngineSpec:
    """Where the work runs: ``workers`` local processes, or the cluster behind ``scheduler``."""

    workers: int | None = None  # local worker processes to start (with scheduler: at most this many used)
    scheduler: str | None = None  # address of a running scheduler, e.g. tcp://10.0.0.5:8786
    threads: int = 1  # onnxruntime intra-op threads per worker

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise QtoolError(f"--workers must be at least 1, got {self.workers}")
        if self.threads < 1:
            raise QtoolError(f"--threads must be at least 1, got {self.threads}")
        if self.scheduler is not None:
            from qtool.distributed.address import parse_scheduler_address

            parse_scheduler_address(self.scheduler)  # its form, before any work

    @property
    def wanted(self) -> bool:
        """Whether the spec asks for an engine at all (else the work runs in this process)."""
        return self.workers is not None or self.scheduler is not None


class Engine(Protocol):
    """Runs independent pieces of one job; results come back in the order of the items."""

    workers: int  # how many items run at once
    threads: int  # intra-op threads each worker should use

    def run(
        self,
        work: Work[Item, Result],
        items: Sequence[Item],
        *,
        describe: Callable[[Item], str],
        on_progress: Callable[[int], None],
    ) -> list[Result]:
        """``work`` on every item; a QtoolError raised on a worker is raised here as it is.

        ``describe(item)`` names an item in the error raised when its worker dies.
        """
        ...
