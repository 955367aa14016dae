"""The mutation runner (``python -m hyper_parallel.testing.mutations``, run by hand): it finds the
ordering sites by pattern, every mutant is a real change that compiles, and run on a scratch copy
a known mutation is caught while one the selected tests never reach survives."""

from __future__ import annotations

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
    results = mut.run_mutants([copy_in, reuse], ["tests/test_ordering_points.py", "-k", "remembers"], report=False)
    assert [(m, outcome) for m, outcome, _ in results] == [(copy_in, "caught"), (reuse, "survived")], results
    assert "test_reload_remembers_its_own_copy_stream" in results[0][2]
