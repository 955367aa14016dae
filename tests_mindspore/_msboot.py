"""Select the MindSpore platform for the library before anything imports it.

``HYPER_PARALLEL_PLATFORM=mindspore`` selects it once ``hyper_parallel/platform/__init__.py``
knows the MindSpore backend; until then the platform object is installed directly (the core reads
it through ``get_platform()``, which returns an already-created platform as is)."""

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
    import hyper_parallel.platform as hp
    try:
        platform = hp.get_platform()
    except RuntimeError:  # this release's selector does not know MindSpore yet
        from hyper_parallel.platform.mindspore.platform import MindSporePlatform
        hp._platform = platform = MindSporePlatform()  # pylint: disable=protected-access
    if platform.name != "mindspore":
        raise RuntimeError(f"expected the MindSpore platform, got {platform.name!r}")
