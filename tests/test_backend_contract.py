"""The per-tensor questions of the backend contract, answered on every kind of tensor a region can
save, and answered by the simulated device through exactly the code an accelerator runs.

``Backend.saved_facts`` answers everything a saved-tensor pack needs in one call: why a tensor
stays on the device, or the alias, version, storage key, bytes, view metadata, device and producer
stream of a swap candidate. A wrong answer would make the swap path keep or swap a different set
of tensors than the contract says, so every field is checked on every case. The simulated device
(``hyper_parallel.testing.SimDevice``) is a ``TorchBackend`` that changes streams, events,
allocation, copies and where a storage lives, and nothing else: what the stream checker proves is
then proven of the code CUDA runs.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hyper_parallel.backends.torch as torch_backend_package
from hyper_parallel.backends.torch.backend import HOST, TorchBackend
from hyper_parallel.core.activation_checkpoint import SwapManager
from hyper_parallel.core.keep_reason import KeepReason
from hyper_parallel.testing import SimDevice

K = KeepReason


class _Subclass(torch.Tensor):
    pass


def _nested(layout):
    with warnings.catch_warnings():  # (the strided layout warns that it is a prototype)
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)


def _cases():
    """``name -> (tensor, param_keys, reason on a device)``; built lazily, so each test gets fresh
    tensors. Next to an accelerator every CPU tensor a byte copy can rebuild is ``ON_HOST``."""
    b = TorchBackend()
    weight = torch.nn.Parameter(torch.randn(4, 6))
    buffer = torch.randn(6)
    params = {b.storage_id(weight), b.storage_id(buffer)}
    leaf = torch.randn(3, 5, requires_grad=True)
    act = torch.randn(8, 6, requires_grad=True) * 2  # an activation: not a leaf
    base = torch.randn(10, 12)
    return {
        "activation": (act, params, None),
        "activation, no param keys": (act, frozenset(), None),
        "strided view with an offset": (base[2:7, 1::3], params, None),
        "transposed view": (base.t(), params, None),
        "parameter": (weight, params, K.PARAMETER),
        "view of a parameter": (weight[1:], params, K.PARAMETER),
        "buffer": (buffer, params, K.BUFFER),
        "leaf requiring grad": (leaf, params, K.PARAMETER),
        "view of a leaf requiring grad": (leaf[:, 1:3], params, K.PARAMETER),
        "leaf not requiring grad": (torch.randn(5), params, None),
        "empty storage": (torch.empty(0, 4), params, K.EMPTY),
        "conj view": (torch.randn(3, dtype=torch.complex64).conj(), params, K.UNSUPPORTED_TENSOR),
        "neg view": (torch.randn(3, dtype=torch.complex64).conj().imag, params, K.UNSUPPORTED_TENSOR),
        "sparse": (torch.randn(3, 3).to_sparse(), params, K.UNSUPPORTED_TENSOR),
        "meta": (torch.empty(3, 3, device="meta"), params, K.UNSUPPORTED_TENSOR),
        "subclass": (torch.randn(3).as_subclass(_Subclass), params, K.UNSUPPORTED_TENSOR),
        "bool": (torch.rand(7) > 0.5, params, None),
        "nested (strided layout)": (_nested(torch.strided), params, K.UNSUPPORTED_TENSOR),
        "nested (jagged layout)": (_nested(torch.jagged), params, K.UNSUPPORTED_TENSOR),
    }


class _DeviceModule:
    """A device module whose current stream is a sentinel naming the device asked for."""

    @staticmethod
    def current_stream(device=None):
        return ("current stream of", device)


def _backend(kind):
    """A TorchBackend as this CPU machine has it (``cpu``), or told that an accelerator exists
    (``accelerator``: every CPU tensor is then on the host), or given a device module whose
    current stream is a sentinel (``streams``: the producer stream of a candidate must be that of
    its device)."""
    b = TorchBackend()
    if kind == "accelerator":
        b.accelerator = torch.device("cuda")
    elif kind == "streams":
        b._dm = _DeviceModule()
    return b


KINDS = ("cpu", "accelerator", "streams")


def _expected_reason(kind, t, on_device):
    if kind == "accelerator" and on_device is not K.UNSUPPORTED_TENSOR:
        return K.ON_HOST
    return on_device


def _assert_alias(alias, t):
    assert not alias.requires_grad and alias.grad_fn is None
    assert type(alias) is type(t.detach())
    if t.layout is torch.strided and not t.is_meta and not t.is_nested:
        assert alias.untyped_storage()._cdata == t.untyped_storage()._cdata
        assert (alias.shape, alias.stride(), alias.storage_offset()) == (t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(_cases()))
def test_saved_facts_answers_every_field_for_each_kind_of_tensor(name, kind):
    t, params, on_device = _cases()[name]
    b = _backend(kind)
    facts = b.saved_facts(t, params)
    reason = _expected_reason(kind, t, on_device)
    assert facts.reason is reason
    assert facts.version == t._version
    _assert_alias(facts.alias, t)
    stored = reason not in (K.UNSUPPORTED_TENSOR, K.EMPTY)
    assert facts.nbytes == (t.untyped_storage().nbytes() if stored else 0)
    keyed = reason in (None, K.PARAMETER, K.BUFFER)
    assert facts.key == (t.untyped_storage()._cdata if keyed else None)
    if reason is None:
        assert facts.meta == (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
        assert facts.device == t.device
        assert facts.stream == (("current stream of", t.device) if kind == "streams" else None)
    else:
        assert facts.meta is facts.device is facts.stream is None


def test_the_cases_cover_every_answer():
    """The cases reach each reason the pack can get (and the swap candidate, with its producer
    stream where there are streams), so the checks above cannot pass by never reaching a branch."""
    seen = set()
    for kind in KINDS:
        b = _backend(kind)
        for t, params, _ in _cases().values():
            facts = b.saved_facts(t, params)
            seen.add(facts.reason)
            if kind == "streams" and facts.reason is None:
                assert facts.stream == ("current stream of", facts.device)
    assert seen == {None, K.PARAMETER, K.BUFFER, K.EMPTY, K.ON_HOST, K.UNSUPPORTED_TENSOR}


def test_the_alias_shares_the_version_counter_also_below_autograd():
    """From inside a dispatch mode (below autograd: a pack hook of an autograd.Function that a
    user's mode applies) the ADInplaceOrView key is excluded; the alias must still see in-place
    changes of the saved tensor, or such a change would go undetected."""
    b = TorchBackend()
    h = torch.randn(4) * 1
    seen = {}

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not seen:
                seen["excluded"] = torch._C._dispatch_tls_is_dispatch_key_excluded(
                    torch._C.DispatchKey.ADInplaceOrView)
                seen["facts"] = b.saved_facts(h, frozenset())
            return func(*args, **(kwargs or {}))

    with _Mode():
        torch.zeros(1) + 1
    assert seen["excluded"], "the case must run with ADInplaceOrView excluded"
    facts = seen["facts"]
    assert facts.reason is None and facts.version == h._version
    _assert_alias(facts.alias, h)
    h.add_(1)
    assert facts.alias._version == h._version == facts.version + 1


# ------------------------------------------------------------------------------ what an offload checks
_OFFLOAD_ANSWERS = {
    "free (only the swap system holds it)": None,
    "held elsewhere": K.SHARED,
    "changed in place": K.MODIFIED_IN_PLACE,
    "changed through another alias": K.MODIFIED_IN_PLACE,
    "changed in place and held elsewhere": K.MODIFIED_IN_PLACE,  # the change decides: kept for good
}


@pytest.mark.parametrize("case", list(_OFFLOAD_ANSWERS))
def test_an_offload_checks_in_place_changes_then_other_holders(case):
    mgr = SwapManager()
    storage = mgr.new_storage("g")
    t = torch.randn(6, 4) * 1
    views = [storage.add(mgr.backend.saved_facts(x, ())) for x in (t[1:], t.t())]
    assert views[0]._swap_tensor is views[1]._swap_tensor
    st = views[0]._swap_tensor
    if case in ("changed in place", "changed in place and held elsewhere"):
        t.add_(1)
    elif case == "changed through another alias":
        t.detach().mul_(2)  # shares the version counter
    if "held" not in case:
        del t
    assert mgr.backend.storage_other_holders(st._aliases) == (1 if "held" in case else 0)
    assert st.offload_reason() is _OFFLOAD_ANSWERS[case]
    assert st.kept_reason is (K.MODIFIED_IN_PLACE if "changed" in case else None)


# ------------------------------------------------------------------------------ the simulated device
#: What a SimDevice may change of TorchBackend: streams, events, allocation, copies, and where a
#: storage lives (which simulated device, or its host buffers).
SIMULATED = {"current_stream", "new_copy_stream", "stream_context", "record_event", "wait_event",
             "empty_device_bytes", "empty_host_bytes", "host_alloc_size", "empty_host_cache", "slot_bytes",
             "copy_bytes", "mark_used_by", "device_of"}


def test_the_simulated_device_changes_only_streams_events_allocation_copies_and_placement():
    overridden = {name for name in vars(SimDevice) if hasattr(TorchBackend, name)
                  and not name.startswith("__") and name != "_abc_impl"}  # (the ABC's own bookkeeping)
    assert overridden == SIMULATED


def _torch_backend_code(fn):
    """``(fn(), the code objects of hyper_parallel/backends/torch that ran, in call order)``."""
    root = torch_backend_package.__path__[0]
    ran = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            ran.append(frame.f_code)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(previous)
    return out, ran


def _sim_cases(sim):
    cases = {name: (t, params) for name, (t, params, _) in _cases().items()}
    cases["on simulated device 1"] = (sim.place(torch.randn(3, 4) * 1, 1), frozenset())
    cases["a host buffer"] = (sim.empty_host_bytes(16), frozenset())
    return cases


@pytest.mark.parametrize("name", list(_sim_cases(SimDevice())))
def test_the_simulated_device_answers_through_the_code_an_accelerator_runs(name):
    """For every kind of saved tensor the simulated device's answers (the pack's and the
    offload's) come from TorchBackend's code as on an accelerator: a TorchBackend told it has an
    accelerator, given the simulator's placement of the tensor and its streams, runs exactly the
    same code (but for the simulated primitives) and gives the same answers."""
    sim = SimDevice()
    t, params = _sim_cases(sim)[name]
    accel = _backend("accelerator")
    accel.device_of = sim.device_of  # where the storage lives: the simulator's answer

    class _SimStreams:
        current_stream = staticmethod(sim.current_stream)

    accel._dm = _SimStreams()
    got, sim_code = _torch_backend_code(lambda: sim.saved_facts(t, params))
    want, accel_code = _torch_backend_code(lambda: accel.saved_facts(t, params))
    assert sim_code and sim_code == [c for c in accel_code if c.co_name not in SIMULATED]
    assert got.reason is want.reason and got.version == want.version and got.key == want.key
    assert got.nbytes == want.nbytes and got.meta == want.meta and got.device == want.device
    assert got.stream is want.stream
    _assert_alias(got.alias, t)
    if name == "on simulated device 1":
        assert got.reason is None and got.device == 1 and got.stream is sim.current_stream(1)
    if name == "a host buffer":
        assert got.reason is K.ON_HOST and sim.device_of(t) == HOST
    if got.reason is None:
        holders, sim_code = _torch_backend_code(lambda: sim.storage_other_holders([got.alias]))
        again, accel_code = _torch_backend_code(lambda: accel.storage_other_holders([got.alias]))
        assert holders == again and sim_code == accel_code
