"""cupyflash: exact FlashAttention for CuPy and NumPy arrays, forward and backward."""

from . import block_sparse, streaming
from .api import (AttentionContext, attention, attention_backward, attention_forward,
                  attention_vjp, manual_seed, precompile, streaming_plan, varlen_attention,
                  varlen_attention_forward, varlen_attention_vjp)
from .block_sparse import block_mask_density, butterfly_block_mask, local_global_block_mask
from .merge import merge_attention, merge_attention_vjp

__version__ = "0.1.0"

__all__ = ["AttentionContext", "attention", "attention_backward", "attention_forward",
           "attention_vjp", "block_mask_density", "block_sparse", "butterfly_block_mask",
           "local_global_block_mask", "manual_seed", "merge_attention", "merge_attention_vjp",
           "precompile", "streaming", "streaming_plan", "varlen_attention",
           "varlen_attention_forward", "varlen_attention_vjp", "__version__"]
