"""Which pods hold which prefix blocks: the index the router scores prefill pods with.

Keys are the 64-bit block hashes KV events carry. Each pod keeps a count per hash (an engine
may hold two blocks with one hash; the hash stays hittable until both are removed). Torch-free
and thread-safe: the subscriber thread writes, router request handlers read.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

Pod = Hashable


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, set[Pod]] = {}
        self._per_pod: dict[Pod, Counter[int]] = {}

    def store(self, pod: Pod, block_hashes: Iterable[int]) -> None:
        with self._lock:
            counts = self._per_pod.setdefault(pod, Counter())
            for h in block_hashes:
                counts[h] += 1
                self._holders.setdefault(h, set()).add(pod)

    def remove(self, pod: Pod, block_hashes: Iterable[int]) -> None:
        """Forget one copy of each hash; unknown hashes are ignored (stores may predate us)."""
        with self._lock:
            counts = self._per_pod.get(pod)
            if counts is None:
                return
            for h in block_hashes:
                if counts[h] > 1:
                    counts[h] -= 1
                    continue
                counts.pop(h, None)
                holders = self._holders.get(h)
                if holders is not None:
                    holders.discard(pod)
                    if not holders:
                        del self._holders[h]

    def clear_pod(self, pod: Pod) -> None:
        """Drop every entry of `pod` (AllBlocksCleared, restart, pod gone)."""
        with self._lock:
            counts = self._per_pod.pop(pod, None)
            if counts is None:
                return
            for h in counts:
                holders = self._holders[h]
                holders.discard(pod)
                if not holders:
                    del self._holders[h]

    def longest_prefix_match(self, block_hashes: Sequence[int]) -> dict[Pod, int]:
        """For each pod holding the first block: how many leading blocks of `block_hashes` it holds."""
        matched: dict[Pod, int] = {}
        with self._lock:
            if not block_hashes:
                return matched
            active = set(self._holders.get(block_hashes[0], ()))
            for depth, h in enumerate(block_hashes[1:], start=1):
                if not active:
                    break
                holders = self._holders.get(h, set())
                for pod in active - holders:
                    matched[pod] = depth
                active &= holders
            for pod in active:
                matched[pod] = len(block_hashes)
        return matched

    def block_count(self, pod: Pod) -> int:
        """Distinct hashes `pod` holds."""
        with self._lock:
            return len(self._per_pod.get(pod, ()))

    def pods(self) -> set[Pod]:
        with self._lock:
            return {pod for pod, counts in self._per_pod.items() if counts}
