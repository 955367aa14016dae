"""Why a swap candidate stays on the device: the keys of ``SwapManager().stats()['kept_bytes']``."""

from __future__ import annotations

import enum

__all__ = ["KeepReason"]


class KeepReason(str, enum.Enum):
    """Why a saved tensor stays on the device instead of being swapped.

    String-valued, so ``stats()`` stays JSON-friendly and ``stats()["kept_bytes"]["shared"]``
    works as well as ``stats()["kept_bytes"][KeepReason.SHARED]``.

    Example::

        >>> from hyper_parallel.core.keep_reason import KeepReason
        >>> KeepReason.SHARED == "shared", str(KeepReason.HOST_LIMIT)
        (True, 'host_limit')
    """

    PARAMETER = "parameter"            # a parameter (or a view of one), or an input being differentiated
    BUFFER = "buffer"                  # a buffer of the wrapped module (or a view of one)
    SHARED = "shared"                  # somebody else still holds the storage: copying frees nothing
    HOST_LIMIT = "host_limit"          # the host pool reached SwapManager().set_host_memory_limit
    POLICY_SAVE = "policy_save"        # a swap_wrapper policy answered MUST_SAVE / PREFER_SAVE
    UNSUPPORTED_TENSOR = "unsupported_tensor"  # a tensor type a byte copy cannot rebuild (sparse, nested, conj view...)
    ON_HOST = "on_host"                # already in host memory
    EMPTY = "empty"                    # a storage of zero bytes
    MODIFIED_IN_PLACE = "modified_in_place"  # changed in place after it was saved (backward raises)
    RELOADED = "reloaded"              # loaded back earlier in this step: offloading it again is a new save

    __str__ = str.__str__
    __format__ = str.__format__
