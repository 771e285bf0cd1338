"""Every private torch name the project uses, each with why, and the functions that reach them.

Nothing outside this module (tests aside) names a private torch attribute; tests/test_torch_private.py
fails when an installed torch lacks one of `PRIVATE_NAMES` (an upgrade renamed it: update the entry and its
accessor) and when one appears elsewhere in the code. Every accessor degrades to public torch where the name
is missing, so a torch without it still trains (slower or with more memory, as each entry says).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch.autograd.graph import GradientEdge


@dataclass(frozen=True)
class PrivateName:
    """One private torch name: where it lives, why the project needs it, what public API would replace it."""

    module: str  # the module to import
    path: str  # the attribute path inside it
    reason: str
    public_replacement: str

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.path}"


AUTOGRAD_ENGINE = PrivateName(
    "torch.autograd",
    "Variable._execution_engine.run_backward",
    "backward from a pipeline stage's output whose .data was freed after sending it (Megatron's "
    "deallocate_output): torch.autograd.backward/grad check the gradient's shape against the now 1-element "
    "output and refuse; the engine entry checks it against the shape the graph recorded "
    "(parallel/pipeline/executor.py, weight_grad.py). Every stage backward takes it: torch.autograd.backward's "
    "first call with a gradient tensor also imports symbolic_shapes and sympy (~0.5 CPU s per trainer start)",
    "none: without it the executor keeps sent outputs whole and uses torch.autograd.backward/grad (more memory)",
)
FOREACH_NORM = PrivateName(
    "torch",
    "_foreach_norm",
    "the 2-norm of every gradient in one fused launch per device and dtype for the global grad norm "
    "(parallel/grad_utils.py); its numbers are what the trainer has always logged and clipped by",
    "torch.nn.utils.get_total_norm (2.6+) combines the per-tensor norms in another order (not bitwise equal); "
    "without it: torch.linalg.vector_norm per tensor (one launch each)",
)
FUSED_SDP_CHOICE = PrivateName(
    "torch",
    "_fused_sdp_choice",
    "which backend scaled_dot_product_attention dispatches to for the model's attention shape, logged once "
    "at start (model/kernels/attention_backend.py)",
    "none (torch.nn.attention.sdpa_kernel restricts the choice but does not report it): the log says 'unknown'",
)
TENSOR_BASE = PrivateName(
    "torch",
    "Tensor._base",
    "whether a stage output is a view: freeing its .data would free its base's storage (executor.py)",
    "none (Tensor._is_view is private too): without it no output is freed early",
)
# torch.distributed.checkpoint's .metadata file pickles instances of these; the allow-list unpickler of
# checkpoint/safe_reader.py names them to read it without running anything else.
_DCP_REASON = "torch.distributed.checkpoint's .metadata pickles it; our allow-list unpickler must name it"
_DCP_PUBLIC = "none: DCP's own FileSystemReader.read_metadata unpickles with plain pickle (runs anything)"
DCP_METADATA_NAMES = (
    PrivateName("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", _DCP_REASON, _DCP_PUBLIC),
    PrivateName("torch.distributed.checkpoint.filesystem", "_StorageInfo", _DCP_REASON, _DCP_PUBLIC),
    PrivateName("torch.distributed.checkpoint.filesystem", "_StoragePrefix", _DCP_REASON, _DCP_PUBLIC),
)
PICKLED_LAYOUT = PrivateName(
    "torch.serialization",
    "_get_layout",
    "a pickled tensor layout (torch.strided) is rebuilt by name through it: DCP metadata holds layouts",
    _DCP_PUBLIC,
)
PICKLED_TENSOR = PrivateName(
    "torch._utils",
    "_rebuild_tensor_v2",
    "the function the pickle of a torch.save record of one tensor names: the checkpoint load recognises such a "
    "record by that name (never looking it up or calling it) and reads the tensor's bytes straight into their "
    "destination (checkpoint/record_reader.py)",
    "torch.load(weights_only=True) of the whole record, as DCP's reader does: one more copy of every tensor",
)
SET_PG_TIMEOUT = PrivateName(
    "torch.distributed.distributed_c10d",
    "_set_pg_timeout",
    "lowering a process group's timeout after the first iteration (parallel.train_timeout_s, "
    "operations/watchdog.py), as torchtitan's set_pg_timeouts does; used only where the group has no public "
    "set_timeout (torch 2.13 has it; older releases may not)",
    "ProcessGroup.set_timeout where it exists; without either the groups keep the start-up timeout",
)
LOADER_SHUTDOWN = PrivateName(
    "torch.utils.data.dataloader",
    "_MultiProcessingDataLoaderIter._shutdown_workers",
    "stopping the training loader's worker processes on every way out of the loop, an exception included "
    "(operations/loader_workers.py): torch calls it only when the iterator is garbage-collected, which a "
    "traceback's frames prevent, and skips it once the interpreter exits, where multiprocessing then waits "
    "forever for workers that ignore SIGTERM",
    "none (a DataLoader iterator has no public close): without it the workers are SIGKILLed, and torch's "
    "SIGCHLD handler may report them as failed (a second error after the first)",
)
GROUPED_MM = PrivateName(
    "torch",
    "_grouped_mm",
    "the experts of a Mixture-of-Experts layer in one matrix multiply over their token groups "
    "(model/moe/experts.py): one launch instead of one per expert, torch's CUTLASS grouped GEMM on CUDA; it "
    "needs row strides of a multiple of 16 bytes (hidden and expert FFN sizes a multiple of 4 in fp32, 8 in "
    "bf16)",
    "none yet: without it (or for unaligned sizes) the experts run one torch.mm each over their token groups",
)

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    AUTOGRAD_ENGINE,
    FOREACH_NORM,
    FUSED_SDP_CHOICE,
    TENSOR_BASE,
    *DCP_METADATA_NAMES,
    PICKLED_LAYOUT,
    PICKLED_TENSOR,
    SET_PG_TIMEOUT,
    LOADER_SHUTDOWN,
    GROUPED_MM,
)


def resolve(name: PrivateName) -> Any:
    """The object `name` refers to in the installed torch; AttributeError / ImportError when it is gone."""
    value: object = importlib.import_module(name.module)
    for part in name.path.split("."):
        value = getattr(value, part)
    return value


def dcp_metadata_classes() -> dict[str, tuple[str, ...]]:
    """{module: private class names} that a DCP .metadata pickle may reference (strings: nothing imported)."""
    classes: dict[str, tuple[str, ...]] = {}
    for name in DCP_METADATA_NAMES:
        classes[name.module] = classes.get(name.module, ()) + (name.path,)
    return classes


class AutogradEngine(Protocol):
    """What the pipeline calls on torch's autograd engine (parallel/pipeline/weight_grad.engine_run)."""

    def run_backward(
        self,
        tensors: tuple[torch.Tensor | GradientEdge, ...],
        grad_tensors: tuple[torch.Tensor, ...],
        keep_graph: bool,
        create_graph: bool,
        inputs: tuple[torch.Tensor, ...],
        allow_unreachable: bool,
        accumulate_grad: bool,
    ) -> tuple[torch.Tensor, ...]: ...


