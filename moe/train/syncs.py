"""Host syncs: the ops that make the host wait for the device (a device-to-host read, or an
output whose size depends on the data), counted under a dispatch mode.

On a GPU each one stalls the launch queue until the device has caught up; a training step
that makes none lets the host run ahead and the GPU never waits on Python. The trainer reads
the device once per `log_every` steps (and at a save or a stop decision); `HostSyncs` is how
the tests and the GPU benchmark hold it to that, on any device (a CPU op that would sync on a
GPU counts the same).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops (overload packets) that read the device on the host or size their output by data.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(t), int(t), bool(t), `if t:`
        "is_nonzero",
        "equal",
        "nonzero",  # boolean indexing, masked_select, torch.where(cond)
        "masked_select",
        "bincount",  # sizes its output by the largest value (a max read on CUDA)
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }
)


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":  # tensor repeats without output_size: summed on the host
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        # x[mask] and x[mask] = v: boolean indices become nonzero()
        return any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
    if name == "_to_copy":  # t.cpu(), t.to("cpu") of a device tensor
        to = kwargs.get("device")
        return _on_device(args[0]) and to is not None and torch.device(to).type == "cpu"
    if name == "copy_" and len(args) > 1:  # host.copy_(device tensor)
        return not _on_device(args[0]) and _on_device(args[1])
    return False


def _on_device(t: Any) -> bool:
    """A tensor on an accelerator (not the host's memory, nor the meta device)."""
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


# Tensor methods that read the data on the host without dispatching an aten op: wrapped.
# (`.numpy()` takes host tensors only: its device read is the `.cpu()` before it, counted.)
_WRAPPED = ("tolist",)


class HostSyncs(TorchDispatchMode):
    """Counts host syncs while active, each labelled by `label()` (the trainer's step, say):
    `counts[(label, op)]`. `.tolist()` does not dispatch: it is counted by wrapping it.
    What torch.compile compiles runs compiled under it (`ignore_compile_internals`: else
    Dynamo would fall back to eager code, and FlexAttention, which packed rows run on a GPU,
    refuses to run at all); what the compiled code calls at run time is counted. A
    higher-order operator (FlexAttention's) passes through whole, its inner ops uncounted."""

    supports_higher_order_operators = True  # else torch refuses them under the mode

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(
        self,
        label: Callable[[], Any] = lambda: None,
        ignore: Callable[[tuple], bool] = lambda args: False,
    ) -> None:
        """`ignore(args)`: True for a read that is not a device's (a counter the host holds)."""
        super().__init__()
        self.label, self.ignore = label, ignore
        self.counts: Counter[tuple[Any, str]] = Counter()
        self._methods: dict[str, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if _is_sync(func, args, kwargs) and not self.ignore(args):
            self.counts[(self.label(), func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncs:
        for name in _WRAPPED:
            self._methods[name] = method = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, method))
        return super().__enter__()

    def _counting(self, name: str, method: Any) -> Any:
        def counted(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.counts[(self.label(), name)] += 1
            return method(t, *a, **k)

        return counted

    def __exit__(self, *exc: Any) -> None:
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        super().__exit__(*exc)

    def at(self, label: Any) -> Counter[str]:
        """The syncs counted under one label, by op."""
        return Counter({op: n for (lab, op), n in self.counts.items() if lab == label})
