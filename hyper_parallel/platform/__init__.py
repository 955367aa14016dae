"""Platform selection: the one place that decides which framework backs the library.

``HYPER_PARALLEL_PLATFORM=torch`` (the default) selects PyTorch; ``mindspore`` is reserved for
the MindSpore backend, which is not available yet and fails with a clear error.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["get_platform", "SUPPORTED_PLATFORMS"]

SUPPORTED_PLATFORMS = ("torch", "mindspore")
_platform: Any = None


def get_platform() -> Any:
    """Return the platform object (created once per process).

    Example::

        >>> from hyper_parallel.platform import get_platform
        >>> get_platform().name
        'torch'
    """
    global _platform
    if _platform is None:
        name = os.environ.get("HYPER_PARALLEL_PLATFORM", "torch").strip().lower()
        if name == "torch":
            from hyper_parallel.platform.torch.platform import TorchPlatform

            _platform = TorchPlatform()
        elif name == "mindspore":
            raise RuntimeError(
                "HYPER_PARALLEL_PLATFORM=mindspore: the MindSpore backend is not implemented in "
                "this release; unset the variable or set it to 'torch'."
            )
        else:
            raise ValueError(
                f"HYPER_PARALLEL_PLATFORM={name!r} is not a known platform; "
                f"choose one of {SUPPORTED_PLATFORMS}."
            )
    return _platform
