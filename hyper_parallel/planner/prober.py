"""What the planner asks of a framework: the ``Prober`` protocol.

The planner's core (options, cost model, solver, plans) imports no framework; the framework's
backend supplies the rest: ``Backend.prober()`` (the one seam per framework; the planner asks
``active_backend().prober()``). ``hyper_parallel.backends.torch.prober.TorchProber`` is
PyTorch's, ``hyper_parallel.backends.mindspore.prober.MindSporeProber`` MindSpore's (PyNative).
Both are ``hyper_parallel.planner.chain_prober.ChainProber`` s: the algorithm is written once there,
and each implements only its framework's primitives.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Optional, Protocol, Sequence, Tuple

from .options import LayerOption, OpKey
from .profile import Effect, LayerType, StepProfile

__all__ = ["Prober"]


class Prober(Protocol):
    """The framework part of the planner."""

    #: the framework's name (``"torch"``, ``"mindspore"``), stored in plans
    name: str

    #: what the framework raises when the device runs out of memory, where a probe may run out
    #: (planning a step that does not fit as it is); ``()``: a probe that runs out fails planning
    out_of_memory: Tuple[type, ...]

    def profile_step(self, layers: Sequence[Any], step_fn: Callable[[], Any]) -> StepProfile:
        """Call ``step_fn`` at most twice and return the step's profile: the memory timeline cut
        into segments at layer boundaries (``pre``, then per layer ``fwd j`` and ``gap j``, then
        ``bwd j`` from the last layer to the first, each with the bytes live at its start and its
        peak, absolute), each layer's forward op calls (:class:`~hyper_parallel.planner.profile.OpRecord`:
        key, new bytes, saved by autograd, mutating, matmul-like), the sizes of the storages
        autograd saved per layer, the layers grouped into :class:`LayerType` s (each keeping what
        :meth:`probe` needs to run its first layer alone), the step's time, the copy bandwidth and
        whether copies overlap compute. Everything the step changed is put back."""
        ...

    def probe(self, ltype: LayerType, option: LayerOption, seen: Sequence[OpKey],
              reference: Optional[Any] = None) -> Tuple[Effect, Any]:
        """Measure ``option`` on copies of ``ltype``'s layer, chained through the layer chain:
        the bytes it changes in each relation of ``profile.RELATIONS`` and its seconds per step,
        against copies left as they are (``reference``: what a previous call returned for them,
        to reuse). Leaves the program as it found it."""
        ...

    def op_seconds(self, ltype: LayerType) -> Dict[OpKey, float]:
        """Forward seconds of each op kind of ``ltype``'s layer (summed over its calls)."""
        ...

    def key_of(self, op: Any, args: Tuple[Any, ...]) -> OpKey:
        """The :class:`OpKey` of an op call, as a selective region's policy sees it."""
        ...

    def nbytes(self, tensor: Any) -> int:
        """Bytes of the storage a saved tensor views."""
        ...

    def is_layer(self, x: Any) -> bool:
        """Whether ``x`` is a module / cell."""
        ...

    def is_stack(self, x: Any) -> bool:
        """Whether ``x`` is a layer stack itself (a list of layers) rather than a model."""
        ...

    def find_layers(self, model: Any) -> Tuple[str, Sequence[Any]]:
        """A model's layer stack: its attribute path and layers (a clear error if none)."""
        ...

    def in_training(self, step_fn: Callable[[], Any]) -> ContextManager[Any]:
        """The block runs with one ``step_fn()`` done first, as in the middle of training (an
        optimizer's lazily created state exists); what that call changed is put back after it."""
        ...

    def submodule(self, model: Any, path: str) -> Any:
        """The module at ``path`` in ``model`` (where :meth:`find_layers` found the stack)."""
        ...

    def is_container(self, x: Any) -> bool:
        """Whether ``x`` holds the layers so that the model calls them from it, its entries
        settable (what :meth:`measure_plan` needs)."""
        ...

    def measure_plan(self, stack: Any, layers: Sequence[Any], options: Sequence[LayerOption],
                     seen: Sequence[Sequence[OpKey]], step_fn: Callable[[], Any]) -> Optional[int]:
        """The peak bytes of one ``step_fn()`` with ``layers[i]`` wrapped by ``options[i]``,
        measured (``stack``: their container; ``None``: the plan could not be run)."""
        ...

    def pipeline(self, schedule: Any) -> Any:
        """What ``plan_pipeline`` reads of a pipeline schedule and runs of it (PyTorch:
        ``backends/torch/pipeline_schedule.TorchPipeline``): its stages here, its action order, one step, a
        micro-batch step through a stage; a clear error where the framework has none."""
        ...

    def measure_step(self, device: Any, step_fn: Callable[[], Any]) -> int:
        """The peak bytes of one ``step_fn()`` as a budget counts them, what it changed put back."""
        ...

    def collectives(self, group: Any) -> Any:
        """The object collectives (``distributed.Collectives``) of the data-parallel ``group`` a
        plan is made for (``plan_memory(..., group=...)``), or ``None`` to plan alone."""
        ...

    def wrap(self, layer: Any, option: LayerOption, seen: Sequence[OpKey]) -> Any:
        """Wrap ``layer`` in place for ``option`` through the public API; returns the generated
        policy (or ``None``)."""
        ...
