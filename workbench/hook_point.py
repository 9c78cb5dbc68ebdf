"""``HookPoint``: TransformerLens's hook point that can also store what it passes on into a cache.

Every hook point of a ``Decoder`` is one of these (they are TransformerLens ``HookPoint``s in every other
respect). ``run_with_cache`` with TransformerLens's default options points ``cache_into`` of each point it
caches at its cache dict instead of attaching a caching hook there: the point then stores its output,
detached, after any attached hooks have run (so the cache holds what they returned, as a caching hook
added last would). A torch forward hook per point costs torch's slow call path plus a handle added and
removed per call (~4 us a point, 2-3 ms of SmolLM2-135M's ~600-point cached forward); this costs one
attribute test per call when not caching. A point with nothing attached skips torch's module call, whose
result would be its input (~1 us -> ~0.4 us a point; a decoding step of SmolLM2-135M passes ~600 points).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.nn.modules import module as _torch_module
from transformer_lens.hook_points import HookPoint as TransformerLensHookPoint


class HookPoint(TransformerLensHookPoint):
    """A TransformerLens ``HookPoint`` that writes its output into ``cache_into[name]`` while that is a dict.

    Example:
        >>> import torch
        >>> point = HookPoint(); point.name = "hook_x"; point.cache_into = {}
        >>> _ = point(torch.ones(2)); point.cache_into
        {'hook_x': tensor([1., 1.])}
    """

    cache_into: Optional[dict] = None  # set on an instance only while run_with_cache caches it

    def __call__(self, tensor: Tensor) -> Tensor:
        # Torch's module call runs forward (the identity) and any attached hooks; with none it returns the
        # input, which is given back here directly, ~0.6 us sooner.
        out = super().__call__(tensor) if _anything_attached(self) else tensor
        if self.cache_into is not None:
            self.cache_into[self.name] = out.detach()
        return out


def _anything_attached(point: HookPoint) -> bool:
    """Whether torch's module call would do more than call ``forward``: a hook on the point or on every
    module, a compiled call, JIT tracing (the conditions of ``nn.Module._call_impl``'s own fast path)."""
    return bool(point._forward_hooks or point._forward_pre_hooks or point._backward_hooks or point._backward_pre_hooks
                or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
                or _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks
                or getattr(point, "_compiled_call_impl", None) is not None or torch._C._get_tracing_state())


@contextmanager
def caching_into(points: Sequence[HookPoint], cache: dict) -> Iterator[dict]:
    """Within the block each of ``points`` stores its output into ``cache``; afterwards each gets back
    what it stored into before (None, or the cache of a ``run_with_cache`` this one runs inside a hook of),
    even when the block raises.

    Example:
        >>> import torch
        >>> point = HookPoint(); point.name = "hook_x"
        >>> with caching_into([point], {}) as cache:
        ...     _ = point(torch.zeros(1))
        >>> cache, point.cache_into
        ({'hook_x': tensor([0.])}, None)
    """
    outer = [point.cache_into for point in points]
    for point in points:
        point.cache_into = cache
    try:
        yield cache
    finally:
        for point, previous in zip(points, outer):
            point.cache_into = previous
