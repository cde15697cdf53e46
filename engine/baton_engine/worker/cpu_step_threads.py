"""How many intra-op threads each small CPU step runs on: one, or all of them, whichever is faster.

A decode step of a few rows is a sweep over the weights, bound by memory bandwidth. Whether a
second thread speeds it up depends on the host: on one 2-core VM one thread swept the weights at
9-12 GB/s and two at 15-17 GB/s; on another one thread alone was faster (22 against 27 ms a
token at one row), the second adding OpenMP wake-ups, ~150 parallel regions a step, and no
bandwidth. So the engine measures: steps of at most `SMALL_STEP_MAX_TOKENS` tokens are grouped
by size (1, 2, 3-4, 5-8 tokens), each group tries both counts on alternate steps until it has
`WARMUP_SAMPLES` of each, then runs the one whose recent median step time is lower and re-tries
the other on one step in `RECHECK_EVERY` (a neighbour that starts later, or a longer context,
changes the answer). Larger steps (prefill) are compute-bound and always use every thread.

Pure (no torch): the runner asks `threads_for`, runs the step, and reports its time to `record`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

SMALL_STEP_MAX_TOKENS = 8
"""The largest step whose thread count is measured; larger steps use every thread."""
WARMUP_SAMPLES = 3
"""Steps of each thread count a size group runs before it picks one."""
RECHECK_EVERY = 16
"""After warm-up, one step in this many runs the thread count not currently chosen."""
WINDOW = 8
"""Recent step times kept per thread count and size group (their median decides)."""


def size_group(num_tokens: int) -> int:
    """The group of a small step: the next power of two at or above its token count."""
    group = 1
    while group < num_tokens:
        group *= 2
    return group


@dataclass
class _Group:
    steps: int = 0
    """Steps this group has run (the recheck schedule counts them)."""
    times: dict[int, deque[float]] = field(default_factory=dict)
    """Thread count -> its recent step times, seconds."""


class StepThreadChooser:
    """Picks one thread or `all_threads` for each step of at most `SMALL_STEP_MAX_TOKENS` tokens."""

    def __init__(self, all_threads: int) -> None:
        if all_threads < 1:
            raise ValueError(f"all_threads must be >= 1, got {all_threads}")
        self.all_threads = all_threads
        self._groups: dict[int, _Group] = {}

    def threads_for(self, num_tokens: int) -> int:
        """The thread count to run a step of `num_tokens` tokens on."""
        if self.all_threads == 1 or num_tokens > SMALL_STEP_MAX_TOKENS:
            return self.all_threads
        group = self._groups.setdefault(size_group(num_tokens), _Group())
        counts = (self.all_threads, 1)
        samples = {n: len(group.times.get(n, ())) for n in counts}
        if min(samples.values()) < WARMUP_SAMPLES:
            return min(counts, key=lambda n: samples[n])  # the one with fewer samples; all on a tie
        chosen = self.chosen(num_tokens)
        assert chosen is not None
        if group.steps % RECHECK_EVERY == RECHECK_EVERY - 1:
            return 1 if chosen == self.all_threads else self.all_threads
        return chosen

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """Report that a step of `num_tokens` tokens took `seconds` on `threads` threads."""
        if self.all_threads == 1 or num_tokens > SMALL_STEP_MAX_TOKENS:
            return
        group = self._groups.setdefault(size_group(num_tokens), _Group())
        group.steps += 1
        group.times.setdefault(threads, deque(maxlen=WINDOW)).append(seconds)

    def chosen(self, num_tokens: int) -> int | None:
        """The thread count the group of `num_tokens` runs on after warm-up (None: still warming
        up); ties go to every thread."""
        if self.all_threads == 1 or num_tokens > SMALL_STEP_MAX_TOKENS:
            return self.all_threads
        group = self._groups.get(size_group(num_tokens))
        if group is None:
            return None
        times = [group.times.get(n) for n in (self.all_threads, 1)]
        if any(t is None or len(t) < WARMUP_SAMPLES for t in times):
            return None
        all_median, one_median = (statistics.median(t) for t in times if t is not None)
        return 1 if one_median < all_median else self.all_threads
