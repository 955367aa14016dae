"""The engine is framework-neutral and reached from the public API by plain imports."""

import ast
import os
import subprocess
import sys

import hyper_parallel

PACKAGE = os.path.dirname(hyper_parallel.__file__)
CORE = os.path.join(PACKAGE, "core")
ENGINE_MODULES = sorted(f[:-3] for f in os.listdir(CORE) if f.endswith(".py") and f != "__init__.py")


def test_importing_the_engine_imports_no_framework():
    modules = ", ".join(f"hyper_parallel.core.{m}" for m in ENGINE_MODULES)
    code = (f"import sys, importlib\nfor m in '{modules}'.split(', '): importlib.import_module(m)\n"
            "print(sorted(n for n in ('torch', 'mindspore', 'numpy') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _imports(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            yield node, [node.module or ""]


def test_engine_imports_neither_a_framework_nor_a_backend_nor_by_string():
    for name in ENGINE_MODULES:
        path = os.path.join(CORE, name + ".py")
        source = open(path).read()
        assert "importlib" not in source and "__import__" not in source, name
        assert "def __getattr__" not in source, name
        for node, targets in _imports(path):
            for target in targets:
                root = target.split(".")[0]
                assert root not in ("torch", "mindspore"), f"{name} imports {target}"
                assert not target.startswith("hyper_parallel.backends"), f"{name} imports {target}"


def test_no_function_local_imports_in_engine_or_backends():
    roots = [CORE, os.path.join(PACKAGE, "backends")]
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                if not f.endswith(".py"):
                    continue
                tree = ast.parse(open(os.path.join(dirpath, f)).read())
                for fn in ast.walk(tree):
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        local = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
                        assert not local, f"{f}:{fn.name} imports inside a function"


PLANNER = os.path.join(PACKAGE, "planner")
#: The planner's framework parts are in the backends (``backends/*/prober.py``, the collectives of
#: ranks agreeing, the pipeline adapter, the target planner's meta-device trace, op costs and
#: calibration); every planner module (the probing algorithm, options, cost model, solver, plans,
#: ranks agreeing, pipeline stages, targets, roofline, allocator, the step model) and the tools it
#: uses import no framework.
PROBERS = (os.path.join(PACKAGE, "backends", "torch", "prober.py"), os.path.join(PACKAGE, "backends", "mindspore", "prober.py"))
NEUTRAL_PLANNER = sorted(f[:-3] for f in os.listdir(PLANNER) if f.endswith(".py") and f != "__init__.py")


def test_the_planner_but_its_framework_parts_imports_no_framework():
    assert {"chain_prober", "distributed", "pipeline", "planner", "memory_plan", "step_model", "roofline"} <= set(NEUTRAL_PLANNER)
    modules = ["hyper_parallel.planner"] + [f"hyper_parallel.planner.{m}" for m in NEUTRAL_PLANNER] + \
        ["hyper_parallel.tools.gc_pause"]
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(n for n in ('torch', 'mindspore') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    paths = [os.path.join(PLANNER, m + ".py") for m in NEUTRAL_PLANNER] + [os.path.join(PACKAGE, "tools", "gc_pause.py")]
    for path in paths:
        source = open(path).read()
        assert "importlib" not in source and "__import__" not in source and "def __getattr__" not in source, path
        for node, targets in _imports(path):
            for target in targets:
                assert target.split(".")[0] not in ("torch", "mindspore"), f"{path} imports {target}"
                assert not target.startswith("hyper_parallel.backends"), f"{path} imports {target}"


def test_each_prober_is_the_chain_prober_on_its_primitives():
    """The probers share the algorithm (``ChainProber``): each implements every primitive, and
    neither defines a method of the algorithm again (one path per behaviour)."""
    from hyper_parallel.planner.chain_prober import ChainProber
    from hyper_parallel.backends.torch.prober import TorchProber

    assert not TorchProber.__abstractmethods__
    shared = {name for name, value in vars(ChainProber).items()
              if callable(value) and not getattr(value, "__isabstractmethod__", False)}
    for path in PROBERS:
        tree = ast.parse(open(path).read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and any(ast.unparse(b) == "ChainProber" for b in n.bases)):
            again = sorted({f.name for f in cls.body if isinstance(f, ast.FunctionDef)} & shared)
            assert not again, f"{os.path.basename(path)}:{cls.name} defines {again} again"


def test_architecture_doc_lists_every_prober_primitive():
    from hyper_parallel.planner.chain_prober import ChainProber

    doc = open(os.path.join(os.path.dirname(PACKAGE), "docs", "architecture.md")).read()
    missing = sorted(name for name in ChainProber.__abstractmethods__ if f"`{name}`" not in doc)
    assert not missing, f"docs/architecture.md does not list the prober primitives {missing}"


def test_public_api_binds_the_torch_backend():
    from hyper_parallel.backends.torch.backend import TorchBackend
    from hyper_parallel.core import activation_checkpoint as api
    from hyper_parallel.core.backend import active_backend

    assert isinstance(active_backend(), TorchBackend)
    assert api.SwapManager().backend is active_backend()
    for name in api.__all__:
        assert getattr(api, name).__doc__, name


def test_architecture_doc_lists_every_backend_primitive():
    from hyper_parallel.core.backend import Backend

    doc = open(os.path.join(os.path.dirname(PACKAGE), "docs", "architecture.md")).read()
    missing = sorted(name for name in Backend.__abstractmethods__ if f"`{name}`" not in doc)
    assert not missing, f"docs/architecture.md does not list the backend primitives {missing}"


# Modules that cost import time (seconds together) and that only a program using them needs:
# nothing can be FSDP-sharded, compiled or pipelined before the user imported the module that does it.
HEAVY_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.pipelining",
                 "torch._dynamo", "sympy")


def test_importing_the_library_imports_nothing_heavy_the_program_did_not():
    code = ("import sys, torch\nbefore = {m for m in %r if m in sys.modules}\n"
            "import hyper_parallel.core.activation_checkpoint\n"
            "print(sorted(m for m in %r if m in sys.modules and m not in before))") % (HEAVY_MODULES, HEAVY_MODULES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_module_of_fsdp_imported_later_is_still_recognised():
    """The FSDP check looks the class up when it runs: a program that imports FSDP after the
    library still gets the clear error for a selective region around sharded units."""
    code = ("import sys, torch\nfrom hyper_parallel.backends.torch import _shim\n"
            "assert _shim.fsdp_module_class() is None\n"
            "from torch.distributed.fsdp import FSDPModule\n"
            "print(_shim.fsdp_module_class() is FSDPModule)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr


def test_both_probers_have_every_method_of_the_prober_protocol():
    """What the planner may call of a prober (``planner/prober.py``'s ``Prober``) exists on each
    framework's (read from the source: MindSpore need not be installed here), itself or inherited
    from ``ChainProber`` (MindSpore once lacked ``measure_step``)."""
    from hyper_parallel.planner.prober import Prober

    wanted = {name for name, value in vars(Prober).items() if callable(value) and not name.startswith("_")}

    def methods(path, name):
        tree = ast.parse(open(path).read())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        return {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}

    shared = methods(os.path.join(PLANNER, "chain_prober.py"), "ChainProber")
    assert {"profile_step", "probe", "op_seconds"} <= wanted
    for path, name in zip(PROBERS, ("TorchProber", "MindSporeProber")):
        missing = sorted(wanted - methods(path, name) - shared)
        assert not missing, f"{name} lacks {missing} of the Prober protocol"
