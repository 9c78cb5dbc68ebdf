"""The Jacobian lens (Gurnee et al. 2026) of TransformerLens 4.3 on the workbench's models.

Legend: L n_layers, D d_model, V d_vocab, P position.

TransformerLens's ``transformer_lens.tools.analysis.jacobian_lens.JacobianLens`` fits one [D, D] transport matrix per
layer, J_l = E[d h_final / d h_l] (block outputs, ``blocks.{l}.hook_out``), and reads
``W_U norm(J_l h_l)``; it accepts only a ``TransformerBridge`` (``fit`` and ``readout`` refuse anything else, and its
fitting loop keys the captured activations by ``hook.name``, which on our model is the canonical
``blocks.{l}.hook_resid_post`` rather than the alias ``hook_out``). ``JacobianLens`` here is that class with the same
names and signatures: on a Bridge it is the tool unchanged; on a ``wb.load_model`` model ``fit`` runs the tool's own
estimator (``_fit_transport_matrices``, the same one-hot cotangent batching and averaging) on a view of the model whose
hooks carry the Bridge's names, and ``readout`` reads through the model's own final norm and unembedding
(``logits_from_resid``). Both need the raw residual basis: a model whose weight processing recentred the stream
(``center_writing_weights``) is refused. Methods not overridden (``transport``, ``save``, ``load``, ``merge``) are the
tool's.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Dict, Optional, Sequence, Union

import torch
from jaxtyping import Int
from transformer_lens.tools.analysis import jacobian_lens as tool

from workbench.errors import InputError

DEFAULT_SKIP_FIRST_POSITIONS = tool.DEFAULT_SKIP_FIRST_POSITIONS
DEFAULT_TOP_K = tool.DEFAULT_TOP_K
JacobianLensReadout = tool.JacobianLensReadout


def _is_bridge(model: Any) -> bool:
    from transformer_lens.model_bridge import TransformerBridge

    return isinstance(model, TransformerBridge)


class _BridgeHookNames:
    """Our model as the tool's fitting loop sees it: hooks on ``blocks.{l}.hook_out`` report that name."""

    def __init__(self, model: Any):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    @contextmanager
    def hooks(self, fwd_hooks=(), **kwargs: Any):
        renamed = [(name, _reporting_name(hook_fn, name)) for name, hook_fn in fwd_hooks]
        with self._model.hooks(fwd_hooks=renamed, **kwargs):
            yield self


def _reporting_name(hook_fn, name: str):
    view = SimpleNamespace(name=name)
    return lambda activation, hook: hook_fn(activation, view)


def _check_workbench_model(model: Any, operation: str) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "logits_from_resid"):
        raise InputError(f"{operation} needs a TransformerBridge or a wb.load_model model, got {type(model).__name__}")
    if "center_writing_weights" in tuple(getattr(cfg, "weight_processing", ()) or ()):
        raise InputError(f"{operation}: this model's weights were processed with center_writing_weights, which moves "
                         "the residual stream off the raw basis the Jacobian lens is fitted and read in; load it "
                         "without weight processing")
    if getattr(model, "training", False):
        raise InputError(f"{operation} needs the model in evaluation mode (model.eval())")


