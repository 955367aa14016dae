"""MindSpore (PyNative) backend of hyper-parallel: selected by ``HYPER_PARALLEL_PLATFORM=mindspore``.

See ``docs/mindspore.md``. Nothing here is imported unless the MindSpore backend is selected.
"""
