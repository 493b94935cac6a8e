"""The buffer component: staleness admission control, replay buffer and batch assembly.

Plain classes are exported here; the Ray actor lives in `asyncrl.buffer.actor` (imports ray).
"""

from asyncrl.buffer.core import BufferCore
from asyncrl.buffer.replay import BufferCounts, BufferFullError, ReplayBuffer
from asyncrl.buffer.staleness import SlotState, StalenessManager

__all__ = ["BufferCore", "BufferCounts", "BufferFullError", "ReplayBuffer", "SlotState", "StalenessManager"]
