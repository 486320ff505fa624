"""Process-group rendezvous that survives ``torchrun --max-restarts``.

[Note: one store per attempt]
Under torchrun the workers' process group uses the agent's TCPStore, which outlives a
restart, while torch (2.11-2.13) writes the group's keys (gloo's peer addresses, NCCL's unique
id) into it without a per-attempt prefix ("we create a new TCPStore for every retry"). After a
restart the new workers read the dead workers' addresses and fail with "connectFullMesh ...
Connection refused". Prefixing the store with the restart count gives every attempt its own
keys; it is what makes fault recovery by restart work at all.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["attempt_store"]


def attempt_store(timeout: timedelta) -> Optional[Any]:
    """A store private to this torchrun attempt, or None outside torchrun's agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=int(os.environ.get("WORLD_SIZE", "1")), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/lightning_zero/attempt_{attempt}", store)