class JacobianLens(tool.JacobianLens):
    """TransformerLens 4.3's ``JacobianLens`` that also fits and reads a ``wb.load_model`` model.

    Example:
        >>> lens = JacobianLens.fit(model, ["def f(x):\\n    return x + 1\\n" * 3], corpus="demo",
        ...                         skip_first_positions=2, show_progress=False)
        >>> lens.source_layers, tuple(lens.jacobians[0].shape)
        ([0], (128, 128))
        >>> readout = lens.readout(model, "def f(x):", top_k=3)
        >>> sorted(readout.lens_topk_indices), tuple(readout.lens_topk_indices[0].shape)   # layer 1 is the output
        ([0, 1], (6, 3))
    """

    @classmethod
    def fit(cls, model: Any, prompts: Sequence[str], *, corpus: str, source_layers: Optional[Sequence[int]] = None,
            dim_batch: int = 8, max_seq_len: int = 128, skip_first_positions: int = DEFAULT_SKIP_FIRST_POSITIONS,
            show_progress: bool = True, metadata: Optional[Dict[str, Any]] = None) -> "JacobianLens":
        """The tool's ``JacobianLens.fit`` (same arguments, same estimator); a ``wb.load_model`` model is fitted at
        its ``blocks.{l}.hook_resid_post`` (= the Bridge's ``blocks.{l}.hook_out``)."""
        if _is_bridge(model):
            return super().fit(model, prompts, corpus=corpus, source_layers=source_layers, dim_batch=dim_batch,
                               max_seq_len=max_seq_len, skip_first_positions=skip_first_positions,
                               show_progress=show_progress, metadata=metadata)
        _check_workbench_model(model, "JacobianLens.fit")
        if not isinstance(corpus, str) or not corpus.strip():
            raise InputError("corpus must be a non-empty provenance identifier")
        n_layers = model.cfg.n_layers
        target = n_layers - 1
        try:
            sources = list(range(target)) if source_layers is None else sorted(
                {tool._normalize_layer(layer, n_layers) for layer in source_layers})
        except ValueError as error:
            raise InputError(str(error)) from None
        if not sources or sources[-1] >= target:
            raise InputError(f"source layers must be non-empty and below the final layer {target}; got {sources}")
        if dim_batch < 1 or skip_first_positions < 0 or max_seq_len < 2:
            raise InputError("dim_batch >= 1, skip_first_positions >= 0 and max_seq_len >= 2 are needed")
        try:
            jacobians, n_prompts = tool._fit_transport_matrices(
                _BridgeHookNames(model), prompts, source_layers=sources, dim_batch=dim_batch, max_seq_len=max_seq_len,
                skip_first_positions=skip_first_positions, show_progress=show_progress,
                backward_provider=tool._ordinary_vjp)
        except ValueError as error:  # every prompt too short
            raise InputError(str(error)) from None
        provenance = {"model_name": getattr(model.cfg, "model_name", None), "model_system": "workbench",
                      "estimator": tool.ESTIMATOR_JACOBIAN, "hook_convention": "blocks.{layer}.hook_resid_post",
                      "corpus": corpus, "n_prompts": n_prompts, "target_layer": target, "dim_batch": dim_batch,
                      "max_seq_len": max_seq_len, "skip_first_positions": skip_first_positions,
                      "fit_dtype": str(model.cfg.dtype).removeprefix("torch.")}
        return cls(jacobians, n_prompts=n_prompts, d_model=model.cfg.d_model, metadata={**(metadata or {}), **provenance})

    def validate_model(self, model: Any) -> "JacobianLens":
        """The tool's check on a Bridge; on our model: raw basis, eval mode, same model name, width and layers."""
        if _is_bridge(model):
            return super().validate_model(model)
        _check_workbench_model(model, type(self).__name__)
        fitted_for = self.metadata.get("model_name")
        if fitted_for is not None and fitted_for != getattr(model.cfg, "model_name", None):
            raise InputError(f"lens was fitted for model {fitted_for!r}, not {model.cfg.model_name!r}")
        if model.cfg.d_model != self.d_model:
            raise InputError(f"lens was fitted for d_model={self.d_model}; the model has d_model={model.cfg.d_model}")
        final = model.cfg.n_layers - 1
        outside = [layer for layer in self.source_layers if not 0 <= layer < final]
        if outside or int(self.metadata.get("target_layer", final)) != final:
            raise InputError(f"lens layers {self.source_layers} (target {self.metadata.get('target_layer')}) do not fit "
                             f"this {model.cfg.n_layers}-layer model")
        return self

    @torch.no_grad()
    def readout(self, model: Any, input: Union[str, Int[torch.Tensor, "batch seq"]], *,
                layers: Optional[Sequence[int]] = None, positions: Optional[Sequence[int]] = None,
                use_jacobian: bool = True, top_k: int = DEFAULT_TOP_K,
                return_full_logits: bool = False) -> JacobianLensReadout:
        """The tool's ``readout`` (same arguments and result); on our model the transported stream is read through
        ``model.logits_from_resid`` (its final norm, unembedding and any soft cap)."""
        if _is_bridge(model):
            return super().readout(model, input, layers=layers, positions=positions, use_jacobian=use_jacobian,
                                   top_k=top_k, return_full_logits=return_full_logits)
        self.validate_model(model)
        tokens = model.to_tokens(input) if isinstance(input, str) else input
        if tokens.ndim != 2 or tokens.shape[0] != 1:
            raise InputError(f"readout expects a single prompt; got shape {tuple(tokens.shape)}")
        final = model.cfg.n_layers - 1
        try:
            layers = [tool._normalize_layer(layer, model.cfg.n_layers)
                      for layer in (self.source_layers + [final] if layers is None else layers)]
            read_at = tool._normalize_positions(positions, tokens.shape[1])
        except ValueError as error:
            raise InputError(str(error)) from None
        missing = [layer for layer in layers if use_jacobian and layer != final and layer not in self.jacobians]
        if missing:
            raise InputError(f"layers {missing} are not in this lens's source layers {self.source_layers}")
        names = {layer: f"blocks.{layer}.hook_resid_post" for layer in layers if layer != final}
        logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in set(names.values()))
        model_logits = logits[0, read_at].float()
        if not 1 <= top_k <= model_logits.shape[-1]:
            raise InputError(f"top_k must be between 1 and the vocabulary size {model_logits.shape[-1]}, got {top_k}")
        model_top = model_logits.topk(top_k, dim=-1)
        values, indices, full = {}, {}, {}
        for layer in layers:
            if layer == final:
                layer_logits = model_logits
            else:
                residual = cache[names[layer]][0, read_at]
                moved = self.transport(residual, layer) if use_jacobian else residual.float()
                layer_logits = model.logits_from_resid(moved.to(residual.dtype)[None])[0].float()
            top = layer_logits.topk(top_k, dim=-1)
            values[layer], indices[layer] = top.values.cpu(), top.indices.cpu()
            if return_full_logits:
                full[layer] = layer_logits.cpu()
        return JacobianLensReadout(lens_topk_values=values, lens_topk_indices=indices,
                                   model_topk_values=model_top.values.cpu(), model_topk_indices=model_top.indices.cpu(),
                                   tokens=tokens[0].cpu(), positions=read_at, use_jacobian=use_jacobian,
                                   lens_logits=full if return_full_logits else None,
                                   model_logits=model_logits.cpu() if return_full_logits else None)
