"""Splicing SAEs into a model: SAELens's ``HookedSAETransformer`` behaviour as hooks over the model's public surface.

The model knows no dictionary: ``Decoder``'s ``add_sae``, ``reset_saes``, ``saes``, ``run_with_saes``,
``run_with_cache_with_saes``, ``run_with_hooks_with_saes`` and ``acts_to_saes`` are one-line forwards
(``workbench.sae_splicing``) to the functions here, which use only what any model offers: ``hook_dict`` /
``mod_dict``, ``add_hook`` on its hook points, ``check_hook_names``, ``layer_of``, the call lock
(``workbench.call_lock``), the cacher (``workbench.hook_point.caching``) and its forward.

How a splice works:

- An SAE is a permanent forward hook (kept by ``reset_hooks()``, as SAELens's) on its ``cfg.hook_name``: it
  replaces the activation by ``sae.reconstruct`` of it, plus the error term ``activation - clean reconstruction``
  with ``use_error_term``. A transcoder reads ``hook_name`` (a hook that keeps the activation) and writes
  ``hook_name_out`` (one that replaces that activation by the transcoder's output, with its skip term).
- Each splice has its own hook points, SAELens's ``hook_sae_*``, joined to the model's ``hook_dict`` as
  ``"{hook_name_out}.hook_sae_*"`` (SAELens's cache keys) while spliced: ``run_with_cache``, ``run_with_hooks``
  and ``names_filter`` reach them by those names. They are not the SAE's own points, so the SAE used directly
  (``sae.encode``, in another thread too) never fires into that run's cache or receives its edits.
- A transcoder's kept input lives for one forward: a forward pre-hook on the model opens a slot for it and a forward
  hook (``always_call``) drops it, so a call that stopped (``stop_at_layer``) or raised between the two hooks never
  lends its input to a later call, and a hook that runs the model again keeps its own.

Every entry point holds the model's call lock while it attaches, runs or detaches (a ``saes`` block until it ends),
and whatever a call attached is removed after any error. Splices are kept beside the model (weak mappings), not on
it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.call_lock import model_lock
from workbench.errors import InputError
from workbench.hook_point import HookPoint, caching
from workbench.sae import math
from workbench.sae.model import HOOK_NAMES, SAE

_SPLICES: "weakref.WeakKeyDictionary[Any, dict[str, _Splice]]" = weakref.WeakKeyDictionary()  # model -> by input hook
_SHAPES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # model -> (hook, options) -> shape
_SPLICED_INTO: "weakref.WeakKeyDictionary[SAE, tuple[Any, str]]" = weakref.WeakKeyDictionary()


def splices(model: Any) -> dict[str, "_Splice"]:
    """The splices in ``model`` now, by the hook each reads (made empty on first use).

    Example:
        >>> splices(model)
        {}
    """
    table = _SPLICES.get(model)
    if table is None:
        table = _SPLICES.setdefault(model, {})
    return table


def acts_to_saes(model: Any) -> dict[str, SAE]:
    """``model.acts_to_saes``: the SAEs spliced now, by the hook each reads.

    Example:
        >>> acts_to_saes(model)
        {}
    """
    return {name: splice.sae for name, splice in splices(model).items()}


def add_sae(model: Any, sae: SAE, use_error_term: Optional[bool] = None) -> None:
    """``model.add_sae``: splices ``sae`` in until ``reset_saes`` (replacing one reading the same hook).

    Example:
        >>> add_sae(model, "not an SAE")
        Traceback (most recent call last):
        workbench.errors.InputError: saes must be wb.SAE objects (wb.load_sae(path)), got str
    """
    with model_lock(model):
        splice = _checked_splice(model, sae, use_error_term)
        previous = splices(model).get(splice.input_hook)
        if previous is not None:
            _detach(model, previous)
        _attach(model, splice)


def reset_saes(model: Any, act_names: Union[str, Sequence[str], None] = None) -> None:
    """``model.reset_saes``: removes the SAEs reading ``act_names`` (None: all) and every hook on their points.

    Example:
        >>> reset_saes(model, "blocks.0.hook_resid_pre")
        Traceback (most recent call last):
        workbench.errors.InputError: no SAE is spliced at 'blocks.0.hook_resid_pre' (spliced: none)
    """
    with model_lock(model):
        table = splices(model)
        names = list(table) if act_names is None else [act_names] if isinstance(act_names, str) else list(act_names)
        unknown = [name for name in names if name not in table]
        if unknown:
            raise InputError(f"no SAE is spliced at {', '.join(map(repr, unknown))} (spliced: {list(table) or 'none'})")
        for name in names:
            _detach(model, table[name])


@contextmanager
def spliced(model: Any, saes: Union[SAE, Sequence[SAE]] = (), reset_saes_end: bool = True,
            use_error_term: Optional[bool] = None) -> Iterator[Any]:
    """``model.saes``: a block with ``saes`` spliced in, holding the model's lock; on leaving (even after an error)
    they are removed and any SAE they replaced is back.

    Example:
        >>> with spliced(model, []) as same:
        ...     same is model
        True
    """
    saes = [saes] if isinstance(saes, SAE) else list(saes)
    with model_lock(model):
        replaced: list[tuple[_Splice, Optional[_Splice]]] = []
        try:
            for sae in saes:
                splice = _checked_splice(model, sae, use_error_term)
                previous = splices(model).get(splice.input_hook)
                if previous is not None:
                    _detach(model, previous)
                replaced.append((splice, previous))
                _attach(model, splice)
            yield model
        finally:
            if reset_saes_end:
                for splice, previous in reversed(replaced):
                    if splices(model).get(splice.input_hook) is splice:
                        _detach(model, splice)
                    if previous is not None:
                        _attach(model, previous)


# ---- checks ---------------------------------------------------------------------------------------------------
def _checked_splice(model: Any, sae: Any, use_error_term: Optional[bool]) -> "_Splice":
    """A splice of ``sae`` after checking it fits: its hooks exist and carry activations of its widths."""
    if not isinstance(sae, SAE):
        raise InputError(f"saes must be wb.SAE objects (wb.load_sae(path)), got {type(sae).__name__}")
    cfg = sae.cfg
    if cfg.hook_name is None:
        raise InputError(f"{sae!r} has no cfg.metadata.hook_name: set the hook point it reads")
    for role, name in (("reads", cfg.hook_name), ("writes", cfg.hook_name_out)):
        if name not in model.hook_dict:
            try:
                model.check_hook_names([name])
            except InputError as error:
                raise InputError(f"{sae!r} {role} hook {name!r}, which this model does not have: {error}") from None
    head = cfg.metadata.hook_head_index
    if head is not None and (cfg.is_transcoder or cfg.reshape_activations != "none"):
        raise InputError(f"{sae!r}: cfg.metadata.hook_head_index={head} cannot be honoured on a transcoder or "
                         f"with reshape_activations={cfg.reshape_activations!r} (a one-head SAE reads d_head)")
    for other in splices(model).values():  # the one reading the same hook is replaced, not shared
        if other.output_hook == cfg.hook_name_out and other.input_hook != cfg.hook_name:
            raise InputError(f"{sae!r} would share hook {cfg.hook_name_out!r} with {other.sae!r}, spliced "
                             "already: one SAE per hook point")
    attached_at = _SPLICED_INTO.get(sae)
    if attached_at is not None and not (attached_at[0] is model and attached_at[1] == cfg.hook_name):
        raise InputError(f"{sae!r} is spliced into another model or hook already: reset it there first")
    _check_widths(model, sae)
    use = sae.use_error_term if use_error_term is None else use_error_term
    return _Splice(sae, bool(use), cfg.hook_name, cfg.hook_name_out)


def _check_widths(model: Any, sae: SAE) -> None:
    """An SAE whose ``d_in`` (``d_out``) does not match what its hook carries is an ``InputError`` naming both."""
    cfg = sae.cfg
    got_in, got_out = _hook_shape(model, cfg.hook_name), _hook_shape(model, cfg.hook_name_out)
    head = cfg.metadata.hook_head_index
    if got_in is None or got_out is None:
        raise InputError(f"{sae!r}: hook {cfg.hook_name!r} or {cfg.hook_name_out!r} does not fire in this "
                         "model's forward pass")
    if head is not None:
        if len(got_in) < 4 or not 0 <= head < got_in[-2]:
            raise InputError(f"{sae!r}: cfg.metadata.hook_head_index={head} needs a per-head hook with more "
                             f"heads, but {cfg.hook_name!r} has shape {got_in}")
        width_in = width_out = got_in[-1]
    elif cfg.reshape_activations == "hook_z":
        width_in = width_out = got_in[-1] * got_in[-2] if len(got_in) >= 4 else None
    else:
        width_in, width_out = got_in[-1], got_out[-1]
    if width_in != cfg.d_in or width_out != cfg.d_out:
        what = (f"d_in={cfg.d_in}" if width_in != cfg.d_in else f"d_out={cfg.d_out}")
        raise InputError(f"{sae!r} has {what}, but this model's hook {cfg.hook_name!r} carries "
                         f"{got_in[2:]} per token" + (f" and {cfg.hook_name_out!r} {got_out[2:]}"
                                                      if cfg.is_transcoder else "")
                         + (" (a hook_z SAE reads heads x d_head flattened)"
                            if cfg.reshape_activations == "hook_z" else ""))


def _hook_shape(model: Any, name: str) -> Optional[tuple[int, ...]]:
    """The shape hook ``name`` carries for one token (None if it never fires): one token through the blocks up to
    it, remembered per hook and runtime options (a splice per call costs no extra forward)."""
    known = _SHAPES.get(model)
    if known is None:
        known = _SHAPES.setdefault(model, {})
    key = (name, repr(model.options))  # use_split_qkv_input and use_attn_result change what some hooks carry
    if key not in known:
        layer = model.layer_of(name)
        shapes = _Shapes()
        tokens = torch.zeros((1, 1), dtype=torch.long, device=model.cfg.device)
        with torch.no_grad(), caching(model.hook_dict, name.__eq__, shapes):
            model(tokens, return_type=None, stop_at_layer=None if layer is None else layer + 1)
        known[key] = shapes.get(name)
    return known[key]


class _Shapes(dict):
    """A cache sink that keeps each activation's shape."""

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        super().__setitem__(name, tuple(tensor.shape))


