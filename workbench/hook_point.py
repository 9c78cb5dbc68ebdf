"""Hook points, and the one way anything observes or caches them.

``HookPoint`` is TransformerLens's hook point that can also store what it passes on into a cache sink.
Every hook point of a ``Decoder`` is one of these (they are TransformerLens ``HookPoint``s in every other
respect).

- ``is_observed(point)`` is the one answer to "does anything read or edit what passes this point": a
  forward, pre-forward or backward hook on it, torch's global module hooks, a cache sink, a compiled call or
  JIT tracing. The attention kernels ask it before skipping a pattern (``hook_pattern`` under ``sdpa`` runs
  eager when observed), and the point itself asks it before anything else.
- ``caching`` (a context) and ``caching_hooks`` (hooks that outlive one call: gradients, TransformerLens's
  ``reset_hooks_end=False``) are the one cacher: a name predicate picks the points, a sink (anything with
  ``sink[name] = tensor``: a dict, a batch's buffer, a shard writer, a shape recorder) receives each tensor,
  detached, after the point's own hooks ran, with TransformerLens's ``device``, ``remove_batch_dim`` and
  ``pos_slice`` applied on the way. ``run_with_cache`` (one pass or in batches), ``get_caching_hooks``,
  ``add_caching_hooks`` and ``cache_size`` all cache through them.

Why a sink on the point rather than a torch forward hook: a hook costs torch's slow call path plus a handle
added and removed per call (~4 us a point, 2-3 ms of SmolLM2-135M's ~600-point cached forward); a sink
costs one attribute test per call when not caching. A point nothing observes skips torch's module call,
whose result would be its input (~1 us -> ~0.4 us a point; a decoding step of SmolLM2-135M passes ~600).
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module
from transformer_lens.hook_points import HookPoint as TransformerLensHookPoint
from transformer_lens.utilities import Slice
from transformer_lens.utilities import remove_batch_dim as drop_batch_dim

from workbench.memory import keep_freed_memory_for_caching


class CacheSink(Protocol):
    """Where cached activations go: ``sink[name] = tensor`` (a dict is one)."""

    def __setitem__(self, name: str, tensor: Tensor) -> None: ...


class HookPoint(TransformerLensHookPoint):
    """A TransformerLens ``HookPoint`` that writes its output into ``cache_into[name]`` while a sink is set.

    Example:
        >>> point = HookPoint(); point.name = "hook_x"; point.cache_into = {}
        >>> _ = point(torch.ones(2)); point.cache_into
        {'hook_x': tensor([1., 1.])}
    """

    cache_into: Optional[CacheSink] = None  # set on an instance only while a ``caching`` block caches it
    # Other names of this one point (``blocks.0.hook_in`` for ``blocks.0.hook_resid_pre``): a cache keys what
    # passes here by each name the caller asked for. Set by the model (``Decoder.hook_aliases``).
    aliases: tuple[str, ...] = ()

    def __call__(self, tensor: Tensor) -> Tensor:
        if not is_observed(self):  # the common case: the point is the identity
            return tensor
        # Torch's module call runs forward (the identity) and the attached hooks; a point that is only
        # cached skips it (~0.6 us a point).
        out = super().__call__(tensor) if _module_call_observed(self) else tensor
        if self.cache_into is not None:
            self.cache_into[self.name] = out.detach()
        return out


def is_observed(point: HookPoint) -> bool:
    """Whether anything reads or edits what passes ``point``: a hook on it (forward, pre-forward, backward),
    a global module hook, a cache sink, a compiled call or JIT tracing. The kernels ask this before
    skipping a tensor they would otherwise never materialise (an attention pattern, per-head results).

    Example:
        >>> point = HookPoint(); is_observed(point)
        False
        >>> handle = point.register_forward_pre_hook(lambda module, args: None); is_observed(point)
        True
        >>> handle.remove(); point.cache_into = {}; is_observed(point)
        True
    """
    return point.cache_into is not None or _module_call_observed(point)


def has_forward_hooks(*modules: object) -> bool:
    """Whether a torch forward hook (the module's own or a global one) sees or replaces what any of
    ``modules`` returns; anything not a module (a plain function) has none. A component asks this before it
    writes into the tensor a submodule returned.

    Example:
        >>> layer = nn.Identity(); has_forward_hooks(layer, torch.relu)
        False
        >>> handle = layer.register_forward_hook(lambda module, args, out: None); has_forward_hooks(layer)
        True
    """
    return bool(_torch_module._global_forward_hooks) or any(
        isinstance(module, nn.Module) and bool(module._forward_hooks) for module in modules)


def _module_call_observed(point: HookPoint) -> bool:
    """Whether torch's module call would do more than call ``forward``: the conditions of
    ``nn.Module._call_impl``'s own fast path."""
    return bool(point._forward_hooks or point._forward_pre_hooks or point._backward_hooks or point._backward_pre_hooks
                or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
                or _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks
                or getattr(point, "_compiled_call_impl", None) is not None or torch._C._get_tracing_state())


@dataclass(frozen=True)
class _Reshaping:
    """A sink that applies TransformerLens's caching options, then writes into ``sink``: the tensor moved to
    ``device``, its batch axis dropped, its position axis sliced (``hook_q``/``k``/``v``/``z``/``result``
    carry positions third from last, every other point second from last, as TransformerLens slices them)."""

    sink: CacheSink
    device: Any = None
    remove_batch_dim: bool = False
    pos_slice: Optional[Slice] = None

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        tensor = tensor.to(self.device) if self.device is not None else tensor
        if self.remove_batch_dim:
            tensor = drop_batch_dim(tensor)
        if self.pos_slice is not None:
            pos_dim = -3 if name.endswith(_HEAD_AXIS_POINTS) else -2
            if tensor.dim() >= -pos_dim:
                tensor = self.pos_slice.apply(tensor, dim=pos_dim)
        self.sink[name] = tensor


_HEAD_AXIS_POINTS = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_result")


def _sink_with_options(sink: CacheSink, device: Any, remove_batch_dim: bool, pos_slice: Any) -> CacheSink:
    pos_slice = Slice.unwrap(pos_slice) if pos_slice is not None else None
    if device is None and not remove_batch_dim and (pos_slice is None or pos_slice.mode == "identity"):
        return sink  # the plain case stores straight into the sink
    return _Reshaping(sink, device, remove_batch_dim, pos_slice)


@contextmanager
def caching(hook_dict: Mapping[str, HookPoint], is_cached: Callable[[str], bool], sink: CacheSink, *,
            device: Any = None, remove_batch_dim: bool = False, pos_slice: Any = None,
            clear_contexts: bool = False) -> Iterator[CacheSink]:
    """Within the block each point of ``hook_dict`` whose name ``is_cached`` stores what it passes on
    (detached, after its hooks ran) into ``sink``; afterwards each gets back the sink it had before (None,
    or that of a ``caching`` block this one runs inside a hook of), even when the block raises.
    ``device``, ``remove_batch_dim``, ``pos_slice``, ``clear_contexts`` (every point's ``ctx`` emptied on
    leaving): TransformerLens's ``run_with_cache`` options.

    Example:
        >>> point = HookPoint(); point.name = "hook_x"
        >>> with caching({"hook_x": point}, lambda name: True, {}) as cache:
        ...     _ = point(torch.zeros(2, 3))
        >>> cache, point.cache_into
        ({'hook_x': tensor([[0., 0., 0.], [0., 0., 0.]])}, None)
        >>> with caching({"hook_x": point}, lambda name: True, {}, pos_slice=-1) as cache:   # [batch, pos, d]
        ...     _ = point(torch.arange(6.).view(1, 3, 2))
        >>> cache["hook_x"]
        tensor([[[4., 5.]]])
    """
    keep_freed_memory_for_caching()
    target = _sink_with_options(sink, device, remove_batch_dim, pos_slice)
    selected = _selected_names(hook_dict, is_cached)
    points = list(selected)
    outer = [point.cache_into for point in points]
    for point, names in selected.items():
        point.cache_into = target if names == (point.name,) else _Renamed(target, names)
    try:
        yield sink
    finally:
        for point, previous in zip(points, outer):
            point.cache_into = previous
        if clear_contexts:
            for point in hook_dict.values():
                point.clear_context()


def caching_hooks(hook_dict: Mapping[str, HookPoint], is_cached: Callable[[str], bool], sink: CacheSink, *,
                  incl_bwd: bool = False, device: Any = None, remove_batch_dim: bool = False,
                  pos_slice: Any = None) -> tuple[list, list]:
    """The cacher as (name, hook) pairs, forward and backward (gradients under ``name + "_grad"`` with
    ``incl_bwd``), for caching that outlives one call (TransformerLens's ``get_caching_hooks``,
    ``add_caching_hooks``, ``run_with_cache(incl_bwd=True)`` or ``reset_hooks_end=False``). They store
    what ``caching`` would.

    Example:
        >>> point = HookPoint(); point.name = "hook_x"
        >>> cache = {}; fwd, bwd = caching_hooks({"hook_x": point}, lambda name: True, cache)
        >>> _ = point.add_hook(fwd[0][1]); _ = point(torch.ones(1)); point.remove_hooks(); cache
        {'hook_x': tensor([1.])}
    """
    keep_freed_memory_for_caching()
    target = _sink_with_options(sink, device, remove_batch_dim, pos_slice)
    selected = _selected_names(hook_dict, is_cached)
    fwd = [(point.name, partial(_store, target, names, "")) for point, names in selected.items()]
    bwd = [(point.name, partial(_store, target, names, "_grad")) for point, names in selected.items()] if incl_bwd else []
    return fwd, bwd


def _store(sink: CacheSink, names: tuple[str, ...], suffix: str, tensor: Tensor, hook: HookPoint) -> None:
    for name in names:
        sink[name + suffix] = tensor.detach()


def _selected_names(hook_dict: Mapping[str, HookPoint], is_cached: Callable[[str], bool]) -> dict[HookPoint, tuple[str, ...]]:
    """Each point with a name (its own or an alias) that ``is_cached`` selects, and those names."""
    selected = {}
    for name, point in hook_dict.items():
        names = tuple(n for n in (name, *point.aliases) if is_cached(n))
        if names:
            selected[point] = names
    return selected


def add_aliases(hook_dict: Mapping[str, HookPoint], mod_dict: dict, aliases: Mapping[str, str]) -> None:
    """Makes each ``alias`` a second name of the point ``hook_dict[own]``: hooks by that name reach the point
    (``mod_dict``, which TransformerLens's hook methods look names up in) and caches key it by that name.

    Example:
        >>> point = HookPoint(); point.name = "hook_x"; mods = {"hook_x": point}
        >>> add_aliases({"hook_x": point}, mods, {"hook_y": "hook_x"}); mods["hook_y"] is point, point.aliases
        (True, ('hook_y',))
    """
    for alias, own in aliases.items():
        point = hook_dict[own]
        if alias not in point.aliases:
            point.aliases = (*point.aliases, alias)
        mod_dict[alias] = point


@dataclass(frozen=True)
class _Renamed:
    """A sink that stores what a point passes under the names the caller asked for (an alias, or both)."""

    sink: CacheSink
    names: tuple[str, ...]

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        for asked in self.names:
            self.sink[asked] = tensor


# ---- "did you mean": by meaning first, then by spelling ---------------------------------------------------
# Names other libraries give a point we have under another name (TransformerBridge's component hooks), as
# (pattern, our name): the pattern's groups fill the ``{}``s. They come before spelling's guesses.
_SAME_MEANING = (
    (r"blocks\.(\d+)\.attn\.hook_in", "blocks.{}.ln1.hook_normalized"),
    (r"blocks\.(\d+)\.attn\.hook_out", "blocks.{}.hook_attn_out"),
    (r"blocks\.(\d+)\.mlp\.hook_in", "blocks.{}.ln2.hook_normalized"),
    (r"blocks\.(\d+)\.mlp\.hook_out", "blocks.{}.hook_mlp_out"),
    (r"blocks\.(\d+)\.hook_attn_in", "blocks.{}.hook_resid_pre"),
    (r"blocks\.(\d+)\.(?:hook_)?(?:in|input|resid_in)", "blocks.{}.hook_resid_pre"),
    (r"blocks\.(\d+)\.(?:hook_)?(?:out|output|resid_out)", "blocks.{}.hook_resid_post"),
    (r"blocks\.(\d+)\.(ln[12])\.hook_(?:in)", "blocks.{}.{}.hook_normalized"),
    (r"blocks\.(\d+)\.(ln[12])\.hook_(?:out)", "blocks.{}.{}.hook_normalized"),
    (r"ln_final\.hook_(?:in|out)", "ln_final.hook_normalized"),
    (r"embed\.hook_(?:in|out)", "hook_embed"),
    (r"pos_embed\.hook_(?:in|out)", "hook_pos_embed"),
    (r"(?:unembed\.hook_in|hook_unembed_in)", "ln_final.hook_normalized"),
)


def nearest_hook_names(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``known`` that ``name`` most likely meant: the point of the same meaning first (TransformerLens's
    and TransformerBridge's names for it, ``hook_in`` -> ``hook_resid_pre``), then the closest spellings.

    Example:
        >>> nearest_hook_names("blocks.0.attn.hook_out", ["blocks.0.hook_attn_out", "blocks.0.attn.hook_z"])
        ['blocks.0.hook_attn_out', 'blocks.0.attn.hook_z']
        >>> nearest_hook_names("blocks.2.hook_input", ["blocks.2.hook_resid_pre", "blocks.2.hook_v_input"])[0]
        'blocks.2.hook_resid_pre'
    """
    known = list(known)
    by_meaning = []
    for pattern, ours in _SAME_MEANING:
        match = re.fullmatch(pattern, name)
        if match and ours.format(*match.groups()) in known:
            by_meaning.append(ours.format(*match.groups()))
    by_spelling = difflib.get_close_matches(name, known, n=n, cutoff=0.6)
    return list(dict.fromkeys(by_meaning + by_spelling))[:n]
