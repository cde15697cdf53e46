"""KV-event subscriber (torch-free; the router uses it): many pods' event streams → a `PrefixIndex`.

One background **thread** owns every ZMQ socket (pyzmq sockets are not thread-safe): a SUB
socket per pod, plus a short-lived DEALER per replay request. Callers on any thread use
`add_pod`, `remove_pod`, `longest_prefix_match` and `stats`.

Per pod, batches are applied strictly in sequence order:

* the first batch seen (``seq > 0`` because we joined late, or the subscription was still on its
  way) → replay from 0 to fetch the history the publisher still buffers;
* a jump past the next expected number (the PUB high-water mark dropped some, or the network
  did) → replay from the expected number; what the replay cannot supply any more is lost, and
  the pod's index is dropped, since a lost removal would leave false hits;
* a live number not above the previous live number → the publisher restarted (numbers begin at
  0 per process): the pod's index is dropped and the new stream read from its start;
* ``AllBlocksCleared`` drops the pod's index; `remove_pod` drops it and closes the socket;
* a batch that does not decode is **rejected**: counted (``rejected_batches``, with the error),
  and the pod's index dropped, since the events it held are unknown.

Both of vLLM's encodings (maps since 0.32, arrays before) and both replay framings are read, per
batch and per reply (`kv_events_wire`).

Limitation: a restart whose first live number we see is already above the old stream's last one
looks like a gap, so the old stream's entries stay until a clear or `remove_pod` (the router
removes pods whose Kubernetes pod restarted); that costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import zmq

from baton_engine.prefix.index import PrefixIndex
from baton_engine.prefix.wire import (
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireFormatError,
    decode_batch,
    decode_sequence,
    encode_sequence,
    parse_replay_answer,
)

logger = logging.getLogger(__name__)

Pod = Hashable
_POLL_MS: Final = 50  # also the longest add_pod / remove_pod wait for the thread


@dataclass
class PodStreamStats:
    """What happened on one pod's stream (a copy; counters only grow)."""

    next_seq: int | None = None
    last_topic: str | None = None
    batches_applied: int = 0
    batches_replayed: int = 0
    gaps_filled: int = 0
    gaps_lost: int = 0
    restarts: int = 0
    clears: int = 0
    rejected_batches: int = 0  # did not decode (the pod's index was dropped each time)
    last_error: str | None = None  # why the last batch or replay reply was rejected
    encoding: str | None = None  # of the last batch applied: "map" or "array"


@dataclass
class _PodStream:
    pod: Pod
    endpoint: str
    replay_endpoint: str | None
    topic: str
    socket: zmq.Socket[bytes] | None = None
    last_live_seq: int | None = None
    stats: PodStreamStats = field(default_factory=PodStreamStats)