# ---- attaching ------------------------------------------------------------------------------------------------
def _attach(model: Any, splice: "_Splice") -> None:
    for name, point in splice.points.items():  # the splice's hook points join the model's under SAELens's keys
        point.name = f"{splice.output_hook}.{name}"
        model.hook_dict[point.name] = point
        model.mod_dict[point.name] = point
    if splice.input_hook != splice.output_hook:
        splice.hooks.append(model.hook_dict[splice.input_hook].add_hook(splice.keep_input, is_permanent=True))
        splice.forward_hooks = [model.register_forward_pre_hook(splice.start_forward),
                                model.register_forward_hook(splice.end_forward, always_call=True)]
    splice.hooks.append(model.hook_dict[splice.output_hook].add_hook(splice.replace, is_permanent=True))
    _SPLICED_INTO[splice.sae] = (model, splice.input_hook)
    splices(model)[splice.input_hook] = splice


def _detach(model: Any, splice: "_Splice") -> None:
    for handle in splice.hooks:
        handle.hook.remove()
        for point_name in (splice.input_hook, splice.output_hook):
            point = model.hook_dict.get(point_name)
            if point is not None and handle in point.fwd_hooks:
                point.fwd_hooks.remove(handle)
    splice.hooks.clear()
    for handle in splice.forward_hooks:
        handle.remove()
    splice.forward_hooks.clear()
    splice.captured.clear()
    for point in splice.points.values():
        point.remove_hooks("both", including_permanent=True)  # nothing a user hooked there stays
        model.hook_dict.pop(point.name, None)
        model.mod_dict.pop(point.name, None)
    _SPLICED_INTO.pop(splice.sae, None)
    if splices(model).get(splice.input_hook) is splice:
        del splices(model)[splice.input_hook]


