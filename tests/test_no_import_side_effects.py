"""Importing a module of hyper_parallel registers nothing: no listener, hook, dispatch mode, patch
or singleton comes from an import. The one thing an import does by design is the public API
module's binding of the selected framework's backend (``set_backend``), and even that backend
has made nothing yet (no prober, no swap manager)."""

import json
import os
import subprocess
import sys

import pytest

import hyper_parallel

PACKAGE = os.path.dirname(hyper_parallel.__file__)
ROOT = os.path.dirname(PACKAGE)


def _modules():
    """Every module of the package, found on disk (``pkgutil.walk_packages`` does not enter
    ``backends/``, a namespace package)."""
    names = []
    for dirpath, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                names.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(names)


#: What the process holds that an import could have registered, as JSON (run in the subprocess).
_STATE = r"""
import json, sys, torch
import torch.nn.modules.module as nn_module
from hyper_parallel.core import backend, swap_manager
from hyper_parallel.tools import memory
active = backend._ACTIVE
state = {
    "backend": None if active is None else type(active).__module__ + "." + type(active).__name__,
    "backend prober made": getattr(active, "_prober", None) is not None,
    "swap manager made": swap_manager.SwapManager._instance is not None,
    "dispatch modes": torch._C._len_torch_dispatch_stack(),
    "global module hooks": sorted(n for n in dir(nn_module) if n.startswith("_global_") and getattr(nn_module, n)),
    "host marks": len(memory._HOST_STORAGES),
    "meters running": len(memory._ACTIVE_CPU_TRACKERS),
    "storage resize patched": memory._resize_hook is not None,
    "mindspore imported": "mindspore" in sys.modules,
}
print(json.dumps(state))
"""


def _state_after(imports):
    code = "import importlib\nfor m in %r: importlib.import_module(m)\n" % (imports,) + _STATE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "HYPER_PARALLEL_PLATFORM": "torch"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_module_registers_nothing():
    try:
        import mindspore  # noqa: F401
        mindspore_missing = False
    except ImportError:
        mindspore_missing = True
    modules = [m for m in _modules() if not (mindspore_missing and m.startswith("hyper_parallel.backends.mindspore"))]
    assert "hyper_parallel.backends.torch.prober" in modules and "hyper_parallel.tools.memory" in modules
    state = _state_after(modules)
    assert state == {
        "backend": "hyper_parallel.backends.torch.backend.TorchBackend",  # bound by the public API module
        "backend prober made": False,
        "swap manager made": False,
        "dispatch modes": 0,
        "global module hooks": [],
        "host marks": 0,
        "meters running": 0,
        "storage resize patched": False,
        "mindspore imported": not mindspore_missing,
    }
    # the binding is the public API module's, and nothing else adds to it
    assert _state_after(["hyper_parallel.core.activation_checkpoint"]) == {**state, "mindspore imported": False}


def test_importing_the_package_alone_binds_no_backend():
    state = _state_after(["hyper_parallel"])
    assert state["backend"] is None and not state["swap manager made"]


_MS_STATE = r"""
import json
from hyper_parallel.backends.mindspore import prober
from hyper_parallel.core import backend, swap_manager
active = backend._ACTIVE
print(json.dumps({"backend": type(active).__name__, "backend prober made": active._prober is not None,
                  "swap manager made": swap_manager.SwapManager._instance is not None,
                  "host marks": len(prober.HOST_MARKS._count)}))
"""


def test_importing_the_mindspore_modules_registers_nothing():
    pytest.importorskip("mindspore", reason="MindSpore is not installed: its backend's modules import only with it")
    modules = [m for m in _modules() if m.startswith("hyper_parallel.backends.mindspore")]
    code = "import importlib\nimport hyper_parallel.core.activation_checkpoint\nfor m in %r: importlib.import_module(m)\n" \
        % (modules,) + _MS_STATE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "HYPER_PARALLEL_PLATFORM": "mindspore"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "backend": "MindSporeBackend", "backend prober made": False, "swap manager made": False, "host marks": 0}
