"""TransformerLens's weight processing for a ``Decoder``: fold_ln, center_writing_weights, center_unembed,
fold_value_biases (what ``HookedTransformer.from_pretrained`` applies by default) and, when asked,
refactor_factored_attn_matrices (``workbench.factored_attn``).

Legend: D d_model, V d_vocab, H n_heads, K d_head, M d_mlp, E num_experts.

Each step rewrites the weights so the model computes the same function (logits equal; with
``center_unembed`` equal up to a constant per position, so log-probabilities are equal) in a form
that is easier to read:

- ``fold_ln``: every pre-norm LayerNorm/RMSNorm's gain ``w`` (and a LayerNorm's bias ``b``) moves
  into the weights that read the norm's output: ``ln1`` into ``W_Q``/``_W_K``/``_W_V`` (+ ``b_Q``,
  ``_b_K``, ``_b_V``), ``ln2`` into the MLP's ``W_in``/``W_gate`` (+ ``b_in``/``b_gate``) or a mixture's
  ``W_router``/``W_in``/``W_gate`` and its shared expert's ``W_in``/``W_gate`` (and ``W_shared_gate``),
  ``ln_final`` into ``W_U`` (+ ``b_U``). Router and expert biases, the correction bias and the clamped
  SwiGLU are untouched by the gain: they act after the linear maps that absorb it. Under a LayerNorm those
  reading weights are also centred over d_model (their input is then mean-zero, so that is exact).
  The norms stay with ``w = 1`` (``b = 0``): their output is TransformerLens's LNPre / RMSPre, so
  ``cache.apply_ln_to_stack`` and direct logit attribution read the model exactly.
- ``center_writing_weights`` (LayerNorm only; an RMSNorm model warns and skips it, as TransformerLens): everything that writes to the residual stream
  (``W_E``, ``W_pos``, ``W_O``, ``b_O``, ``W_out``, ``b_out``, experts' and the shared expert's ``W_out`` and
  ``b_out``) loses its mean over d_model; every reader is a LayerNorm, which subtracts that mean anyway.
- ``center_unembed``: ``W_U`` (and ``b_U``) lose their mean over the vocabulary: each position's logits
  move by one constant, which softmax ignores.
- ``fold_value_biases``: ``b_O += sum_h b_V[h] @ W_O[h]`` and ``b_V = 0`` (attention rows sum to one,
  so the value bias always reaches the output as that constant). Latent attention has no value bias
  (nothing to fold); with attention sinks rows sum to less than one, so a nonzero value bias is refused.

What cannot be done right is refused (``ConfigError``) before anything changes: ``fold_ln`` into
multi-head latent attention (``kv_lora_rank``) is not implemented; a nonzero LayerNorm bias ``ln2.b``
cannot be folded into a mixture of experts; ``fold_value_biases`` under ``attn_sinks``.

The steps run in that order, each recorded in ``cfg.weight_processing``; a step already recorded
is skipped (applying it twice is harmless). Everything that can refuse is checked before any
weight changes, so a refusal leaves the model as it was. bf16/fp16 weights are processed in
float32 and rounded back once at the end, as TransformerLens does.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from workbench.components.moe import MixtureOfExperts
from workbench.factored_attn import check_refactor
from workbench.factored_attn import refactor_factored_attn_matrices as refactor_factored_attn_matrices_
from workbench.options import WEIGHT_PROCESSING_STEPS
from workbench.errors import ConfigError
from workbench.host import DecoderHost

__all__ = ["process_weights"]


def process_weights(model: DecoderHost, fold_ln: bool = True, center_writing_weights: bool = True,
                    center_unembed: bool = True, fold_value_biases: bool = True,
                    refactor_factored_attn_matrices: bool = False) -> DecoderHost:
    """Applies TransformerLens's weight processing to ``model`` in place and returns it.

    Args:
        model: a ``Decoder``.
        fold_ln: fold each pre-norm norm's gain (and LayerNorm bias) into the weights reading it.
            A post-norm model is refused (its norms sit after the residual sums). Biases the fold
            needs and the model lacks are created (``attn_bias``/``mlp_bias``/``unembed_bias`` set);
            a mixture of experts cannot take a nonzero ``ln2`` bias and is refused, as is multi-head
            latent attention (``kv_lora_rank``); tied embeddings are untied (``W_U`` changes, ``W_E`` must not).
        center_writing_weights: centre what writes to the residual stream over d_model (pre-norm
            LayerNorm models; on an RMSNorm model a warning and the step is skipped, as in TransformerLens:
            RMSNorm does not subtract the mean; other norm placements are refused).
        center_unembed: centre ``W_U`` and ``b_U`` over the vocabulary (logits shift per position).
        fold_value_biases: fold ``b_V`` into ``b_O``; ``b_V`` becomes zero. Refused under ``attn_sinks``
            when a value bias is (or, after ``fold_ln``, would be) nonzero.
        refactor_factored_attn_matrices: TransformerLens's refactor of each head's W_Q/W_K and W_V/W_O
            (``workbench.factored_attn``; off by default, as in TransformerLens); refused with rotary
            positions, grouped-query attention and the other cases listed there.

    Raises:
        ConfigError: a requested step cannot be applied to this model (the message says why);
            nothing has been changed then.

    Example:
        >>> import workbench as wb
        >>> model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8))
        >>> tokens = torch.tensor([[1, 2, 3]])
        >>> before = model(tokens).log_softmax(-1)
        >>> model = process_weights(model)
        >>> model.cfg.weight_processing
        ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
        >>> torch.allclose(model(tokens).log_softmax(-1), before, atol=1e-5)
        True
    """
    requested = dict(zip(WEIGHT_PROCESSING_STEPS, (fold_ln, center_writing_weights, center_unembed,
                                                   fold_value_biases, refactor_factored_attn_matrices)))
    skip_centring = requested["center_writing_weights"] and model.cfg.normalization != "LN"
    requested["center_writing_weights"] &= not skip_centring
    todo = [step for step, wanted in requested.items() if wanted and step not in model.cfg.weight_processing]
    _check(model, todo)
    if skip_centring:  # after the checks: a refused call says only why it was refused
        warnings.warn(f"center_writing_weights skipped: this model's norms are {model.cfg.normalization!r}, which "
                      f"do not subtract the mean, so centring the weights that write to the residual stream would "
                      f"change the model (TransformerLens skips it too)", UserWarning, stacklevel=3)
    if not todo:
        return model
    with torch.no_grad():
        # Low-precision weights are processed in float32 and rounded once at the end (as TransformerLens
        # does); bf16/fp16 -> float32 -> bf16/fp16 is exact, so the round trip itself changes nothing.
        original_dtype = {id(param): param.dtype for param in model.parameters()}
        for param in model.parameters():
            param.data = param.data.float()
        try:
            for step in todo:
                _STEPS[step](model)
                model.options.weight_processing += (step,)
        finally:
            for param in model.parameters():  # biases created on the way take the model's dtype
                param.data = param.data.to(original_dtype.get(id(param), model.options.dtype))
    return model


# ---- checks: everything that can refuse, before anything changes ----------------------------------------
def _nonzero_bias(norm: nn.Module) -> bool:
    """Whether ``norm`` is a LayerNorm whose bias is not all zero (an RMSNorm has none)."""
    return getattr(norm, "b", None) is not None and bool(norm.b.detach().any())


def _layers_with_nonzero_bias(model: DecoderHost, norm: str) -> list[int]:
    """The layers whose ``norm`` ("ln1" or "ln2") has a nonzero bias."""
    return [i for i, block in enumerate(model.blocks) if _nonzero_bias(getattr(block, norm))]


def _check(model: DecoderHost, todo: list[str]) -> None:
    cfg = model.cfg
    if "fold_ln" in todo:
        if cfg.norm_placement == "post":
            raise ConfigError(
                "fold_ln: this is a post-norm model (norm_placement='post'): each norm sits after the "
                "residual sum, ln(x + f(x)), so its gain and bias scale the residual stream itself rather "
                "than the input of one linear layer, and there are no reading weights to fold them into")
        if cfg.norm_placement == "sublayer_output":
            raise ConfigError(
                "fold_ln: this model norms each sublayer's output (norm_placement='sublayer_output', OLMo 2), "
                "x + ln(f(x)); no norm sits in front of a linear layer, so there is nothing to fold")
        if cfg.is_latent_attention:
            raise ConfigError(
                f"fold_ln: this model uses multi-head latent attention (kv_lora_rank={cfg.latent.kv_lora_rank}); folding "
                f"ln1 into its query and latent projections (W_QA or W_Q, and W_KVA, whose latent then passes "
                f"through its own RMSNorm kv_a_norm) is not implemented; pass fold_ln=False")
        if cfg.normalization == "LN" and cfg.is_moe:
            layers = _layers_with_nonzero_bias(model, "ln2")
            if layers and not (cfg.moe.router_bias or cfg.moe.expert_bias):
                raise ConfigError(
                    f"fold_ln: a mixture of experts has no router or expert biases, so the LayerNorm bias "
                    f"ln2.b (nonzero in layer(s) {layers}) cannot be folded into W_router / the experts' "
                    f"W_in and W_gate; this model cannot be processed with fold_ln=True")
            if layers:
                raise ConfigError(
                    f"fold_ln: the LayerNorm bias ln2.b (nonzero in layer(s) {layers}) would have to be folded into "
                    f"the mixture of experts' router and expert biases (router_bias={cfg.moe.router_bias}, "
                    f"expert_bias={cfg.moe.expert_bias}) and its shared expert, which is not implemented; this model "
                    f"cannot be processed with fold_ln=True")
        if cfg.normalization == "LN" and "fold_value_biases" in cfg.weight_processing:
            layers = _layers_with_nonzero_bias(model, "ln1")
            if layers:
                raise ConfigError(
                    f"fold_ln after fold_value_biases would put ln1's bias (nonzero in layer(s) {layers}) back "
                    f"into b_V; apply the steps in TransformerLens's order {WEIGHT_PROCESSING_STEPS} "
                    f"(e.g. all in one process_weights_ call on a freshly loaded model)")
    if "refactor_factored_attn_matrices" in todo:
        check_refactor(model)
    if "center_writing_weights" in todo:  # LayerNorm only: RMSNorm models skip it (process_weights)
        if cfg.norm_placement == "post":
            raise ConfigError(
                "center_writing_weights: this is a post-norm model (norm_placement='post'): the first "
                "attention layer reads the embeddings before any norm, so centring W_E would change the "
                "model; pass center_writing_weights=False")
        if cfg.norm_placement != "pre":
            raise ConfigError(
                f"center_writing_weights: with norm_placement={cfg.norm_placement!r} the sublayer outputs pass "
                f"through a norm of their own before the residual stream, so centring W_O / W_out would change "
                f"that norm's input; pass center_writing_weights=False")
    if "fold_value_biases" in todo and cfg.differential_lambda_init is not None and cfg.attn_bias:
        raise ConfigError(
            "fold_value_biases: this model's attention is differential (differential_lambda_init): the values pass "
            "through an RMS norm over each head pair before W_O, so the value bias b_V cannot be folded into b_O; "
            "pass fold_value_biases=False")
    if "fold_value_biases" in todo and cfg.attn_sinks:
        layers = [i for i, block in enumerate(model.blocks)
                  if getattr(block.attn, "_b_V_lin", None) is not None and bool(block.attn._b_V_lin.detach().any())]
        if "fold_ln" in todo and cfg.normalization == "LN":  # fold_ln would move ln1.b into b_V first
            layers = sorted(set(layers) | set(_layers_with_nonzero_bias(model, "ln1")))
        if layers:
            raise ConfigError(
                f"fold_value_biases: this model has attention sinks (attn_sinks=True), so a query's weights over "
                f"the real keys sum to 1 minus its sink weight, not to one: the value bias b_V (nonzero in "
                f"layer(s) {layers}) reaches the output scaled per query and cannot be folded into b_O; pass "
                f"fold_value_biases=False")
    if "center_unembed" in todo and cfg.output_logits_soft_cap is not None:
        raise ConfigError(
            f"center_unembed: this model soft-caps its logits (output_logits_soft_cap="
            f"{cfg.output_logits_soft_cap}), and cap * tanh(logits / cap) changes when a constant is subtracted "
            f"from the logits; pass center_unembed=False (TransformerLens also skips it)")


# ---- helpers ------------------------------------------------------------------------------------------
def _write(dst: Tensor, value: Tensor) -> None:
    """``dst`` (a parameter or a writable view of one) takes ``value`` cast to its dtype."""
    dst.copy_(value.to(dst.dtype))


def _stored_bias(module: nn.Module, name: str) -> Optional[Tensor]:
    """The bias ``name`` the module holds, or None (a dense part's absent bias reads as zeros: not that)."""
    stored = getattr(module, "stored_bias", None)
    return stored(name) if stored is not None else getattr(module, name, None)


def _new_zeros(numel: int, like: Tensor) -> nn.Parameter:
    return nn.Parameter(torch.zeros(numel, dtype=like.dtype, device=like.device), requires_grad=like.requires_grad)


def _untie(model: DecoderHost) -> None:
    """Gives ``unembed`` its own copy of the shared embedding matrix (``tie_embeddings=False``)."""
    if not model.cfg.tie_embeddings:
        return
    W_E = model.embed.W_E
    model.unembed._W_U_lin = nn.Parameter(W_E.detach().clone(), requires_grad=W_E.requires_grad)
    model.config = model.config.replace(tie_embeddings=False)


def _center(param: Tensor, dim: int) -> None:
    """``param -= param.mean(dim)`` (in float32)."""
    value = param.float()
    _write(param, value - value.mean(dim, keepdim=True))


def _fold_norm_into(W_lin: Tensor, b_lin: Optional[Tensor], norm: nn.Module, center: bool) -> None:
    """Folds ``norm``'s gain (and bias) into a linear map stored as ``[..., out, D]`` (+ bias ``[..., out]``).

    ``W (n * w + b) + c = (W * w) n + (W b + c)``; with ``center`` each row is then centred over D
    (exact when ``n`` is mean-zero, i.e. the LayerNorm's normalised input).
    """
    W = W_lin.float()
    if _nonzero_bias(norm):
        if b_lin is None:  # _check and the bias creation in _fold_ln make this unreachable
            raise ConfigError("fold_ln: internal error: a nonzero norm bias has no bias to fold into")
        _write(b_lin, b_lin.float() + W @ norm.b.float())
    W = W * norm.w.float()
    if center:
        W = W - W.mean(-1, keepdim=True)
    _write(W_lin, W)


def _reset_norm(norm: nn.Module) -> None:
    norm.w.fill_(1.0)
    if getattr(norm, "b", None) is not None:
        norm.b.zero_()


# ---- the steps -------------------------------------------------------------------------------------------
def _add_missing_biases(model: DecoderHost) -> None:
    """Creates (zero) the biases a nonzero LayerNorm bias must fold into, and sets the config flags."""
    cfg = model.cfg
    if cfg.normalization != "LN":
        return
    changes = {}
    if not cfg.attn_bias and _layers_with_nonzero_bias(model, "ln1"):
        for block in model.blocks:
            attn, like = block.attn, block.attn._W_Q_lin
            attn._b_Q_lin = _new_zeros(attn._W_Q_lin.shape[0], like)
            attn._b_K_lin = _new_zeros(attn._W_K_lin.shape[0], like)
            attn._b_V_lin = _new_zeros(attn._W_V_lin.shape[0], like)
            attn.b_O = _new_zeros(cfg.d_model, like)
        changes["attn_bias"] = True
    dense = [block for block in model.blocks if block.has_mlp and not isinstance(block.mlp, MixtureOfExperts)]
    if not cfg.mlp_bias and dense and any(_nonzero_bias(block.ln2) for block in dense):
        for block in dense:
            mlp, like = block.mlp, block.mlp._W_in_lin
            mlp.b_in = _new_zeros(cfg.d_mlp, like)
            if cfg.gated_mlp:
                mlp.b_gate = _new_zeros(cfg.d_mlp, like)
            mlp.b_out = _new_zeros(cfg.d_model, like)
        changes["mlp_bias"] = True
    if not cfg.unembed_bias and model.ln_final is not None and _nonzero_bias(model.ln_final):
        model.unembed.b_U = _new_zeros(cfg.d_vocab, model.unembed._W_U_lin)
        changes["unembed_bias"] = True
    if changes:
        model.config = model.config.replace(**changes)


def _fold_ln(model: DecoderHost) -> None:
    _untie(model)  # folding ln_final into W_U must leave W_E alone
    _add_missing_biases(model)
    center = model.cfg.normalization == "LN"
    for block in model.blocks:
        attn = block.attn
        for W_lin, b_lin in ((attn._W_Q_lin, attn._b_Q_lin), (attn._W_K_lin, attn._b_K_lin),
                             (attn._W_V_lin, attn._b_V_lin)):
            _fold_norm_into(W_lin, b_lin, block.ln1, center)
        _reset_norm(block.ln1)
        if not block.has_mlp:
            continue
        mlp = block.mlp
        if isinstance(mlp, MixtureOfExperts):  # per block: a model may mix dense and expert layers
            # [E, D] router, [E, M, D] experts, the shared expert [M', D] and its gate [1, D]; the LayerNorm
            # bias is zero (checked), so no bias changes; router and expert biases add after the maps.
            readers = [(mlp._W_router_lin, None), (mlp._W_in_lin, None)]
            if mlp._W_gate_lin is not None:
                readers.append((mlp._W_gate_lin, None))
            if mlp.shared is not None:
                readers += [(mlp.shared._W_in_lin, None), (mlp.shared._W_gate_lin, None)]
            if mlp._W_shared_gate_lin is not None:
                readers.append((mlp._W_shared_gate_lin, None))
        else:
            readers = [(mlp._W_in_lin, mlp.stored_bias("b_in"))]
            if model.cfg.gated_mlp:
                readers.append((mlp._W_gate_lin, mlp.b_gate))
        for W_lin, b_lin in readers:
            _fold_norm_into(W_lin, b_lin, block.ln2, center)
        _reset_norm(block.ln2)
    if model.ln_final is not None:
        _fold_norm_into(model.unembed._W_U_lin, model.unembed.stored_bias("b_U"), model.ln_final, center)
        _reset_norm(model.ln_final)


def _center_writing_weights(model: DecoderHost) -> None:
    _untie(model)  # centring W_E must not change W_U
    _center(model.embed.W_E, -1)  # [V, D]
    W_pos = getattr(model.pos_embed, "W_pos", None)  # learned positions; a sinusoidal table is no weight
    if isinstance(W_pos, nn.Parameter):
        _center(W_pos, -1)  # [n_ctx, D]
    for block in model.blocks:
        _center(block.attn._W_O_lin, 0)  # [D, H*K]
        if block.attn.stored_bias("b_O") is not None:
            _center(block.attn.b_O, 0)
        if not block.has_mlp:
            continue
        mlp = block.mlp
        _center(mlp._W_out_lin, -2)  # dense [D, M]; experts [E, D, M]
        if _stored_bias(mlp, "b_out") is not None:
            _center(mlp.b_out, -1)  # dense [D]; experts [E, D]
        shared = getattr(mlp, "shared", None)  # a mixture's shared expert writes to the stream too
        if shared is not None:
            _center(shared._W_out_lin, -2)
            if shared.b_out is not None:
                _center(shared.b_out, -1)


def _center_unembed(model: DecoderHost) -> None:
    _untie(model)  # centring W_U must not change W_E
    _center(model.unembed._W_U_lin, 0)  # [V, D]: over the vocabulary
    if model.unembed.stored_bias("b_U") is not None:
        _center(model.unembed.b_U, 0)


def _fold_value_biases(model: DecoderHost) -> None:
    for block in model.blocks:
        attn = block.attn
        if getattr(attn, "_b_V_lin", None) is None:  # no value bias (or latent attention): nothing to fold
            continue
        b_V_HK = attn.b_V.float()  # per query head (a GQA value head repeated over its group)
        folded_D = torch.einsum("hk,hkd->d", b_V_HK, attn.W_O.float())
        _write(attn.b_O, attn.b_O.float() + folded_D)
        attn._b_V_lin.zero_()


_STEPS = {
    "fold_ln": _fold_ln,
    "center_writing_weights": _center_writing_weights,
    "center_unembed": _center_unembed,
    "fold_value_biases": _fold_value_biases,
    "refactor_factored_attn_matrices": refactor_factored_attn_matrices_,
}
assert tuple(_STEPS) == WEIGHT_PROCESSING_STEPS
