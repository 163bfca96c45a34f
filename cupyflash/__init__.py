"""cupyflash: exact FlashAttention for CuPy and NumPy arrays, forward and backward."""

from .api import (AttentionContext, attention, attention_backward, attention_forward,
                  attention_vjp, precompile)

__version__ = "0.1.0"

__all__ = ["AttentionContext", "attention", "attention_backward", "attention_forward",
           "attention_vjp", "precompile", "__version__"]
