"""The Mosaic GPU interpreter's parameters: the one place that imports them.

In jax 0.10 ``InterpretGPUParams`` is private (``jax._src.pallas.mosaic_gpu.interpret``);
importing it here alone keeps a rename in a later jax to one line.
"""

from __future__ import annotations

from typing import Any

from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

Interpret = bool | InterpretGPUParams


def interpret_params(interpret: Any) -> InterpretGPUParams | None:
    """``None`` to compile for the GPU, else the interpreter's params.

    ``True`` means the interpreter with default params; ``False`` / ``None`` compile.
    """
    if interpret is True:
        return InterpretGPUParams()
    if interpret is False or interpret is None:
        return None
    if not isinstance(interpret, InterpretGPUParams):
        raise TypeError(f"interpret must be a bool or InterpretGPUParams, got {interpret!r}")
    return interpret
