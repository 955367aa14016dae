"""Mutation audit of the stream ordering, run by hand (not in CI)::

    python -m hyper_parallel.testing.mutations              # every mutant, two at a time
    python -m hyper_parallel.testing.mutations --list       # the sites and their mutants only
    python -m hyper_parallel.testing.mutations --only swap_tensor.py --tests tests/test_ordering_points.py

It finds every ordering call site of ``hyper_parallel/core`` and ``hyper_parallel/backends`` by
pattern (in the syntax tree, not from a list of lines), makes each mutant in a scratch copy of the
tree, runs the ordering tests there (``pytest -x -q``, ``PYTHONPATH`` on the copy) and prints the
mutants no test caught, with file:line and the mutated source. Exit status 1 if any survived.
``docs/architecture.md`` records the last full result and why each survivor is harmless.

Sites and their mutants:

* a call of a stream primitive (``record_event``, ``wait_event``, ``wait_stream``,
  ``record_stream``, ``mark_used_by``) or of an engine ordering point (``_protect``, ``_order_*``);
  of what guards or returns a host buffer (``set_copy_event``, ``_release_host``, and ``release``
  / ``acquire`` given arguments); of what chooses a stream (``stream_context``, ``stream``,
  ``StreamCtx``, ``current_stream``, ``new_copy_stream``, ``Stream``), also when fetched with
  ``getattr(x, "record_stream", ...)``. A call that is a statement is deleted. A primitive's or a
  stream choice's value becomes ``None``, except as an argument of a primitive or ordering point
  (they do nothing given ``None``: that mutant is the deletion). An argument naming a stream,
  event or guard (``copy_stream``, ``self._host_guard``...) of a host-buffer or stream-choice
  call becomes ``None`` ("drop a guard", "no copy stream").
* an ordering point passed as a value (``self._order_use_after_h2d`` given to ``_wait``): a no-op.
* a store of a stream, event or guard outside ``__init__``: an attribute assignment loses that
  target (the old value stays), an ``append`` to such a list is deleted, and a local named
  ``...stream`` whose value is not one of the calls above becomes ``None``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["Mutant", "ORDERING_TESTS", "find_mutants", "run_mutants", "main"]

#: The repository root (this file is ``hyper_parallel/testing/mutations.py``).
ROOT = Path(__file__).resolve().parents[2]
SCOPES = ("hyper_parallel/core", "hyper_parallel/backends")
#: The stream-ordering tests: mutation, hazard, simulated-device tests and issue 25's.
ORDERING_TESTS = ("tests/test_stream_mutations.py", "tests/test_stream_hazards.py", "tests/test_ordering_points.py",
                  "tests/test_sim_device.py", "tests/test_sim_suite.py")

# Calls that order streams and do nothing given None (so None-ing an argument is the deletion).
_PRIMITIVES = {"record_event", "wait_event", "wait_stream", "record_stream", "mark_used_by", "_protect"}
_HOST_BUFFER = {"set_copy_event", "_release_host", "release", "acquire"}
_CONTEXTS = {"stream_context", "stream", "StreamCtx"}  # context managers: a None value would break the `with`
_CHOICES = {"current_stream", "new_copy_stream", "Stream"}
_NAMES_A_STREAM = re.compile(r"stream|event|guard|waiter|compute", re.IGNORECASE)
_STORES = re.compile(r"stream|event|guard|producers|ready", re.IGNORECASE)
_NOOP = "(lambda *args: None)"
_SKIP = shutil.ignore_patterns(".git", ".venv*", "results", "__pycache__", ".pytest_cache", "*.egg-info")


@dataclass(frozen=True)
class Mutant:
    """One change of one site: bytes ``start:end`` of ``path`` (relative to the root) become
    ``replacement``."""

    path: str
    line: int
    where: str       # the enclosing Class.function
    kind: str        # "delete", "None", "no-op", "drop target"
    site: Tuple[str, int]  # the call, reference or store it changes (path, byte offset)
    start: int
    end: int
    original: str
    replacement: str

    def label(self) -> str:
        first = self.original.splitlines()[0] + (" ..." if "\n" in self.original else "")
        return f"{self.path}:{self.line} {self.where}: {first}  ->  {self.replacement}"

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.replacement.encode() + source[self.end:]


def _callee(call: ast.Call) -> Optional[str]:
    """The called name (``x.wait_event(...)`` -> ``wait_event``), or the name a ``getattr``
    fetches (``getattr(t, "record_stream", None)``)."""
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        if f.id == "getattr" and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
            return str(call.args[1].value)
        return f.id
    return None


def _kind(call: ast.AST) -> Optional[str]:
    """``"point"`` (a primitive or ordering point), ``"host"``, ``"context"``, ``"choice"`` or None."""
    if not isinstance(call, ast.Call):
        return None
    name = _callee(call) or ""
    if name in _PRIMITIVES or name.startswith("_order_"):
        return "point"
    if name in _HOST_BUFFER and (name not in ("release", "acquire") or call.args):  # (a lock's take none)
        return "host"
    if name in _CONTEXTS:
        return "context"
    if name in _CHOICES:
        return "choice"
    return None


def _last_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


class _Finder(ast.NodeVisitor):
    """Collects the mutants of one file."""

    def __init__(self, path: str, source: bytes) -> None:
        self.path = path
        self.source = source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.scope: List[str] = []
        self.parents: Dict[ast.AST, ast.AST] = {}
        self.mutants: List[Mutant] = []

    def _span(self, node: ast.AST) -> Tuple[int, int]:
        # (ast offsets are in UTF-8 bytes)
        return (self.line_starts[node.lineno - 1] + node.col_offset,
                self.line_starts[node.end_lineno - 1] + node.end_col_offset)

    def _add(self, site: ast.AST, kind: str, replacement: str, node: Optional[ast.AST] = None) -> None:
        """A mutant of ``site``: the source of ``node`` (default: the site itself) replaced."""
        node = site if node is None else node
        start, end = self._span(node)
        self.mutants.append(Mutant(self.path, node.lineno, ".".join(self.scope) or "<module>", kind,
                                   (self.path, self._span(site)[0]), start, end, self.source[start:end].decode(),
                                   replacement))

    def run(self) -> List[Mutant]:
        tree = ast.parse(self.source)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.visit(tree)
        return self.mutants

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        kind = _kind(node)
        parent = self.parents.get(node)
        if kind is not None:
            if isinstance(parent, ast.Expr):
                self._add(node, "delete", "pass", parent)
            elif kind in ("point", "choice") and _kind(parent) != "point":
                self._add(node, "None", "None")
            if kind in ("host", "context", "choice"):
                for arg in list(node.args) + [k.value for k in node.keywords]:
                    if isinstance(arg, (ast.Name, ast.Attribute)) and _NAMES_A_STREAM.search(_last_name(arg)):
                        self._add(node, "None", "None", arg)
        elif (isinstance(node.func, ast.Attribute) and node.func.attr == "append" and isinstance(parent, ast.Expr)
              and _STORES.search(_last_name(node.func.value))):
            self._add(node, "delete", "pass", parent)  # streams.append(s), self.producers.append(stream)...
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parent = self.parents.get(node)
        is_callee = isinstance(parent, ast.Call) and parent.func is node
        if not is_callee and isinstance(node.ctx, ast.Load):
            if node.attr.startswith("_order_") or node.attr == "_protect":
                self._add(node, "no-op", _NOOP)  # an ordering point handed to its caller
            elif node.attr in _CHOICES:
                self._add(node, "None", "None")  # launch_load(self.backend.current_stream)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if "__init__" not in self.scope:
            for i, target in enumerate(node.targets):
                if isinstance(target, ast.Attribute) and _STORES.search(target.attr):
                    self._drop(node, i, None)
                elif isinstance(target, ast.Tuple):
                    for j, element in enumerate(target.elts):
                        if isinstance(element, ast.Attribute) and _STORES.search(element.attr):
                            self._drop(node, i, j)
                elif (isinstance(target, ast.Name) and target.id.endswith("stream") and _kind(node.value) is None):
                    self._add(node, "None", "None", node.value)  # copy_stream = copy_streams(device)
        self.generic_visit(node)

    def _drop(self, node: ast.Assign, i: int, j: Optional[int]) -> None:
        """The assignment without target ``i`` (element ``j`` of a tuple target, and the value's
        element ``j`` with it)."""
        new = copy.deepcopy(node)
        if j is None:
            del new.targets[i]
        else:
            if not (isinstance(new.value, ast.Tuple) and len(new.value.elts) == len(new.targets[i].elts)):
                return  # (an unpacked call: no way to drop one element)
            del new.targets[i].elts[j]
            del new.value.elts[j]
        self._add(node, "drop target", ast.unparse(new) if new.targets else "pass")


def find_mutants(root: Path = ROOT, scopes: Sequence[str] = SCOPES) -> List[Mutant]:
    """Every mutant of every ordering site under ``scopes``, in file and line order."""
    out: List[Mutant] = []
    for scope in scopes:
        for file in sorted((root / scope).rglob("*.py")):
            out.extend(_Finder(file.relative_to(root).as_posix(), file.read_bytes()).run())
    return sorted(out, key=lambda m: (m.path, m.start, m.kind))


def _pytest(tree: Path, tests: Sequence[str], timeout: float) -> Tuple[str, str]:
    """Run ``tests`` on the copy ``tree``: ``(outcome, detail)``, outcome ``"passed"``,
    ``"failed"`` (a test failed), ``"error"`` (collection or usage error) or ``"timeout"``."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result after {timeout:.0f} s"
    out = proc.stdout + proc.stderr
    failed = [line.split(" - ")[0] for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    outcome = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    last = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
    return outcome, failed[0] if failed else last


def _copy_tree(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, ignore=_SKIP, symlinks=True)
    return dest


def run_mutants(mutants: Sequence[Mutant], tests: Sequence[str] = ORDERING_TESTS, jobs: int = 2,
                timeout: float = 900.0, root: Path = ROOT, report: bool = True) -> List[Tuple[Mutant, str, str]]:
    """Run ``tests`` once on an unmutated copy of ``root`` (they must pass, from the copy), then
    on one copy per mutant, ``jobs`` at a time; returns ``(mutant, outcome, detail)`` per mutant
    (outcome ``"survived"``, ``"caught"``, ``"error"`` or ``"timeout"``)."""
    with tempfile.TemporaryDirectory(prefix="hp-mutants-") as tmp:
        base = _copy_tree(root, Path(tmp) / "base")
        where = subprocess.run([sys.executable, "-c", "import hyper_parallel; print(hyper_parallel.__file__)"],
                               cwd=base, env=dict(os.environ, PYTHONPATH=str(base)), capture_output=True, text=True)
        if not where.stdout.strip().startswith(str(base)):
            raise RuntimeError(f"the scratch copy does not shadow the installed package: {where.stdout}{where.stderr}")
        outcome, detail = _pytest(base, tests, timeout)
        if outcome != "passed":
            raise RuntimeError(f"the ordering tests do not pass on the unmutated copy ({outcome}): {detail}")

        def one(index: int) -> Tuple[Mutant, str, str]:
            m = mutants[index]
            tree = _copy_tree(base, Path(tmp) / f"m{index}")
            try:
                file = tree / m.path
                file.write_bytes(m.apply(file.read_bytes()))
                outcome, detail = _pytest(tree, tests, timeout)
            finally:
                shutil.rmtree(tree, ignore_errors=True)
            result = {"passed": "survived", "failed": "caught"}.get(outcome, outcome)
            if report:
                print(f"[{index + 1:3d}/{len(mutants)}] {result:8s} {m.label()}"
                      + (f"\n            ({detail})" if result != "survived" else ""), flush=True)
            return m, result, detail

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return list(pool.map(one, range(len(mutants))))


def _print_list(mutants: Iterable[Mutant]) -> None:
    for m in mutants:
        print(f"{m.kind:11s} {m.label()}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.testing.mutations",
                                     description="Mutation audit of the stream ordering (see the module docstring).")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--list", action="store_true", help="list the sites and mutants, run nothing")
    parser.add_argument("--only", default="", help="only mutants whose 'path:line Class.function' contains this")
    parser.add_argument("--tests", nargs="+", default=list(ORDERING_TESTS),
                        help="test files or node ids to run per mutant (default: the ordering tests)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant before it counts as caught "
                                                                      "by a hang (default 900)")
    args = parser.parse_args(argv)
    mutants = [m for m in find_mutants() if args.only in f"{m.path}:{m.line} {m.where}"]
    sites = {m.site for m in mutants}
    print(f"{len(sites)} ordering sites, {len(mutants)} mutants under {', '.join(SCOPES)}")
    if args.list:
        _print_list(mutants)
        return 0
    print(f"tests per mutant: {' '.join(args.tests)}", flush=True)
    results = run_mutants(mutants, args.tests, args.jobs, args.timeout)
    survivors = [m for m, outcome, _ in results if outcome == "survived"]
    crashed = sum(1 for _, outcome, _ in results if outcome in ("error", "timeout"))
    print(f"\n{len(sites)} sites, {len(mutants)} mutants: {len(results) - len(survivors)} caught "
          f"({crashed} of them by a collection error or a hang), {len(survivors)} survived")
    for m in survivors:
        print(f"SURVIVED {m.path}:{m.line} {m.where} ({m.kind})\n    - {m.original}\n    + {m.replacement}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
