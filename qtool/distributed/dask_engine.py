"""The Dask distributed engine: a local cluster of worker processes, or a running scheduler.

Progress travels as worker events (``log_event`` on a per-run topic) that the client adds up;
a QtoolError raised on a worker comes back as it is (it names the sample that broke it); a
worker that dies is named with the item it was running; Ctrl-C cancels every task and stops
the local workers before it reaches the caller.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from qtool.distributed.address import probe_scheduler
from qtool.distributed.engine import EngineSpec, Item, Result, Work
from qtool.errors import QtoolError

log = logging.getLogger(__name__)

CONNECT_SECONDS = 10  # reaching a scheduler
WORKERS_SECONDS = 60  # a scheduler without workers waits this long for the first one
POLL_SECONDS = 0.1
INSTALL_HINT = "install the distributed extra: pip install 'qtool-onnx[distributed]'"


def _distributed() -> Any:
    try:
        import distributed
    except ImportError as e:
        raise QtoolError(f"--workers and --scheduler need Dask distributed ({e})", hint=INSTALL_HINT) from e
    return distributed


@contextmanager
def dask_engine(spec: EngineSpec) -> Iterator[DaskEngine]:
    """A :class:`DaskEngine` on ``spec``'s cluster; local workers are stopped on the way out."""
    distributed = _distributed()
    cluster = None
    quiet = logging.ERROR if not log.isEnabledFor(logging.DEBUG) else logging.INFO
    _drop_abandoned_dask_tasks()
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.worker"):
        logging.getLogger(name).setLevel(quiet)
    if spec.scheduler is not None:
        probe_scheduler(spec.scheduler)  # its form, and a scheduler answering there, before Dask is handed it
        try:
            client = distributed.Client(spec.scheduler, timeout=CONNECT_SECONDS, set_as_default=False)
        except Exception as e:  # noqa: BLE001 - whatever Dask raises on a bad peer: one line, no traceback
            raise QtoolError(
                f"cannot connect to the Dask scheduler at {spec.scheduler}: {type(e).__name__}: {e}",
                hint="start one with 'dask scheduler' and workers with 'dask worker ADDRESS'",
            ) from None
    else:
        assert spec.workers is not None  # a spec without scheduler or workers asks for no engine
        existing = set(_cluster_instances(distributed))
        try:
            cluster = distributed.LocalCluster(
                n_workers=spec.workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=quiet,
                preload=["qtool.pipeline.calibrate"],  # workers import qtool, onnx and onnxruntime while they start
            )
            client = distributed.Client(cluster, set_as_default=False)
        except BaseException:  # Ctrl-C while the workers start
            _close_started_clusters(distributed, existing)
            raise
    try:
        slots = _slots(client, spec)
        yield DaskEngine(client, slots, spec.threads)
    finally:
        with suppress(Exception):  # shutting down: a closing connection must not hide the real outcome
            client.close()
        if cluster is not None:
            with suppress(Exception):
                cluster.close()
            cluster.shutdown_on_close = False  # closed (or past saving): Dask's exit hook leaves it alone


class _AbandonedDaskTask(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a task Dask itself left behind.

    When several workers fail to start (Ctrl-C reaches their processes too), Dask raises the
    first failure and never retrieves the others, so asyncio prints their tracebacks at exit,
    after qtool has reported the outcome. Abandoned tasks of any other code are still logged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Task exception was never retrieved") or not record.exc_info:
            return True
        return not _raised_in_dask(record.exc_info[1])


def _raised_in_dask(error: BaseException | None) -> bool:
    """Whether ``error`` (or an exception it was raised from) was raised in Dask's own code."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback = error.__traceback__
        while traceback is not None:
            module = str(traceback.tb_frame.f_globals.get("__name__", ""))
            if module == "distributed" or module.startswith("distributed."):
                return True
            traceback = traceback.tb_next
        error = error.__cause__ or error.__context__
    return False


def _drop_abandoned_dask_tasks() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedDaskTask) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedDaskTask())


def _cluster_instances(distributed: Any) -> list[Any]:
    return list(getattr(distributed.SpecCluster, "_instances", ()))


def _close_started_clusters(distributed: Any, existing: set[Any]) -> None:
    """Close the local cluster interrupted while it started, so Dask's exit hook has none to close.

    A cluster whose workers are still starting fails Dask's own close at exit with a traceback;
    closing it here (its worker processes stop with it) and marking it done keeps the exit quiet.
    Clusters that existed before (a Python caller's own) are left alone.
    """
    for cluster in _cluster_instances(distributed):
        if cluster in existing:
            continue
        with suppress(BaseException):
            cluster.close(timeout=5)
        cluster.shutdown_on_close = False


def _slots(client: Any, spec: EngineSpec) -> int:
    """How many tasks the cluster runs at once (its workers' threads), at most ``spec.workers``."""
    threads = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    if threads == 0:
        try:
            client.wait_for_workers(1, timeout=WORKERS_SECONDS)
        except TimeoutError as e:
            raise QtoolError(
                f"the Dask scheduler at {spec.scheduler} has no workers (waited {WORKERS_SECONDS} s)",
                hint="start workers with 'dask worker ADDRESS'",
            ) from e
        threads = sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())
    return min(threads, spec.workers) if spec.workers else threads


class DaskEngine:
    """Runs work on a Dask cluster through ``client``."""

    def __init__(self, client: Any, workers: int, threads: int) -> None:
        self.client = client
        self.workers = workers
        self.threads = threads

    def run(
        self,
        work: Work[Item, Result],
        items: Sequence[Item],
        *,
        describe: Callable[[Item], str],
        on_progress: Callable[[int], None],
    ) -> list[Result]:
        distributed = _distributed()
        topic = f"qtool-progress-{uuid.uuid4().hex}"
        done_units: list[int] = []
        lock = threading.Lock()

        def heard(event: tuple[float, Any]) -> None:  # runs on the client's event loop thread
            with lock:
                done_units.append(int(event[1]))

        self.client.subscribe_topic(topic, heard)
        futures = [
            self.client.submit(_on_worker, work, item, topic, key=f"qtool-{topic[15:]}-{i}", pure=False)
            for i, item in enumerate(items)
        ]
        try:
            while True:
                with lock:
                    units, done_units[:] = sum(done_units), []
                if units:
                    on_progress(units)
                for future, item in zip(futures, items, strict=True):
                    if future.status == "error":
                        _raise_failure(future, describe(item), distributed)
                if all(f.done() for f in futures):
                    break
                time.sleep(POLL_SECONDS)
            return [future.result() for future in futures]
        except BaseException:
            with suppress(Exception):
                self.client.cancel(futures, force=True)
            raise
        finally:
            with suppress(Exception):
                self.client.unsubscribe_topic(topic)


def _raise_failure(future: Any, what: str, distributed: Any) -> None:
    error = future.exception()
    if isinstance(error, QtoolError):
        raise error
    if isinstance(error, distributed.KilledWorker):
        raise QtoolError(
            f"a Dask worker died while {what}",
            hint="the worker's log says why (memory, a crash in onnxruntime); the same item in one "
            "process (without --workers/--scheduler) shows the error",
        )
    raise error


def _on_worker(work: Work[Item, Result], item: Item, topic: str) -> Result:
    """Runs on a Dask worker: ``work`` with its progress sent to the client as events."""
    from distributed import get_worker

    worker = get_worker()
    return work(item, lambda units: worker.log_event(topic, units))
