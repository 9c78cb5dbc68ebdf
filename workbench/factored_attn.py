"""TransformerLens's ``refactor_factored_attn_matrices``: each head's Q/K and V/O factors rewritten so the
head computes the same function from more readable factors (a step of ``workbench.processing``).

Legend: H n_heads, D d_model, K d_head.

As TransformerLens defines it (``ProcessWeights.refactor_factored_attn_matrices``): only the products
``W_QK = W_Q W_K^T`` and ``W_OV = W_V W_O`` determine a head, so

- QK: the biases join the matrices as a (D+1)-th input row (an input whose last coordinate is 1), and
  ``[W_Q; b_Q] [W_K; b_K]^T = U S V^T`` is refactored evenly, ``W_Q' = U S^1/2``, ``W_K' = V S^1/2``
  (``FactoredMatrix.make_even``): each head's queries and keys get orthogonal columns of equal norms;
- OV: the value bias goes into the output bias (``b_O += sum_h b_V[h] W_O[h]``, ``b_V = 0``: attention rows
  sum to one), and ``W_V W_O = U S V^T`` becomes ``W_V' = U S``, ``W_O' = V^T``: ``W_O`` a rotation, so ``z``
  has the norm of the head's output.

The attention scores and each head's output are unchanged (up to float rounding), so the logits are too.
Refused (``ConfigError``, before anything changes) where the products do not determine the head or cannot be
stored: rotary positions (queries and keys are rotated between the factors: TransformerLens refuses too),
grouped-query attention (one key/value head per group cannot hold a refactor per query head), QK norm,
``clip_qkv``, latent attention, and a value bias under attention sinks. A bias the model does not store
stays absent: its refactored value is zero up to rounding (a zero row of the product).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformer_lens import FactoredMatrix

from workbench.errors import ConfigError
from workbench.host import DecoderHost

__all__ = ["check_refactor", "refactor_factored_attn_matrices"]


def check_refactor(model: DecoderHost) -> None:
    """``ConfigError`` naming why ``model``'s attention cannot be refactored; None when it can.

    Example:
        >>> check_refactor(model)   # toy-attn-2l uses rotary positions
        Traceback (most recent call last):
        workbench.errors.ConfigError: refactor_factored_attn_matrices: this model uses rotary positions: ...
    """
    cfg = model.cfg
    reasons = []
    if cfg.is_latent_attention:
        reasons.append(f"it uses multi-head latent attention (kv_lora_rank={cfg.latent.kv_lora_rank}), which has no "
                       f"per-head W_K/W_V")
    if cfg.positional == "rotary":
        reasons.append("this model uses rotary positions: queries and keys are rotated between W_Q and W_K, so "
                       "W_Q W_K^T depends on both positions and does not determine the head (TransformerLens "
                       "refuses it too)")
    if cfg.n_key_value_heads != cfg.n_heads:
        reasons.append(f"grouped-query attention ({cfg.n_heads} query heads over {cfg.n_key_value_heads} key/value "
                       f"heads) stores one W_K/W_V per group, which cannot hold a different refactor per query head")
    if cfg.qk_norm is not None:
        reasons.append(f"QK norm (qk_norm={cfg.qk_norm!r}) normalises queries and keys between the factors")
    if cfg.clip_qkv is not None:
        reasons.append(f"clip_qkv={cfg.clip_qkv} clamps queries, keys and values between the factors")
    if cfg.attn_sinks and any(getattr(block.attn, "_b_V_lin", None) is not None
                              and bool(block.attn._b_V_lin.detach().any()) for block in model.blocks):
        reasons.append("with attention sinks a query's weights sum to less than one, so the value bias cannot move "
                       "into b_O")
    if reasons:
        raise ConfigError("refactor_factored_attn_matrices: " + "; ".join(reasons) + "; pass "
                          "refactor_factored_attn_matrices=False")


@torch.no_grad()
def refactor_factored_attn_matrices(model: DecoderHost) -> None:
    """Refactors every head's W_Q/W_K (with b_Q/b_K) and W_V/W_O (b_V folded into b_O) in place, in float32
    (``workbench.processing.process_weights`` casts before and after). ``check_refactor`` first.

    Example:
        >>> gpt2_like = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8,
        ...                                       positional="learned", attn_bias=True))
        >>> before = gpt2_like(torch.tensor([[1, 2, 3]]))
        >>> refactor_factored_attn_matrices(gpt2_like)
        >>> torch.allclose(gpt2_like(torch.tensor([[1, 2, 3]])), before, atol=1e-5)
        True
    """
    check_refactor(model)
    for block in model.blocks:
        attn = block.attn
        b_Q_HK, b_K_HK = attn.b_Q.float(), attn.b_K.float()  # zeros where not stored
        W_Q_eff = torch.cat([attn.W_Q.float(), b_Q_HK[:, None, :]], dim=1)  # [H, D+1, K]
        W_K_eff = torch.cat([attn.W_K.float(), b_K_HK[:, None, :]], dim=1)
        W_Q_even, W_K_even_T = FactoredMatrix(W_Q_eff, W_K_eff.transpose(-1, -2)).make_even().pair
        W_K_even = W_K_even_T.transpose(-1, -2)
        _write(attn.W_Q, W_Q_even[:, :-1, :])
        _write(attn.W_K, W_K_even[:, :-1, :])
        _write_bias(attn._b_Q_lin, W_Q_even[:, -1, :])
        _write_bias(attn._b_K_lin, W_K_even[:, -1, :])

        W_O_HKD = attn.W_O.float()
        if attn._b_V_lin is not None:  # b_O exists with it (attn_bias)
            _write(attn.b_O, attn.b_O.float() + torch.einsum("hk,hkd->d", attn.b_V.float(), W_O_HKD))
            attn._b_V_lin.zero_()
        U, S, V = FactoredMatrix(attn.W_V.float(), W_O_HKD).svd()
        _write(attn.W_V, U @ S.diag_embed())
        _write(attn.W_O, V.transpose(-1, -2))


def _write(dst: Tensor, value: Tensor) -> None:
    """``dst`` (a writable view of a weight) takes ``value`` cast to its dtype."""
    dst.copy_(value.to(dst.dtype))


def _write_bias(stored_lin: Optional[Tensor], value_HK: Tensor) -> None:
    """A stored bias [H*K] takes ``value_HK``; an absent one stays absent (its refactor is a zero row)."""
    if stored_lin is not None:
        stored_lin.copy_(value_HK.flatten().to(stored_lin.dtype))
