"""The mutation runner (``python -m hyper_parallel.testing.mutations``, run by hand): it finds the
ordering sites by pattern, every mutant is a real change that compiles, and run on a scratch copy
a known mutation is caught while one the selected tests never reach survives."""

from __future__ import annotations

import os
import re

import pytest

from hyper_parallel.testing import mutations as mut


def _by_site():
    return {(m.where, m.original): m for m in mut.find_mutants()}


def test_finds_a_sane_number_of_ordering_sites():
    mutants = mut.find_mutants()
    sites = {m.site for m in mutants}
    assert 50 <= len(sites) <= 150, len(sites)
    assert len(sites) <= len(mutants) <= 2 * len(sites)
    assert all(m.path.startswith(("hyper_parallel/core/", "hyper_parallel/backends/")) for m in mutants)
    # a lock's acquire/release guards no host buffer
    assert not any(re.search(r"\block\.(acquire|release)\(", m.original) for m in mutants)
    # one site of each pattern
    by_site = _by_site()
    for where, source, kind in [
        ("SwapGroup._order_release_after_d2h", "self.backend.wait_event(compute, event)", "delete"),  # primitive
        ("SwapGroup.wait_load", "self._order_use_after_h2d", "no-op"),                           # point handed over
        ("SwapGroup._start_offloads", "self.backend.record_event(copy_stream)", "None"),         # a host buffer's guard
        ("SwapGroup._load", "copy_stream", "None"),                                               # the copies' stream
        ("SwapTensor.copy_in", "self._copy_stream = copy_stream", "drop target"),                 # a stored stream
        ("SwapTensor.add_alias", "self.producers.append(stream)", "delete"),                      # a recorded stream
        ("TorchBackend.mark_used_by", "t.record_stream(stream)", "delete"),                       # backend primitive
    ]:
        assert by_site[(where, source)].kind == kind, (where, source)


def _one(where, kind, original, replacement):
    """The (first) mutant of ``kind`` in ``where`` changing source starting ``original`` into
    source starting ``replacement``."""
    found = [m for m in mut.find_mutants() if (m.where, m.kind) == (where, kind)
             and m.original.strip().startswith(original) and m.replacement.strip().startswith(replacement)]
    assert found, (where, kind, original, replacement)
    return found[0]


def test_finds_a_mutant_of_each_kind_that_slips_a_stream_or_a_bound():
    """The kinds of change an outside audit made: a wrong stream, swapped stream arguments, an
    ordering statement moved across the work it orders, a flipped quantifier, an off-by-one."""
    _one("SwapTensor.wait_load", "wrong stream", "waiter", "self._dev_stream")
    _one("SwapGroup._load", "swap args", "copy_stream, compute", "compute, copy_stream")
    # the H2D's wait for compute issued after the copies instead of before
    move = _one("SwapGroup._load", "move", "self._order_h2d_after_allocation", "with self.backend.stream_context")
    assert "self._order_h2d_after_allocation" in move.replacement.splitlines()[-1]
    # the source's protection issued after the source was dropped
    _one("SwapTensor.wait_offload", "move", "if waiter is not None", "self._src = None")
    _one("SwapTensor.wait_offload", "flip", "any", "all")
    _one("HostBufferPool.acquire", "flip", ">", ">=")
    # only in functions holding an ordering site: the host pool's size checks elsewhere are not mutated
    flips = [m for m in mut.find_mutants() if m.kind == "flip"]
    assert flips and len(flips) <= 20


def test_runs_import_the_source_they_are_given(tmp_path, monkeypatch):
    """No stale bytecode: a mutant that keeps its file's size and modification time (``any`` ->
    ``all`` restored within one second) is seen by the next run, since no run writes a ``.pyc``
    and a copied tree carries none."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)  # (the runner must not rely on its caller's)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "mod.py").write_text("VALUE = any([1, 0])\n")
    (tree / "test_mod.py").write_text("import mod\n\n\ndef test_value():\n    assert mod.VALUE\n")
    stamp = (tree / "mod.py").stat().st_mtime_ns
    assert mut._pytest(tree, ["test_mod.py"], 120)[0] == "passed"
    assert not list(tree.rglob("*.pyc"))
    (tree / "mod.py").write_text("VALUE = all([1, 0])\n")  # (same size)
    os.utime(tree / "mod.py", ns=(stamp, stamp))
    assert mut._pytest(tree, ["test_mod.py"], 120)[0] == "failed"
    cache = tree / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"stale")
    copied = mut._copy_tree(tree, tmp_path / "copy")
    assert not list(copied.rglob("*.pyc")) and not (copied / "__pycache__").exists()


def test_every_mutant_changes_its_file_and_compiles():
    for m in mut.find_mutants():
        source = (mut.ROOT / m.path).read_bytes()
        mutated = m.apply(source)
        assert mutated != source, m.label()
        compile(mutated, m.path, "exec")


def test_list_prints_the_mutants(capsys):
    assert mut.main(["--list", "--only", "SwapTensor.copy_in"]) == 0
    out = capsys.readouterr().out
    assert "1 ordering sites, 1 mutants" in out
    assert "swap_tensor.py" in out and "self._copy_stream = copy_stream  ->  pass" in out


@pytest.mark.slow
def test_a_known_mutation_is_caught_and_an_unreached_one_survives():
    by_site = _by_site()
    copy_in = by_site[("SwapTensor.copy_in", "self._copy_stream = copy_stream")]
    reuse = by_site[("HostBufferPool.acquire", "self._order_reuse_after_guard(stream, guard)")]
    # (the reload test never reuses a pooled buffer: removing the reuse guard goes unseen there)
    flip = _one("SwapTensor.wait_offload", "flip", "any", "all")
    results = mut.run_mutants([copy_in, reuse, flip], ["tests/test_ordering_points.py", "-k",
                                                       "remembers or allocated_on_a_side_stream"], report=False)
    assert [(m, outcome) for m, outcome, _ in results] == [(copy_in, "caught"), (reuse, "survived"),
                                                           (flip, "caught")], results
    assert "test_reload_remembers_its_own_copy_stream" in results[0][2]
    assert "test_a_source_allocated_on_a_side_stream_is_protected" in results[2][2]
