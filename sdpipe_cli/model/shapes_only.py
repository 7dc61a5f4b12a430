"""Building a model on the meta device for its shapes alone, without running its initialisers.

The launcher reads every model's blocks, parameter counts and boundaries on the meta device
(:func:`~sdpipe_cli.model.models.meta_blocks`) before any process starts.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ShapesOnly"]


class ShapesOnly(TorchFunctionMode):
    """Random initialisers do nothing to a meta tensor, which has no values to fill.

    They would cost nothing either, but for one: ``normal_``'s meta version lives in torch's
    Python references, and its first call imports them with torch's compiler and sympy: 1.0-1.3
    CPU-s (mlp, gpt_tiny) at the start of every command that reads a model's shapes (``sdpipe
    train``, ``resume``, ``simulate``, ``profile``, ``export``), where building the blocks takes
    ten milliseconds. Every builder's initialisation (its own, torch's defaults, Hugging Face's)
    goes through ``torch.nn.init`` or the in-place random fills below, so they are passed over.
    (A Hugging Face model imports the compiler with ``transformers`` anyway.)
    """

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.log_normal_,
                       torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.geometric_,
                       torch.Tensor.bernoulli_, torch.Tensor.random_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch.nn.init's functions come here whole, their tensor passed by name
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        fills = func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init"
        if fills and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)
