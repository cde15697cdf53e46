"""Consumer pulls on a background thread, so the step loop never waits on the network.

The step loop `submit`s a job per request that reached WAITING_FOR_REMOTE_KV and collects
finished jobs with `take_finished` between steps. `cancel` (client gone) stops a job between
chunks and releases the producer's lease; a job's blocks must stay allocated until it is reported
finished, since the thread may still be writing into them.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from baton_engine.contract import KVTransferParams
from baton_engine.kv_transfer.consumer import KVTransferConsumer, PullResult, RankLayout
from baton_engine.kv_transfer.metrics import TransferStats
from baton_engine.kv_transfer.protocol import FailureReason, KVTransferError

log = logging.getLogger(__name__)


@dataclass
class PullJob:
    req_id: int
    params: KVTransferParams
    dst_block_ids: list[int]
    skip_blocks: int
    #: False on rank 0 of a tensor-parallel consumer: the lease ends once every rank pulled.
    end_lease: bool = True
    action: Literal["pull", "release", "finish"] = "pull"
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: PullResult | None = None
    error: KVTransferError | None = None


class BackgroundPuller:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        stats: TransferStats,
        timeout_s: float = 10.0,
        kv_key: str = "",
        layout: RankLayout | None = None,
    ) -> None:
        self._consumer = KVTransferConsumer(
            kv_cache, stats=stats, timeout_s=timeout_s, kv_key=kv_key, layout=layout
        )
        self._jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[PullJob] = []
        self._active: dict[int, PullJob] = {}
        self._thread = threading.Thread(target=self._run, name="kv-transfer-puller", daemon=True)
        self._thread.start()

    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._active[job.req_id] = job
        self._jobs.put(job)

    def cancel(self, req_id: int) -> bool:
        """Stop a submitted job; True if it was still running (it will be reported finished)."""
        with self._lock:
            job = self._active.get(req_id)
        if job is None:
            return False
        job.cancelled.set()
        return True

    def release(self, params: KVTransferParams) -> None:
        """Ask a producer to drop a lease nobody will pull (on this thread; fire and forget)."""
        self._jobs.put(PullJob(req_id=-1, params=params, dst_block_ids=[], skip_blocks=0, action="release"))

    def finish(self, params: KVTransferParams) -> None:
        """Tell a producer every rank pulled its lease (DONE, on this thread; fire and forget)."""
        self._jobs.put(PullJob(req_id=-1, params=params, dst_block_ids=[], skip_blocks=0, action="finish"))

    def take_finished(self) -> list[PullJob]:
        with self._lock:
            done, self._finished = self._finished, []
            for job in done:
                self._active.pop(job.req_id, None)
            return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.action == "release":
                if not self._consumer.release(job.params):
                    log.info("KV transfer: release of %s not acknowledged", job.params.transfer_id)
                continue
            if job.action == "finish":
                if not self._consumer.finish(job.params):
                    log.info("KV transfer: DONE of %s not acknowledged", job.params.transfer_id)
                continue
            try:
                if job.cancelled.is_set():
                    if job.end_lease:
                        self._consumer.release(job.params)
                    raise KVTransferError(FailureReason.CANCELLED, "request aborted before its pull")

                def check_cancel(_index: int, job: PullJob = job) -> None:
                    if job.cancelled.is_set():
                        raise KVTransferError(FailureReason.CANCELLED, "request aborted during its pull")

                job.result = self._consumer.pull(
                    job.params,
                    job.dst_block_ids,
                    skip_blocks=job.skip_blocks,
                    on_chunk=check_cancel,
                    end_lease=job.end_lease,
                )
            except KVTransferError as exc:
                job.error = exc
            except Exception as exc:  # never lose a job: the step loop must hear back
                log.exception("KV transfer: pull of %s crashed", job.params.transfer_id)
                job.error = KVTransferError(FailureReason.PROTOCOL, f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._finished.append(job)
