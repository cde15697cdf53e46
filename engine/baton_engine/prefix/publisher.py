"""KV-event publisher: ZMQ PUB of vLLM-format batches plus a ROUTER replay socket.

The engine step loop calls `publish` (never blocks: it only appends to a bounded queue); one
background thread owns both sockets, numbers batches from 0 in the order it sends them, keeps
the last ``buffer_steps`` payloads and answers replay requests (vLLM's protocol: the request is
the start sequence number as 8 bytes big-endian; the reply is one message per buffered batch
with ``seq >= start``, then an end marker). Events are encoded as maps and replays answered with
the topic (vLLM 0.32), or, with ``encoding="array"``, as vLLM v0.22 did both (for indexers of
that time); see `kv_events_wire`.

If the queue is full the batch is dropped, counted, and once the queue has drained the thread
publishes an ``AllBlocksCleared`` batch, so that subscribers forget this pod rather than keep an
index the lost events would have changed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import zmq

from baton_engine.prefix.wire import (
    ENCODING_MAP,
    KV_EVENT_ENCODINGS,
    REPLAY_FRAMING_OF,
    TAG_ALL_BLOCKS_CLEARED,
    encode_batch,
    encode_sequence,
    replay_answer,
    replay_end,
)

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_SNDHWM: Final = 100_000
DEFAULT_MAX_QUEUE: Final = 100_000
_IDLE_WAIT_S: Final = 0.05  # also the longest a replay request waits


class _CacheReset:
    """A record the wire encoder reads as AllBlocksCleared."""


_CacheReset.__name__ = TAG_ALL_BLOCKS_CLEARED


class KVEventPublisher:
    """Publishes batches on `endpoint` under `topic`; serves replays on `replay_endpoint`.

    Endpoints are bound; a port of ``*`` (``tcp://127.0.0.1:*``) picks a free one, readable from
    `endpoint` / `replay_endpoint` afterwards.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        replay_endpoint: str | None = None,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        sndhwm: int = DEFAULT_SNDHWM,
        max_queue: int = DEFAULT_MAX_QUEUE,
        data_parallel_rank: int = 0,
        encoding: str = ENCODING_MAP,
    ) -> None:
        if encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(KV_EVENT_ENCODINGS)}, got {encoding!r}")
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be at least 1, got {buffer_steps}")
        if sndhwm < 0:
            raise ValueError(f"sndhwm must be >= 0 (0 = unlimited), got {sndhwm}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self.encoding = encoding
        self._replay_framing = REPLAY_FRAMING_OF[encoding]
        self._queue: queue.Queue[tuple[float, Sequence[Any]] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._overflowed = threading.Event()
        self._closed = False
        self.dropped_batches = 0

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, sndhwm)
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def sndhwm(self) -> int:
        return int(self._pub.getsockopt(zmq.SNDHWM))

    def publish(self, events: Sequence[Any], ts: float | None = None) -> bool:
        """Queue one step's events (Baton's records); False if the queue was full and they were dropped."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is shut down")
        if not events:
            return True
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, tuple(events)))
        except queue.Full:
            self.dropped_batches += 1
            self._overflowed.set()
            logger.warning("KV-event queue full: dropped a batch of %d events", len(events))
            return False
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        # The sentinel may wait for room; the thread is draining, so it gets some.
        self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("KV-event publisher thread did not stop within %.1f s", timeout)
            return
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ sender thread

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                if self._overflowed.is_set():
                    self._overflowed.clear()
                    self._send(time.time(), (_CacheReset(),))
                continue
            if item is None:
                return
            self._send(*item)

    def _send(self, ts: float, events: Sequence[Any]) -> None:
        try:
            payload = encode_batch(events, ts=ts, data_parallel_rank=self._rank, encoding=self.encoding)
        except ValueError:
            logger.exception("dropping a KV-event batch that does not encode")
            return
        seq = self._next_seq
        self._next_seq += 1
        # PUB never blocks: past the high-water mark ZMQ drops for that subscriber, which then
        # sees a sequence gap and fills it from the replay buffer.
        self._pub.send_multipart((self._topic_bytes, encode_sequence(seq), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        request = self._replay.recv_multipart()
        # [client identity, empty delimiter, start sequence] (REQ/DEALER clients send the delimiter).
        if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
            logger.warning("ignoring malformed KV-event replay request of %d frames", len(request))
            return
        client = request[0]
        start = int.from_bytes(request[2], "big")
        framing = self._replay_framing
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, *replay_answer(self._topic_bytes, seq, payload, framing))
                )
        self._replay.send_multipart((client, *replay_end(framing)))
