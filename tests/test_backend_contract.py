"""A backend's one-call answers agree with the contract's composition of its primitives.

``TorchBackend.saved_facts`` answers everything a saved-tensor pack needs in one call (it runs for
every tensor autograd saves); ``Backend.saved_facts`` composes the fine primitives
(``unswappable_reason``, ``storage_id``, ``is_grad_leaf``, ``alias``, ``view_meta``...). Any
difference between the two would make the torch swap path keep or swap a different set of
tensors than the contract says, so they are compared field by field on every kind of tensor a
pack can see.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.backends.torch.backend import TorchBackend
from hyper_parallel.core.backend import Backend
from hyper_parallel.core.keep_reason import KeepReason


class _Subclass(torch.Tensor):
    pass


def _nested(layout):
    with warnings.catch_warnings():  # (the strided layout warns that it is a prototype)
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)


def _cases():
    """``name -> (tensor, param_keys)``; built lazily, so each test gets fresh tensors."""
    b = TorchBackend()
    weight = torch.nn.Parameter(torch.randn(4, 6))
    buffer = torch.randn(6)
    params = {b.storage_id(weight), b.storage_id(buffer)}
    leaf = torch.randn(3, 5, requires_grad=True)
    act = torch.randn(8, 6, requires_grad=True) * 2  # an activation: not a leaf
    base = torch.randn(10, 12)
    return {
        "activation": (act, params),
        "activation, no param keys": (act, frozenset()),
        "strided view with an offset": (base[2:7, 1::3], params),
        "transposed view": (base.t(), params),
        "parameter": (weight, params),
        "view of a parameter": (weight[1:], params),
        "buffer": (buffer, params),
        "leaf requiring grad": (leaf, params),
        "view of a leaf requiring grad": (leaf[:, 1:3], params),
        "leaf not requiring grad": (torch.randn(5), params),
        "empty storage": (torch.empty(0, 4), params),
        "conj view": (torch.randn(3, dtype=torch.complex64).conj(), params),
        "neg view": (torch.randn(3, dtype=torch.complex64).conj().imag, params),
        "sparse": (torch.randn(3, 3).to_sparse(), params),
        "meta": (torch.empty(3, 3, device="meta"), params),
        "subclass": (torch.randn(3).as_subclass(_Subclass), params),
        "bool": (torch.rand(7) > 0.5, params),
        "nested (strided layout)": (_nested(torch.strided), params),
        "nested (jagged layout)": (_nested(torch.jagged), params),
    }


def _backend(kind):
    """A TorchBackend as this CPU machine has it (``cpu``), or told that an accelerator exists
    (``accelerator``: every CPU tensor is then on the host), or given a device module whose
    current stream is a sentinel naming the device asked for (``streams``: the producer stream of
    a candidate must be that of its device)."""
    b = TorchBackend()
    if kind == "accelerator":
        b.accelerator = torch.device("cuda")
    elif kind == "streams":
        class _DeviceModule:
            @staticmethod
            def current_stream(device=None):
                return ("current stream of", device)
        b._dm = _DeviceModule()
    return b


KINDS = ("cpu", "accelerator", "streams")


def _assert_same(fused, composed, t):
    assert fused.reason is composed.reason
    assert fused.version == composed.version == t._version
    assert fused.key == composed.key
    assert fused.nbytes == composed.nbytes
    assert fused.meta == composed.meta
    assert fused.device == composed.device
    assert fused.stream == composed.stream
    for alias in (fused.alias, composed.alias):
        assert not alias.requires_grad and alias.grad_fn is None
        assert type(alias) is type(t.detach())
        if t.layout is torch.strided and not t.is_meta and not t.is_nested:
            assert alias.untyped_storage()._cdata == t.untyped_storage()._cdata
            assert (alias.shape, alias.stride(), alias.storage_offset()) == (t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(_cases()))
def test_torch_saved_facts_answers_what_the_contract_composes(name, kind):
    t, params = _cases()[name]
    b = _backend(kind)
    fused = b.saved_facts(t, params)
    composed = Backend.saved_facts(b, t, params)
    _assert_same(fused, composed, t)


def test_the_cases_cover_every_answer():
    """The cases reach each reason the pack can get (and the swap candidate, with its producer
    stream where there are streams), so the comparison above cannot pass by never reaching a
    branch."""
    seen = set()
    for kind in KINDS:
        b = _backend(kind)
        for t, params in _cases().values():
            facts = b.saved_facts(t, params)
            seen.add(facts.reason)
            if kind == "streams" and facts.reason is None:
                assert facts.stream == ("current stream of", facts.device)
    assert seen == {None, KeepReason.PARAMETER, KeepReason.BUFFER, KeepReason.EMPTY, KeepReason.ON_HOST,
                    KeepReason.UNSUPPORTED_TENSOR}


def test_the_alias_shares_the_version_counter_also_below_autograd():
    """From inside a dispatch mode (below autograd: a pack hook of an autograd.Function that a
    user's mode applies) the ADInplaceOrView key is excluded; the alias of both answers must still
    see in-place changes of the saved tensor, or such a change would go undetected."""
    b = TorchBackend()
    h = torch.randn(4) * 1
    seen = {}

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not seen:
                seen["excluded"] = torch._C._dispatch_tls_is_dispatch_key_excluded(
                    torch._C.DispatchKey.ADInplaceOrView)
                seen["facts"] = (b.saved_facts(h, frozenset()), Backend.saved_facts(b, h, frozenset()))
            return func(*args, **(kwargs or {}))

    with _Mode():
        torch.zeros(1) + 1
    assert seen["excluded"], "the case must run with ADInplaceOrView excluded"
    fused, composed = seen["facts"]
    _assert_same(fused, composed, h)
    h.add_(1)
    assert fused.alias._version == composed.alias._version == h._version == fused.version + 1


def _offload_cases():
    """``name -> (aliases, versions when saved, what keeps other views alive)``."""
    base = torch.randn(6, 4)
    unheld = [base[1:].detach(), base.t().detach()]  # (detached: no _base keeping another view)
    del base
    held = torch.randn(5)
    changed = torch.randn(5)
    v0 = changed._version
    changed.add_(1)
    both = torch.randn(5)  # changed in place and still held: the change decides (kept for good)
    v_both = both._version
    both.add_(1)
    grown = torch.randn(3)
    second = grown.detach()
    v_grown = grown._version
    second.mul_(2)  # the second alias's in-place change moves the shared counter
    return {
        "free (the only views are the aliases)": (unheld, [t._version for t in unheld], None),
        "held elsewhere": ([held.detach()], [held._version], held),
        "changed in place": ([changed.detach()], [v0], None),
        "changed through another alias": ([grown.detach(), second], [v_grown, v_grown], None),
        "changed in place and held elsewhere": ([both.detach()], [v_both], both),
    }


@pytest.mark.parametrize("name", list(_offload_cases()))
def test_torch_offload_blocker_answers_what_the_contract_composes(name):
    aliases, versions, keep_alive = _offload_cases()[name]
    b = TorchBackend()
    fused = b.offload_blocker(aliases, versions)
    assert fused is Backend.offload_blocker(b, aliases, versions)
    if name.startswith("changed"):
        assert fused is KeepReason.MODIFIED_IN_PLACE


def test_the_offload_cases_cover_every_answer():
    b = TorchBackend()
    cases = _offload_cases()
    seen = set()
    for aliases, versions, _ in cases.values():
        seen.add(b.offload_blocker(aliases, versions))
    assert seen == {None, KeepReason.SHARED, KeepReason.MODIFIED_IN_PLACE}
