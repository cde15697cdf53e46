"""What attention needs to know about one step, shared by every layer of that step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from baton_engine.core.scheduler_output import SchedulerOutput


@dataclass
class AttentionBatch:
    """One step's row layout, on the host (numpy) and on the device (tensors).

    Row ``i`` owns query tokens ``query_start_loc[i]:query_start_loc[i+1]`` and attends over
    cache positions ``[0, seq_lens[i])``; query token ``t`` sees positions ``<= positions[t]``.
    """

    block_size: int
    num_decode_rows: int
    query_start_loc: npt.NDArray[np.int64]
    seq_lens: npt.NDArray[np.int64]
    num_computed_tokens: npt.NDArray[np.int64]
    positions_host: npt.NDArray[np.int64]
    block_tables_host: npt.NDArray[np.int64]
    slot_mapping: torch.Tensor
    positions: torch.Tensor

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def from_scheduler_output(
        cls, out: SchedulerOutput, block_size: int, device: torch.device
    ) -> AttentionBatch:
        positions = np.ascontiguousarray(out.positions, dtype=np.int64)
        return cls(
            block_size=block_size,
            num_decode_rows=out.num_decode_rows,
            query_start_loc=np.asarray(out.query_start_loc, dtype=np.int64),
            seq_lens=np.asarray(out.seq_lens, dtype=np.int64),
            num_computed_tokens=np.asarray(out.num_computed_tokens, dtype=np.int64),
            positions_host=positions,
            block_tables_host=np.asarray(out.block_tables, dtype=np.int64),
            slot_mapping=torch.from_numpy(np.ascontiguousarray(out.slot_mapping, dtype=np.int64)).to(device),
            positions=torch.from_numpy(positions).to(device),
        )

    def slots_of(self, row: int, length: int) -> npt.NDArray[np.int64]:
        """Cache slots of positions ``[0, length)`` of `row`."""
        pos = np.arange(length, dtype=np.int64)
        blocks = self.block_tables_host[row, pos // self.block_size]
        slots: npt.NDArray[np.int64] = blocks * self.block_size + pos % self.block_size
        return slots