class KVEventSubscriber:
    def __init__(self, index: PrefixIndex | None = None, *, replay_timeout_s: float = 2.0) -> None:
        self.index = index if index is not None else PrefixIndex()
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._lock = threading.Lock()
        self._streams: dict[Pod, _PodStream] = {}
        self._commands: queue.Queue[tuple[str, _PodStream, threading.Event]] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller API

    def add_pod(
        self,
        pod: Pod,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        timeout: float = 5.0,
    ) -> None:
        """Subscribe to `pod`'s events (prefix filter `topic`); returns once the socket is connected."""
        stream = _PodStream(pod=pod, endpoint=endpoint, replay_endpoint=replay_endpoint, topic=topic)
        with self._lock:
            if pod in self._streams:
                raise ValueError(f"pod {pod!r} is already subscribed")
            self._streams[pod] = stream
        self._command("add", stream, timeout)

    def remove_pod(self, pod: Pod, timeout: float = 5.0) -> None:
        """Unsubscribe `pod` and drop its index entries (at once, before the socket closes)."""
        with self._lock:
            stream = self._streams.pop(pod, None)
            self.index.clear_pod(pod)
        if stream is not None:
            self._command("remove", stream, timeout)

    def longest_prefix_match(self, block_hashes: Sequence[int]) -> dict[Pod, int]:
        return self.index.longest_prefix_match(block_hashes)

    def stats(self, pod: Pod) -> PodStreamStats:
        with self._lock:
            stream = self._streams.get(pod)
            if stream is None:
                raise KeyError(f"pod {pod!r} is not subscribed")
            return replace(stream.stats)

    def pods(self) -> list[Pod]:
        with self._lock:
            return list(self._streams)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("KV-event subscriber thread did not stop within %.1f s", timeout)
            return
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _command(self, kind: str, stream: _PodStream, timeout: float) -> None:
        if self._stop.is_set():
            raise RuntimeError("KVEventSubscriber is closed")
        done = threading.Event()
        self._commands.put((kind, stream, done))
        if not done.wait(timeout):
            raise TimeoutError(f"subscriber thread did not {kind} pod {stream.pod!r} within {timeout} s")

    # ------------------------------------------------------------------ subscriber thread

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], _PodStream] = {}
        try:
            while not self._stop.is_set():
                self._run_commands(poller, by_socket)
                for sock, _ in poller.poll(_POLL_MS):
                    stream = by_socket.get(sock)
                    if stream is not None:
                        self._drain(stream)
        finally:
            for sock in by_socket:
                sock.close(linger=0)

    def _run_commands(self, poller: zmq.Poller, by_socket: dict[zmq.Socket[bytes], _PodStream]) -> None:
        while True:
            try:
                kind, stream, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt_string(zmq.SUBSCRIBE, stream.topic)
                sock.connect(stream.endpoint)
                stream.socket = sock
                by_socket[sock] = stream
                poller.register(sock, zmq.POLLIN)
            elif stream.socket is not None:
                poller.unregister(stream.socket)
                by_socket.pop(stream.socket, None)
                stream.socket.close(linger=0)
                stream.socket = None
            done.set()

    def _drain(self, stream: _PodStream) -> None:
        assert stream.socket is not None
        while True:
            try:
                msg = stream.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(msg) != 3:
                logger.warning("pod %r: ignoring a message of %d frames (expected 3)", stream.pod, len(msg))
                continue
            try:
                seq = decode_sequence(msg[1])
            except WireFormatError as exc:
                logger.warning("pod %r: %s", stream.pod, exc)
                continue
            stream.stats.last_topic = msg[0].decode("utf-8", "replace")
            self._on_live(stream, seq, msg[2])

    def _on_live(self, stream: _PodStream, seq: int, payload: bytes) -> None:
        stats = stream.stats
        if stream.last_live_seq is not None and seq <= stream.last_live_seq:
            logger.info(
                "pod %r: sequence went from %d to %d: publisher restarted",
                stream.pod,
                stream.last_live_seq,
                seq,
            )
            stats.restarts += 1
            self._reset(stream)
        stream.last_live_seq = seq
        if stats.next_seq is None and seq > 0:
            self._replay(stream, 0)
        elif stats.next_seq is not None and seq > stats.next_seq:
            if self._replay(stream, stats.next_seq):
                stats.gaps_filled += 1
        if stats.next_seq is None or seq >= stats.next_seq:
            self._apply(stream, seq, payload)

    def _reset(self, stream: _PodStream) -> None:
        with self._lock:
            stream.stats.next_seq = None
            if self._streams.get(stream.pod) is stream:
                self.index.clear_pod(stream.pod)

    def _replay(self, stream: _PodStream, start: int) -> bool:
        """Fetch buffered batches from `start` and apply them; True if they continued the stream."""
        if stream.replay_endpoint is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        contiguous = True
        try:
            dealer.connect(stream.replay_endpoint)
            dealer.send_multipart((b"", encode_sequence(start)))
            while True:
                if not dealer.poll(self._replay_timeout_ms):
                    logger.warning("pod %r: replay from %d timed out", stream.pod, start)
                    return False
                seq, payload = parse_replay_answer(dealer.recv_multipart())
                if seq == -1:
                    return contiguous
                stream.stats.batches_replayed += 1
                expected = stream.stats.next_seq
                if expected is not None and seq < expected:
                    continue
                if expected is not None and seq > expected:
                    contiguous = False
                self._apply(stream, seq, payload)
        except WireFormatError as exc:
            logger.warning("pod %r: bad replay reply: %s", stream.pod, exc)
            with self._lock:
                stream.stats.last_error = f"replay: {exc}"
            return False
        finally:
            dealer.close(linger=0)

    def _apply(self, stream: _PodStream, seq: int, payload: bytes) -> None:
        stats = stream.stats
        error = None
        try:
            batch = decode_batch(payload)
        except WireFormatError as exc:
            logger.warning("pod %r: rejected batch %d: %s", stream.pod, seq, exc)
            batch, error = None, f"batch {seq}: {exc}"
        with self._lock:
            if self._streams.get(stream.pod) is not stream:
                return  # removed meanwhile
            pod = stream.pod
            if stats.next_seq is not None and seq != stats.next_seq:
                # Batches stats.next_seq..seq-1 are gone: a lost removal would leave false hits.
                stats.gaps_lost += 1
                self.index.clear_pod(pod)
            stats.next_seq = seq + 1
            if batch is None:
                stats.rejected_batches += 1
                stats.last_error = error
                self.index.clear_pod(pod)
                return
            stats.batches_applied += 1
            stats.encoding = batch.encoding
            for event in batch.events:
                if isinstance(event, WireBlockStored):
                    self.index.store(pod, event.block_hashes)
                elif isinstance(event, WireBlockRemoved):
                    self.index.remove(pod, event.block_hashes)
                elif isinstance(event, WireAllBlocksCleared):
                    stats.clears += 1
                    self.index.clear_pod(pod)
