"""Temporal (Bhalla, Lubana et al. 2025, arXiv 2511.01836; SAELens's ``TemporalSAE``): each activation is a part
predicted from the earlier positions plus a novel part, and only the novel part is coded sparsely.

Legend: B batch, P position, H n_heads, i d_in, X d_sae.

Codes are ``relu(lam x W_enc)`` with ``lam = 1 / (4 d_in)`` and ``W_enc = W_dec^T`` when ``tied_weights``. Each of
``n_attn_layers`` causal attention layers (SAELens's ``ManualAttention``, parameters ``attn_layers.<n>.k_ctx``,
``q_target``, ``v_ctx``, ``c_proj``: queries from position t's codes, keys and values from the codes of positions
before t, position 0 seeing a zero vector) predicts codes ``z``; their decoding ``z W_dec``, scaled to its
projection on the residual, is taken off the residual and the scaled ``z`` added to the predicted codes. The novel
codes are ``relu(lam residual W_enc)`` (``hook_sae_acts_pre`` carries ``lam residual W_enc``), the
``kval_topk`` largest kept when ``sae_diff_type`` is ``topk``. ``encode`` returns the novel codes, ``decode``
decodes them alone (``b_dec`` added when untied or ``apply_b_dec_to_input``), and a full reconstruction (``forward``,
a splice) decodes novel plus predicted codes, as SAELens's ``forward``; there ``hook_sae_recons`` carries that full
reconstruction. The input is ``constant_scalar_rescale``d by ``activation_normalization_factor`` (the Hub's
temporal SAEs) or normalised as any SAE's.

The encode needs the sequence axis: its input is ``[batch, pos, d_in]``; any other rank is an ``InputError`` (SAELens
fails on it too), so flatten nothing before encoding. Inference only: no training form.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import ConfigError, InputError
from workbench.sae.architectures.base import Encoding, HookFn, rows

# SAELens's TemporalSAE constants: the epsilon of the projection's norm.
EPS = 1e-6
DIFF_TYPES = ("relu", "topk")


class ContextAttention(nn.Module):
    """SAELens's ``ManualAttention`` over codes: causal multi-head attention with ``d_sae // bottleneck_factor``
    query/key channels and full-width values, under SAELens's parameter names.

    Example (zero weights: every position predicts zero):
        >>> layer = ContextAttention(8, n_heads=2, bottleneck_factor=2)
        >>> layer(torch.ones(1, 3, 8), torch.ones(1, 3, 8)).abs().sum().item()
        0.0
    """

    def __init__(self, d_sae: int, n_heads: int, bottleneck_factor: int, device: Any = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.n_heads = n_heads
        width = d_sae // bottleneck_factor
        self.k_ctx = nn.Linear(d_sae, width, device=device, dtype=dtype)
        self.q_target = nn.Linear(d_sae, width, device=device, dtype=dtype)
        self.v_ctx = nn.Linear(d_sae, d_sae, device=device, dtype=dtype)
        self.c_proj = nn.Linear(d_sae, d_sae, device=device, dtype=dtype)
        if torch.device(device or "cpu").type != "meta":
            with torch.no_grad():  # zero, as every wb.SAE before its weights are loaded
                for param in self.parameters():
                    param.zero_()

    def forward(self, context: Float[Tensor, "B P X"], target: Float[Tensor, "B P X"]) -> Float[Tensor, "B P X"]:
        """The codes predicted at each position: its ``target`` codes attending to ``context`` up to itself."""
        batch, pos, d_sae = context.shape

        def heads(tensor: Tensor) -> Float[Tensor, "B H P head_width"]:
            return tensor.view(batch, pos, self.n_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_target(target)), heads(self.k_ctx(context)),
                                             heads(self.v_ctx(context)), attn_mask=None, dropout_p=0, is_causal=True)
        return self.c_proj(out.transpose(1, 2).contiguous().view(batch, pos, d_sae))


class Temporal(Encoding):
    """Context-predicted codes from the attention layers, sparse novel codes of what they leave.

    Example (no attention layer and tied weights: the novel codes are relu(lam x W_dec^T), lam = 1/8 here):
        >>> cfg = wb.SAEConfig("temporal", d_in=2, d_sae=2, n_attn_layers=0, n_heads=1, bottleneck_factor=1,
        ...                    sae_diff_type="relu")
        >>> sae = wb.SAE.from_tensors(cfg, {"W_dec": torch.tensor([[8., 0.], [0., -8.]]), "b_dec": torch.zeros(2)})
        >>> novel, predicted = sae.encode_with_predictions(torch.tensor([[[1., 2.]]]))
        >>> novel.detach(), predicted
        (tensor([[[1., 0.]]]), tensor([[[0., 0.]]]))
        >>> sae.encode(torch.ones(4, 2))
        Traceback (most recent call last):
        workbench.errors.InputError: a temporal SAE encodes sequences: its input is [batch, pos, d_in] (each position's prediction reads the earlier ones), got shape (4, 2)
    """

    activation = "temporal"
    weights = ()
    config_fields = ("n_heads", "n_attn_layers", "bottleneck_factor", "sae_diff_type", "kval_topk", "tied_weights",
                     "activation_normalization_factor")
    normalizations = ("constant_scalar_rescale",)
    reads_sequences = True

    def encode(self, sae: nn.Module, x: Float[Tensor, "B P i"], acts_pre: HookFn) -> Float[Tensor, "B P X"]:
        return self.encode_with_predictions(sae, x, acts_pre)[0]

    def encode_with_predictions(self, sae: nn.Module, x: Float[Tensor, "B P i"], acts_pre: HookFn,
                                ) -> tuple[Float[Tensor, "B P X"], Float[Tensor, "B P X"]]:
        if x.ndim != 3:
            raise InputError("a temporal SAE encodes sequences: its input is [batch, pos, d_in] (each position's "
                             f"prediction reads the earlier ones), got shape {tuple(x.shape)}")
        cfg = sae.cfg
        W_enc = sae.W_dec.T if cfg.tied_weights else sae.W_enc
        lam = 1 / (4 * cfg.d_in)
        residual = x
        predicted = torch.zeros((*x.shape[:2], cfg.d_sae), dtype=x.dtype, device=x.device)
        for layer in sae.attn_layers:
            codes = F.relu((residual * lam) @ W_enc)
            context = torch.cat((torch.zeros_like(codes[:, :1]), codes[:, :-1]), dim=1)  # positions before t
            layer_codes = F.relu(layer(context, codes))
            decoded = layer_codes @ sae.W_dec
            norm = decoded.norm(dim=-1, keepdim=True) + EPS
            scale = (decoded * residual).sum(dim=-1, keepdim=True) / norm.pow(2)  # projection onto the residual
            predicted = predicted + layer_codes * scale
            residual = residual - scale * decoded
        novel = F.relu(acts_pre((residual * lam) @ W_enc))
        if cfg.sae_diff_type == "topk" and cfg.kval_topk is not None:
            kept = torch.topk(novel, cfg.kval_topk, dim=-1).indices
            novel = novel * torch.zeros_like(novel).scatter_(-1, kept, 1)
        return novel, predicted

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
        raise InputError(f"{sae!r}: a temporal SAE's codes need the sequence they predict from; use encode")

    def stores_encoder(self, cfg: Any) -> bool:
        return not cfg.tied_weights

    def adds_b_dec(self, cfg: Any) -> bool:
        return not cfg.tied_weights or cfg.apply_b_dec_to_input

    def submodules(self, cfg: Any, device: Any = None, dtype: Optional[torch.dtype] = None) -> dict[str, nn.Module]:
        return {"attn_layers": nn.ModuleList(
            ContextAttention(cfg.d_sae, cfg.n_heads, cfg.bottleneck_factor, device, dtype)
            for _ in range(cfg.n_attn_layers))}

    def check_config(self, cfg: Any) -> None:
        for name, least in (("n_heads", 1), ("n_attn_layers", 0), ("bottleneck_factor", 1)):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"SAEConfig.{name} must be an integer from {least}, got {value!r}")
        if cfg.d_sae % (cfg.bottleneck_factor * cfg.n_heads):
            raise ConfigError(f"SAEConfig.n_heads and bottleneck_factor must divide d_sae: d_sae={cfg.d_sae} is not "
                              f"a multiple of bottleneck_factor * n_heads = {cfg.bottleneck_factor} * {cfg.n_heads}")
        if cfg.sae_diff_type not in DIFF_TYPES:
            raise ConfigError(f"SAEConfig.sae_diff_type must be one of {DIFF_TYPES}, got {cfg.sae_diff_type!r}")
        k = cfg.kval_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.d_sae):
            raise ConfigError(f"SAEConfig.kval_topk must be an integer from 1 to d_sae={cfg.d_sae} or null, got {k!r}")
        if not isinstance(cfg.tied_weights, bool):
            raise ConfigError(f"SAEConfig.tied_weights must be true or false, got {cfg.tied_weights!r}")
        factor = cfg.activation_normalization_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ConfigError(f"SAEConfig.activation_normalization_factor must be a positive number, got {factor!r}")


SPECS = rows(Temporal(), "temporal")
TRAINING = ()  # inference only: SAELens 6.54 has no temporal training form either
