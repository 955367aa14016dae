"""Select the MindSpore backend (``HYPER_PARALLEL_PLATFORM=mindspore``) before anything imports
the library, and check that the public API bound it."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install() -> None:
    os.environ["HYPER_PARALLEL_PLATFORM"] = "mindspore"
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE)
    target = os.environ.get("HP_MS_DEVICE")  # e.g. "Ascend" to run the suite on an NPU
    if target:
        ms.set_device(target)
    from hyper_parallel.core.activation_checkpoint import selected_platform
    from hyper_parallel.core.backend import active_backend
    if selected_platform() != "mindspore" or active_backend().name != "mindspore":
        raise RuntimeError(f"expected the MindSpore backend, got {active_backend().name!r}")
