"""Mutation audit of the stream ordering, run by hand (not in CI)::

    python -m hyper_parallel.testing.mutations              # every mutant, two at a time
    python -m hyper_parallel.testing.mutations --list       # the sites and their mutants only
    python -m hyper_parallel.testing.mutations --only swap_tensor.py --tests tests/test_ordering_points.py
    python -m hyper_parallel.testing.mutations --kind move --kind flip     # some kinds only

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

In a function holding one of those sites (where a slip changes the ordering):

* "wrong stream": an argument of a primitive, ordering point or host-buffer call that names a
  stream (``copy_stream``, ``waiter``, ``compute``, ``self._copy_stream``...) becomes another
  stream the function has at that point (a parameter or a local assigned before the call);
* "swap args": such a call whose first two arguments both name streams gets them swapped;
* "move": a primitive or ordering-point statement (``event = ...record_event(...)`` too) trades
  places with the statement before or after it (the event recorded, or the wait issued, before
  or after the copies), where neither reads what the other assigns;
* "flip": ``any`` <-> ``all``, ``max`` <-> ``min``, and an off-by-one in a comparison
  (``<`` <-> ``<=``, ``>`` <-> ``>=``).

Each run imports the mutated source itself: the copies carry no ``__pycache__`` and every
process runs with ``PYTHONDONTWRITEBYTECODE=1`` (a mutant that keeps its file's size, restored
within the same second, would otherwise leave a valid-looking stale ``.pyc`` behind).
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
_NAMES_A_STREAM_ONLY = re.compile(r"stream|waiter|compute", re.IGNORECASE)  # (not its events or guards)
_FLIPS = {"any": "all", "all": "any", "max": "min", "min": "max"}
_OFF_BY_ONE = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
_BOOKKEEPING = {"append", "extend"}  # calls that only grow a list of the engine's: no device work
_NOOP = "(lambda *args: None)"
_SKIP = shutil.ignore_patterns(".git", ".venv*", "results", "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
#: No process of a run writes bytecode (and the copies carry none): each imports the source it is given.
_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class Mutant:
    """One change of one site: bytes ``start:end`` of ``path`` (relative to the root) become
    ``replacement``."""

    path: str
    line: int
    where: str       # the enclosing Class.function
    kind: str        # "delete", "None", "no-op", "drop target", "wrong stream", "swap args", "move", "flip"
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
        # Mutants of the kinds that apply only in functions holding an ordering site
        self.extras: List[Mutant] = []
        self.streams: List[List[Tuple[str, int]]] = []  # per function: (stream name, line it is bound from)

    def _span(self, node: ast.AST) -> Tuple[int, int]:
        # (ast offsets are in UTF-8 bytes)
        return (self.line_starts[node.lineno - 1] + node.col_offset,
                self.line_starts[node.end_lineno - 1] + node.end_col_offset)

    def _add(self, site: ast.AST, kind: str, replacement: str, node: Optional[ast.AST] = None,
             extra: bool = False, span: Optional[Tuple[int, int]] = None) -> None:
        """A mutant of ``site``: the source of ``node`` (default: the site itself; or the bytes
        ``span``) replaced. ``extra``: kept only if its function holds an ordering site."""
        node = site if node is None else node
        start, end = self._span(node) if span is None else span
        (self.extras if extra else self.mutants).append(
            Mutant(self.path, node.lineno, ".".join(self.scope) or "<module>", kind, (self.path, self._span(site)[0]),
                   start, end, self.source[start:end].decode(), replacement))

    def run(self) -> List[Mutant]:
        tree = ast.parse(self.source)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.visit(tree)
        ordering = {m.where for m in self.mutants}
        out, seen = list(self.mutants), set()
        for m in self.extras:  # (an `if` of two ordering calls is one move)
            if m.where in ordering and (m.start, m.end, m.replacement) not in seen:
                seen.add((m.start, m.end, m.replacement))
                out.append(m)
        return out

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _scoped

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        bound = [(a.arg, node.lineno) for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                bound.append((sub.id, sub.lineno))
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                bound.append((ast.unparse(sub), node.lineno))  # (self's streams: there all along)
        self.streams.append([(name, line) for name, line in bound
                             if _NAMES_A_STREAM_ONLY.search(name) and not name.endswith("streams")])
        self._scoped(node)
        self.streams.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

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
            if kind in ("point", "host"):
                self._wrong_streams(node)
            if kind == "point" and (isinstance(parent, ast.Expr) or isinstance(parent, ast.Assign)
                                    and parent.value is node):
                self._moves(node, self._ordering_statement(parent))
        elif (isinstance(node.func, ast.Attribute) and node.func.attr == "append" and isinstance(parent, ast.Expr)
              and _STORES.search(_last_name(node.func.value))):
            self._add(node, "delete", "pass", parent)  # streams.append(s), self.producers.append(stream)...
        elif isinstance(node.func, ast.Name) and node.func.id in _FLIPS:
            self._add(node, "flip", _FLIPS[node.func.id], node.func, extra=True)  # any(...) -> all(...)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and type(node.ops[0]) in _OFF_BY_ONE:
            # (the operator has no position of its own: the text between the operands)
            left_end, right_start = self._span(node.left)[1], self._span(node.comparators[0])[0]
            between = self.source[left_end:right_start].decode()
            op = between.strip().strip("()").strip()
            if op in ("<", "<=", ">", ">="):
                self._add(node, "flip", between.replace(op, _OFF_BY_ONE[type(node.ops[0])], 1), node, extra=True,
                          span=(left_end, right_start))
        self.generic_visit(node)

    def _wrong_streams(self, call: ast.Call) -> None:
        """"wrong stream" and "swap args" mutants of an ordering or host-buffer call."""
        args = [a for a in call.args if isinstance(a, (ast.Name, ast.Attribute))]
        streamish = [a for a in args if _NAMES_A_STREAM_ONLY.search(_last_name(a))
                     and not _last_name(a).endswith("streams")]
        known = self.streams[-1] if self.streams else []
        for arg in streamish:
            here = ast.unparse(arg)
            others = sorted({name for name, line in known if line < call.lineno and name != here})
            for other in others:
                self._add(call, "wrong stream", other, arg, extra=True)
        first = call.args[:2]
        if len(first) == 2 and all(a in streamish for a in first) and ast.unparse(first[0]) != ast.unparse(first[1]):
            a, b = (self._span(x) for x in first)
            between = self.source[a[1]:b[0]].decode()
            self._add(call, "swap args", ast.unparse(first[1]) + between + ast.unparse(first[0]), first[0],
                      extra=True, span=(a[0], b[1]))

    def _ordering_statement(self, stmt: ast.stmt) -> ast.stmt:
        """``stmt``, or the ``if`` (without ``else``) whose body it is only with other ordering
        statements (``if ...: self._protect(...)`` moves as a whole)."""
        parent = self.parents.get(stmt)
        while (isinstance(parent, ast.If) and not parent.orelse and stmt in parent.body
               and all(_is_ordering(x) for x in parent.body)):
            stmt, parent = parent, self.parents.get(parent)
        return stmt

    def _moves(self, call: ast.Call, stmt: ast.stmt) -> None:
        """"move" mutants: ``stmt`` (an ordering statement) trades places with a neighbour that
        does something a stream can see (a call, a ``del``, a reference set to ``None``)."""
        block = next((getattr(self.parents[stmt], f) for f in ("body", "orelse", "finalbody")
                      if stmt in getattr(self.parents[stmt], f, [])), None)
        if block is None:
            return
        i = block.index(stmt)
        for j in (i - 1, i + 1):
            if not 0 <= j < len(block):
                continue
            other = block[j]
            if isinstance(other, (ast.Return, ast.Raise, ast.Break, ast.Continue)) or not _acts(other):
                continue  # (after a return it is a deletion; next to bookkeeping it changes nothing)
            if _depends(stmt, other):
                continue
            first, second = (other, stmt) if j < i else (stmt, other)
            a, b = self._span(first), self._span(second)
            between = self.source[a[1]:b[0]].decode()
            text = (self.source[b[0]:b[1]].decode() + between + self.source[a[0]:a[1]].decode())
            self._add(call, "move", text, first, extra=True, span=(a[0], b[1]))

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


def _is_ordering(stmt: ast.stmt) -> bool:
    """A statement that is one primitive or ordering-point call (its value assigned, or not)."""
    return isinstance(stmt, (ast.Expr, ast.Assign)) and _kind(stmt.value) == "point"


def _acts(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` does something a stream can see: it calls something, deletes, or sets a
    reference to ``None`` (which may free a block). Not another ordering statement (two of them
    commute), nor a guard that only raises or returns (the move would change the error path)."""
    if _is_ordering(stmt) or isinstance(stmt, ast.If) and not stmt.orelse and (
            all(_is_ordering(x) for x in stmt.body) or all(isinstance(x, (ast.Raise, ast.Return)) for x in stmt.body)):
        return False
    return any(isinstance(sub, ast.Call) and _callee(sub) not in _BOOKKEEPING or isinstance(sub, ast.Delete)
               or isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Constant) and sub.value.value is None
               for sub in ast.walk(stmt))


