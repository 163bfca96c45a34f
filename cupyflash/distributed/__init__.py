"""Attention over several GPUs: ring attention over NCCL, and a one-process multi-GPU split.

- `ring_attention` (with `ring_attention_forward` / `ring_attention_backward` /
  `ring_attention_vjp`): context parallelism, one process per GPU; each rank holds a shard
  of the sequence (`zigzag_shard` for causal attention) and the K/V shards pass around a
  ring of `Communicator` exchanges: `NcclCommunicator` (NCCL through CuPy, made by
  `from_env` in processes started by ``python -m cupyflash.distributed.launch``) or
  `LocalRing` (simulated ranks in one process, NumPy or CuPy, for tests).
- `multi_device_attention` / `multi_device_attention_vjp`: one process, query blocks
  split over the listed GPUs of this host.

See docs/distributed.md.
"""

from .comm import Communicator, LocalRing, NcclCommunicator, from_env
from .multi_device import multi_device_attention, multi_device_attention_vjp
from .ring import (RingContext, ring_attention, ring_attention_backward, ring_attention_forward,
                   ring_attention_vjp)
from .zigzag import zigzag_chunks, zigzag_shard, zigzag_unshard

__all__ = ["Communicator", "LocalRing", "NcclCommunicator", "RingContext", "from_env",
           "multi_device_attention", "multi_device_attention_vjp", "ring_attention",
           "ring_attention_backward", "ring_attention_forward", "ring_attention_vjp",
           "zigzag_chunks", "zigzag_shard", "zigzag_unshard"]