@dataclass(eq=False)
class _Splice:
    """One spliced SAE: where it reads and writes, its error-term choice, its own hook points, the hooks it attached
    and (for a transcoder) the input it keeps between its two hooks within one forward."""

    sae: SAE
    use_error_term: bool
    input_hook: str
    output_hook: str
    points: dict[str, HookPoint] = field(default_factory=lambda: {name: HookPoint() for name in HOOK_NAMES})
    hooks: list = field(default_factory=list)
    forward_hooks: list = field(default_factory=list)
    # One slot per forward in progress (a hook may run the model again): what the input hook kept in that forward.
    captured: list[Optional[Tensor]] = field(default_factory=list)

    def start_forward(self, module: Any, args: Any) -> None:
        self.captured.append(None)

    def end_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.captured:  # also after a forward that stopped early or raised: its input goes with it
            self.captured.pop()

    def keep_input(self, activation: Tensor, hook: Any) -> None:
        if self.captured:
            self.captured[-1] = activation

    def replace(self, activation: Tensor, hook: Any) -> Tensor:
        source = activation
        if self.input_hook != self.output_hook:
            source = self.captured[-1] if self.captured else None
            if self.captured:
                self.captured[-1] = None
            if source is None:
                raise InputError(f"the transcoder {self.sae!r} writes {self.output_hook!r}, which fired before its "
                                 f"input hook {self.input_hook!r} in this forward pass")
        head = self.sae.cfg.metadata.hook_head_index
        if head is not None:  # an SAE of one head of a per-head hook: that head only
            out = activation.clone()
            out[..., head, :] = self._reconstruct(source[..., head, :], activation[..., head, :])
            return out
        return self._reconstruct(source, activation)

    def _reconstruct(self, source: Tensor, activation: Tensor) -> Tensor:
        device = self.sae.device
        target = activation.to(device) if self.use_error_term else None
        out = self.sae.reconstruct_at(math.Points.of(self.points), source.to(device), target)
        return out.to(device=activation.device, dtype=activation.dtype)
