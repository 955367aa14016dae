"""Platform selection: the one place that decides which framework backs the library.

``HYPER_PARALLEL_PLATFORM=torch`` selects PyTorch, ``HYPER_PARALLEL_PLATFORM=mindspore`` selects
MindSpore (PyNative). Unset: PyTorch if it is installed, else MindSpore if that is installed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["get_platform", "SUPPORTED_PLATFORMS"]

SUPPORTED_PLATFORMS = ("torch", "mindspore")
_platform: Any = None


def _default_platform_name() -> str:
    """torch when it is installed, else mindspore when that is."""
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("mindspore") is not None:
        return "mindspore"
    return "torch"


def get_platform() -> Any:
    """Return the platform object (created once per process).

    Example::

        >>> from hyper_parallel.platform import get_platform
        >>> get_platform().name
        'torch'
    """
    global _platform
    if _platform is None:
        name = os.environ.get("HYPER_PARALLEL_PLATFORM", "").strip().lower() or _default_platform_name()
        if name == "torch":
            from hyper_parallel.platform.torch.platform import TorchPlatform

            _platform = TorchPlatform()
        elif name == "mindspore":
            from hyper_parallel.platform.mindspore.platform import MindSporePlatform

            _platform = MindSporePlatform()
        else:
            raise ValueError(
                f"HYPER_PARALLEL_PLATFORM={name!r} is not a known platform; "
                f"choose one of {SUPPORTED_PLATFORMS}."
            )
    return _platform