def _locals(node: ast.AST, store: bool) -> set:
    return {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) == store}


def _depends(a: ast.stmt, b: ast.stmt) -> bool:
    """Whether one of two statements reads or assigns a local the other assigns (trading their
    places would only break the code: no mutant). Attributes do not count: moving a wait across
    the release of ``self._src`` is a mutant worth making."""
    wa, wb = _locals(a, True), _locals(b, True)
    return bool(wa & (_locals(b, False) | wb) or wb & _locals(a, False))


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
    env = dict(os.environ, PYTHONPATH=str(tree), **_ENV)
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
                               cwd=base, env=dict(os.environ, PYTHONPATH=str(base), **_ENV), capture_output=True,
                               text=True)
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
    parser.add_argument("--kind", action="append", default=[],
                        help="only mutants of this kind (repeatable): delete, None, no-op, 'drop target', "
                             "'wrong stream', 'swap args', move, flip")
    parser.add_argument("--tests", nargs="+", default=list(ORDERING_TESTS),
                        help="test files or node ids to run per mutant (default: the ordering tests)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant before it counts as caught "
                                                                      "by a hang (default 900)")
    args = parser.parse_args(argv)
    mutants = [m for m in find_mutants() if args.only in f"{m.path}:{m.line} {m.where}"
               and (not args.kind or m.kind in args.kind)]
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
