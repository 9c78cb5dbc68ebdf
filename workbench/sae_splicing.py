"""Splicing SAEs into a ``Decoder``: SAELens's ``HookedSAETransformer`` methods, on the model's own hooks.

A mixin of ``workbench.model.Decoder``: ``add_sae``, ``reset_saes``, ``saes`` (a context), ``run_with_saes``,
``run_with_cache_with_saes``, ``run_with_hooks_with_saes`` and ``acts_to_saes``, with SAELens's names and
arguments, so its users' code runs unchanged.

How a splice works, with the model's one hook machinery (no second one):

- An SAE is a forward hook (TransformerLens's ``HookPoint.add_hook``, permanent until the SAE is removed, so
  ``reset_hooks()`` leaves it as SAELens's does) on the hook point ``cfg.hook_name``: it replaces the activation
  by ``sae.reconstruct(activation)``, plus the error term ``activation - clean reconstruction`` with
  ``use_error_term`` (so the model's output is unchanged while the SAE's hooks fire, and an edit of
  ``hook_sae_acts_post`` moves the output by exactly its decoded change).
- A transcoder reads ``hook_name`` (a hook that only keeps the activation) and writes ``hook_name_out`` (a hook
  that replaces that activation by the transcoder's output, with its skip term, which SAELens drops).
- While spliced, the SAE's own hook points join the model's ``hook_dict`` as ``"{hook_name_out}.hook_sae_*"``,
  so ``run_with_cache`` (the one cacher), ``run_with_hooks`` and ``names_filter`` reach them by those names, as
  SAELens's cache keys.

Every entry point holds the model's call lock (``workbench.call_lock``) while it attaches, runs or detaches: a
``with model.saes(...)`` block holds it until it ends, so another thread's call never runs with this one's SAEs.
After any error, whatever the call attached is removed. ``model.attached_hooks()`` counts each splice's hooks.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.call_lock import model_lock
from workbench.errors import InputError
from workbench.hook_point import caching
from workbench.host import DecoderHost
from workbench.sae.model import SAE

_Host = DecoderHost if TYPE_CHECKING else object


class SAESpliceMethods(_Host):
    """SAELens's ``HookedSAETransformer`` surface for a ``HookedRootModule`` with the workbench's hooks."""

    @property
    def acts_to_saes(self) -> dict[str, SAE]:
        """The SAEs spliced now (by ``add_sae`` or an enclosing ``saes`` block), by the hook each reads.

        Example:
            >>> model.acts_to_saes
            {}
        """
        return {name: splice.sae for name, splice in self._sae_splices.items()}

    def add_sae(self, sae: SAE, use_error_term: Optional[bool] = None) -> None:
        """Splices ``sae`` in until ``reset_saes`` (replacing an SAE already reading the same hook, as SAELens
        does). ``use_error_term``: keep the model's output unchanged (None: the SAE's own ``use_error_term``).
        An SAE whose hook or width does not fit the model is an ``InputError`` naming both; nothing is attached.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 8),
            ...     "W_dec": torch.zeros(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> clean = model(tokens)
            >>> model.add_sae(sae, use_error_term=True); model.attached_hooks()
            {'blocks.0.hook_resid_post': 1}
            >>> torch.allclose(model(tokens), clean, atol=1e-5)   # the error term keeps the output
            True
            >>> model.reset_saes(); model.attached_hooks()
            {}
        """
        with model_lock(self):
            splice = self._checked_splice(sae, use_error_term)
            previous = self._sae_splices.get(splice.input_hook)
            if previous is not None:
                self._detach(previous)
            self._attach(splice)

    def reset_saes(self, act_names: Union[str, Sequence[str], None] = None) -> None:
        """Removes the SAEs reading ``act_names`` (a hook name or a list; None: every SAE) and every hook a
        user added on their hook points.

        Example:
            >>> model.reset_saes(); model.acts_to_saes
            {}
        """
        with model_lock(self):
            names = list(self._sae_splices) if act_names is None else [act_names] if isinstance(act_names, str) \
                else list(act_names)
            unknown = [name for name in names if name not in self._sae_splices]
            if unknown:
                raise InputError(f"no SAE is spliced at {', '.join(map(repr, unknown))} (spliced: "
                                 f"{list(self._sae_splices) or 'none'})")
            for name in names:
                self._detach(self._sae_splices[name])

    @contextmanager
    def saes(self, saes: Union[SAE, Sequence[SAE]] = (), reset_saes_end: bool = True,
             use_error_term: Optional[bool] = None) -> Iterator[Any]:
        """A block with ``saes`` spliced in; on leaving (even after an error) they are removed and any SAE they
        replaced is back. Holds the model's lock for the block, as ``hooks`` does.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=4,
            ...     metadata={"hook_name": "blocks.1.hook_resid_pre"}), {"W_enc": torch.randn(128, 16),
            ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
            >>> with model.saes(saes=[sae]):
            ...     _, sae_cache = model.run_with_cache(tokens, names_filter=lambda n: "hook_sae" in n)
            >>> sorted(sae_cache.keys())[:2], model.attached_hooks()
            (['blocks.1.hook_resid_pre.hook_sae_acts_post', 'blocks.1.hook_resid_pre.hook_sae_acts_pre'], {})
        """
        saes = [saes] if isinstance(saes, SAE) else list(saes)
        with model_lock(self):
            replaced: list[tuple[_Splice, Optional[_Splice]]] = []
            try:
                for sae in saes:
                    splice = self._checked_splice(sae, use_error_term)
                    previous = self._sae_splices.get(splice.input_hook)
                    if previous is not None:
                        self._detach(previous)
                    replaced.append((splice, previous))
                    self._attach(splice)
                yield self
            finally:
                if reset_saes_end:
                    for splice, previous in reversed(replaced):
                        if self._sae_splices.get(splice.input_hook) is splice:
                            self._detach(splice)
                        if previous is not None:
                            self._attach(previous)

    def run_with_saes(self, *model_args: Any, saes: Union[SAE, Sequence[SAE]] = (), reset_saes_end: bool = True,
                      use_error_term: Optional[bool] = None, **model_kwargs: Any) -> Any:
        """The model's forward with ``saes`` spliced in for this call only (SAELens's ``run_with_saes``).

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 8),
            ...     "W_dec": torch.zeros(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> spliced = model.run_with_saes(tokens, saes=[sae])   # layer 0's output replaced by zeros
            >>> torch.allclose(spliced, model(tokens)), model.attached_hooks()
            (False, {})
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(self, *model_args: Any, saes: Union[SAE, Sequence[SAE]] = (),
                                 reset_saes_end: bool = True, use_error_term: Optional[bool] = None,
                                 return_cache_object: bool = True, **kwargs: Any) -> tuple[Any, Any]:
        """``run_with_cache`` with ``saes`` spliced in: the cache also holds each SAE's hooks under
        ``"{hook_name_out}.hook_sae_input"``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post``, ``.hook_sae_recons``,
        ``.hook_sae_output`` (and ``.hook_sae_error`` with the error term). ``names_filter`` and the other
        ``run_with_cache`` arguments pass through; ``return_cache_object=False`` returns a plain dict.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 8),
            ...     "W_dec": torch.randn(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> out, sae_cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True,
            ...     names_filter=["blocks.0.hook_resid_post.hook_sae_acts_post", "blocks.0.hook_resid_pre"])
            >>> sae_cache["blocks.0.hook_resid_post.hook_sae_acts_post"].shape, torch.allclose(out, logits, atol=1e-4)
            (torch.Size([1, 14, 8]), True)
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            out, cache = self.run_with_cache(*model_args, **kwargs)
        return out, (cache if return_cache_object else dict(cache.items()))

    def run_with_hooks_with_saes(self, *model_args: Any, saes: Union[SAE, Sequence[SAE]] = (),
                                 reset_saes_end: bool = True, use_error_term: Optional[bool] = None,
                                 fwd_hooks: Sequence = (), bwd_hooks: Sequence = (), reset_hooks_end: bool = True,
                                 clear_contexts: bool = False, **model_kwargs: Any) -> Any:
        """``run_with_hooks`` with ``saes`` spliced in; hooks may name the SAEs' hook points
        (``"{hook_name_out}.hook_sae_acts_post"``).

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=8,
            ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 8),
            ...     "W_dec": torch.randn(8, 128), "b_enc": torch.zeros(8), "b_dec": torch.zeros(128)})
            >>> def zero_feature_0(acts, hook):
            ...     acts[..., 0] = 0
            ...     return acts
            >>> edited = model.run_with_hooks_with_saes(tokens, saes=[sae], use_error_term=True,
            ...     fwd_hooks=[("blocks.0.hook_resid_post.hook_sae_acts_post", zero_feature_0)])
            >>> edited.shape, model.attached_hooks()
            (torch.Size([1, 14, 2048]), {})
        """
        with self.saes(saes=saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self.run_with_hooks(*model_args, fwd_hooks=list(fwd_hooks), bwd_hooks=list(bwd_hooks),
                                       reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts,
                                       **model_kwargs)

    # ---- helpers --------------------------------------------------------------------------------------------
    @property
    def _sae_splices(self) -> dict[str, "_Splice"]:
        # Kept in the instance's __dict__, not as a submodule: a spliced SAE is not part of the model's weights.
        return self.__dict__.setdefault("_sae_splice_table", {})

    def _checked_splice(self, sae: Any, use_error_term: Optional[bool]) -> "_Splice":
        """A splice of ``sae`` after checking it fits: its hooks exist and carry activations of its widths."""
        if not isinstance(sae, SAE):
            raise InputError(f"saes must be wb.SAE objects (wb.load_sae(path)), got {type(sae).__name__}")
        cfg = sae.cfg
        if cfg.hook_name is None:
            raise InputError(f"{sae!r} has no cfg.metadata.hook_name: set the hook point it reads")
        for role, name in (("reads", cfg.hook_name), ("writes", cfg.hook_name_out)):
            if name not in self.hook_dict:
                try:
                    self.check_hook_names([name])
                except InputError as error:
                    raise InputError(f"{sae!r} {role} hook {name!r}, which this model does not have: {error}") \
                        from None
        head = cfg.metadata.hook_head_index
        if head is not None and (cfg.is_transcoder or cfg.reshape_activations != "none"):
            raise InputError(f"{sae!r}: cfg.metadata.hook_head_index={head} cannot be honoured on a transcoder or "
                             f"with reshape_activations={cfg.reshape_activations!r} (a one-head SAE reads d_head)")
        for other in self._sae_splices.values():  # the one reading the same hook is replaced, not shared
            if other.output_hook == cfg.hook_name_out and other.input_hook != cfg.hook_name:
                raise InputError(f"{sae!r} would share hook {cfg.hook_name_out!r} with {other.sae!r}, spliced "
                                 "already: one SAE per hook point")
        attached_at = sae.__dict__.get("_spliced_into")
        if attached_at is not None and not (attached_at[0] is self and attached_at[1] == cfg.hook_name):
            raise InputError(f"{sae!r} is spliced into another model or hook already: reset it there first")
        self._check_widths(sae)
        use = sae.use_error_term if use_error_term is None else use_error_term
        return _Splice(sae, bool(use), cfg.hook_name, cfg.hook_name_out)

    def _check_widths(self, sae: SAE) -> None:
        """One token through the model (up to the blocks the hooks are in), recording the activations' shapes:
        an SAE whose ``d_in`` (``d_out``) does not match what its hook carries is an ``InputError`` naming both."""
        cfg = sae.cfg
        got_in, got_out = self._hook_shape(cfg.hook_name), self._hook_shape(cfg.hook_name_out)
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

    def _hook_shape(self, name: str) -> Optional[tuple[int, ...]]:
        """The shape hook ``name`` carries for one token (None if it never fires), found by one token through the
        blocks up to it and remembered per hook and runtime options (a splice per call costs no extra forward)."""
        known = self.__dict__.setdefault("_sae_hook_shapes", {})
        key = (name, repr(self.options))  # use_split_qkv_input and use_attn_result change what some hooks carry
        if key not in known:
            layer = self.layer_of(name)
            shapes = _Shapes()
            tokens = torch.zeros((1, 1), dtype=torch.long, device=self.cfg.device)
            with torch.no_grad(), caching(self.hook_dict, name.__eq__, shapes):
                self(tokens, return_type=None, stop_at_layer=None if layer is None else layer + 1)
            known[key] = shapes.get(name)
        return known[key]

    def _attach(self, splice: "_Splice") -> None:
        sae, names = splice.sae, splice.sae.hook_dict
        for name, point in names.items():  # the SAE's hooks join the model's under SAELens's cache keys
            full = f"{splice.output_hook}.{name}"
            point.name = full
            self.hook_dict[full] = point
            self.mod_dict[full] = point
        if splice.input_hook != splice.output_hook:
            splice.hooks.append(self.hook_dict[splice.input_hook].add_hook(splice.keep_input, is_permanent=True))
        splice.hooks.append(self.hook_dict[splice.output_hook].add_hook(splice.replace, is_permanent=True))
        sae.__dict__["_spliced_into"] = (self, splice.input_hook)
        self._sae_splices[splice.input_hook] = splice

    def _detach(self, splice: "_Splice") -> None:
        for handle in splice.hooks:
            handle.hook.remove()
            for point_name in (splice.input_hook, splice.output_hook):
                point = self.hook_dict.get(point_name)
                if point is not None and handle in point.fwd_hooks:
                    point.fwd_hooks.remove(handle)
        splice.hooks.clear()
        splice.captured = None
        for name, point in splice.sae.hook_dict.items():
            point.remove_hooks("both", including_permanent=True)  # nothing a user hooked there stays
            self.hook_dict.pop(point.name, None)
            self.mod_dict.pop(point.name, None)
            point.name = name
        splice.sae.__dict__.pop("_spliced_into", None)
        if self._sae_splices.get(splice.input_hook) is splice:
            del self._sae_splices[splice.input_hook]


class _Shapes(dict):
    """A cache sink that keeps each activation's shape."""

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        super().__setitem__(name, tuple(tensor.shape))


@dataclass(eq=False)
class _Splice:
    """One spliced SAE: where it reads and writes, its error-term choice, the hooks it attached and (for a
    transcoder) the input it keeps between its two hooks within one forward."""

    sae: SAE
    use_error_term: bool
    input_hook: str
    output_hook: str
    hooks: list = field(default_factory=list)
    captured: Optional[Tensor] = None

    def keep_input(self, activation: Tensor, hook: Any) -> None:
        self.captured = activation

    def replace(self, activation: Tensor, hook: Any) -> Tensor:
        source = activation
        if self.input_hook != self.output_hook:
            source, self.captured = self.captured, None
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
        out = self.sae.reconstruct(source.to(device), target)
        return out.to(device=activation.device, dtype=activation.dtype)