def autograd_engine() -> AutogradEngine | None:
    """torch's autograd engine object when it has `run_backward` (AUTOGRAD_ENGINE), else None."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return engine if engine is not None and hasattr(engine, "run_backward") else None


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor (FOREACH_NORM)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:
        return [torch.linalg.vector_norm(t) for t in tensors]
    return list(fused(tensors))


def fused_sdp_choice() -> Callable[..., int] | None:
    """torch's SDPA backend selector (FUSED_SDP_CHOICE), or None when this torch has none."""
    return getattr(torch, "_fused_sdp_choice", None)


def is_view(tensor: torch.Tensor) -> bool | None:
    """Whether `tensor` is a view of another tensor's storage (TENSOR_BASE); None when torch cannot say."""
    if not hasattr(torch.Tensor, "_base"):
        return None
    return tensor._base is not None


def set_group_timeout(group: object, timeout: timedelta) -> bool:
    """Make `timeout` the timeout of `group`'s future collectives: the public ProcessGroup.set_timeout, else
    SET_PG_TIMEOUT; False when this torch has neither (the group keeps its timeout)."""
    setter = getattr(group, "set_timeout", None)
    if setter is not None:
        setter(timeout)
        return True
    try:  # by name: compat/ imports no torch.distributed (its caller already has)
        private = resolve(SET_PG_TIMEOUT)
    except (ImportError, AttributeError):
        return False
    private(timeout, group)
    return True


def shutdown_loader_workers(iterator: object) -> bool:
    """Stop the worker processes of a DataLoader iterator the way torch does when it is collected
    (LOADER_SHUTDOWN: the workers leave their loops, each is joined for up to 5 s); False when `iterator` has no
    workers to stop or this torch lacks the method."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        return False
    shutdown()
    return True


GroupedMM = Callable[..., torch.Tensor]  # (mat_a [T, K], mat_b [G, K, N], *, offs [G] int32) -> [T, N]


def grouped_mm() -> GroupedMM | None:
    """torch's grouped matrix multiply (GROUPED_MM), or None when this torch has none."""
    return getattr(torch, "_grouped_mm", None)
