"""Per-layer reads of the model's weights and of the model math experiments need, for the ``Decoder``.

Legend: N flattened tokens, B batch, P position, H n_heads, J d_head_v, D d_model, M d_mlp, E num_experts.

A mixin of ``workbench.model.Decoder``: what experiments read of one layer, so they never reach into
``model.blocks`` or import ``workbench.components``. TransformerLens's stacked reads (``model.W_O``
[L, H, J, D], ``model.b_O``, ``model.W_Q``, ...) live in ``workbench.weights_api``; these are their
one-layer companions, plus the two pieces of mixture-of-experts math no hook point holds:

  ``expert_hidden``         a routed expert's input to its W_out, by the very function the forward runs
                            (``MixtureOfExperts.expert_hidden``: gpt-oss's clamped SwiGLU included)
  ``router_probabilities``  the router's distribution over all experts, as the router scores its logits
                            (``RoutingRule.probabilities``)
  ``layer_W_out``           the output weights [M, D] of a dense MLP, a routed expert or a shared expert
  ``layer_W_O``/``layer_b_O``  one layer's attention output weights [H, J, D] and bias [D] (None where the
                            layer has none: the stacked ``model.b_O`` is zeros there, as in TransformerLens,
                            so it cannot say whether a bias exists)
  ``top_logits_from_resid`` the top-k logits, ids and logsumexp of residual streams read out through the final norm
                            and unembedding, exactly or from a bfloat16 screen (``fast_screen_dtype``)
  ``top_logits_reader``     the same readout for rows that come during a forward pass (``workbench.vocab_readout``)
  ``output_norm_bias`` / ``final_norm_bias``  the constant a LayerNorm adds (None for RMSNorm): the one term
                            of a normed sum that no part owns
  ``apply_output_norm``     the norm on a sublayer's output before it joins the residual stream (ln1_post,
                            ln2_post of sandwich and sublayer_output blocks), whole or with its scale frozen
                            (``output_norm_scale_hook``), so a head's share of the normed output is linear

A wrong request is an ``InputError`` naming it: a layer out of range, an expert of a dense layer, a
shared expert a mixture lacks, an MLP read of an attention-only model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.components.moe import MixtureOfExperts
from workbench.config import ModelConfig
from workbench.errors import InputError
from workbench.host import DecoderHost
from workbench.vocab_readout import READOUT_ROWS_PER_BLOCK, TopLogitsReader  # noqa: F401  (its old home's name)

SUBLAYERS = ("attn", "mlp")  # the sublayers whose outputs join the residual stream


def check_layer(cfg: ModelConfig, layer: int) -> None:
    """``InputError`` unless ``layer`` is one of the model's blocks: the one check behind every per-layer read.

    Example:
        >>> check_layer(model.cfg, 5)
        Traceback (most recent call last):
        workbench.errors.InputError: layer must be in 0..1, got 5
    """
    if not 0 <= layer < cfg.n_layers:
        raise InputError(f"layer must be in 0..{cfg.n_layers - 1}, got {layer}")


def mlp_width(cfg: ModelConfig, layer: int, expert: Optional[int] = None, shared: bool = False) -> int:
    """The number of neurons of layer ``layer``'s dense MLP, its routed ``expert`` or its ``shared`` expert;
    ``InputError`` naming what is wrong when the model has no such MLP.

    Example:
        >>> cfg = wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, d_mlp=6, num_experts=4,
        ...                      experts_per_token=2, moe=wb.MoEConfig(d_shared_expert=12))
        >>> mlp_width(cfg, 0, expert=3), mlp_width(cfg, 0, shared=True)
        (6, 12)
        >>> mlp_width(cfg, 0, expert=4)
        Traceback (most recent call last):
        workbench.errors.InputError: layer 0 has experts 0..3, got 4
    """
    if cfg.attn_only:
        raise InputError("this model is attention-only: it has no MLP, so no neurons (open a model with MLPs)")
    check_layer(cfg, layer)
    moe = layer in cfg.moe_layers
    if (expert is not None or shared) and not moe:
        raise InputError(f"layer {layer} is a dense MLP: it has no experts")
    if shared:
        if not cfg.moe.d_shared_expert:
            raise InputError(f"layer {layer}'s mixture of experts has no shared expert")
        return cfg.moe.d_shared_expert
    if moe and expert is None:
        raise InputError(f"layer {layer} is a mixture of experts: choose an expert (or the shared one)")
    n_experts = cfg.layer_values("num_experts")[layer]
    if expert is not None and not 0 <= expert < n_experts:
        raise InputError(f"layer {layer} has experts 0..{n_experts - 1}, got {expert}")
    return cfg.layer_values("d_mlp")[layer]


def fast_screen_dtype(device: torch.device | str) -> Optional[torch.dtype]:
    """bfloat16 where a bfloat16 matmul is fast on ``device`` (a GPU, or a CPU oneDNN runs bfloat16 on: AVX-512 or
    AMX), else None: there a screen would be slower than the exact float32 product.

    Example:
        >>> fast_screen_dtype("cuda") == torch.bfloat16
        True
    """
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


# Typed against the host it is mixed into (workbench.host.DecoderHost); at run time a plain base.
_Host = DecoderHost if TYPE_CHECKING else object


class ReadoutMethods(_Host):
    """One layer's attention and MLP weights, and a mixture of experts' expert and router math, for a ``Decoder``."""

    # ---- attention -------------------------------------------------------------------------------
    def layer_W_O(self, layer: int) -> Float[Tensor, "n_heads d_head_v d_model"]:
        """Layer ``layer``'s attention output weights [H, J, D] (``model.W_O[layer]`` without stacking every layer).

        Example:
            >>> model.layer_W_O(1).shape   # [n_heads, d_head_v, d_model]
            torch.Size([4, 32, 128])
            >>> torch.equal(model.layer_W_O(1), model.W_O[1])
            True
        """
        check_layer(self.cfg, layer)
        return self.blocks[layer].attn.W_O

    def layer_b_O(self, layer: int) -> Optional[Float[Tensor, "d_model"]]:
        """Layer ``layer``'s attention output bias [D], or None where the layer has none (``model.b_O`` is
        zeros there instead, so only this read says whether the bias exists).

        Example:
            >>> model.layer_b_O(0) is None, bool(model.b_O[0].eq(0).all())   # toy-attn-2l has no attention biases
            (True, True)
        """
        check_layer(self.cfg, layer)
        return self.blocks[layer].attn.stored_bias("b_O")  # attn.b_O reads zeros where absent

    # ---- the output head ----------------------------------------------------------------------------
    def top_logits_from_resid(self, resid_ND: Float[Tensor, "rows d_model"], k: int,
                              screen_dtype: Optional[torch.dtype] = None, workers: int = 1
                              ) -> tuple[Float[Tensor, "rows top"], Int[Tensor, "rows top"], Float[Tensor, "rows"]]:
        """Each row's ``k`` highest logits (float32), their token ids and the row's logsumexp, for residual streams after
        the last block (``logits_from_resid``'s readout, 64 rows at a time: memory is bounded whatever the row count):
        the probability of a top token is ``exp(value - logsumexp)``.

        ``screen_dtype`` None: exact. bfloat16 (``fast_screen_dtype``): the logits are screened in bfloat16 and the
        best ``k + 32`` computed again exactly (``Unembed.screened_top_k``): exact values, the same ids unless the
        screen misses one by more than the gap to the next token, and a logsumexp within the screen's error on the tail.

        ``workers``: blocks read at once, each on its own thread with torch's intra-op thread count (the results do
        not depend on it). For a process that runs torch on fewer threads than it has cores: on the 2-core machine, 2
        workers read SmolLM2's 496-row logit lens in 0.08 s against 0.16 s. ``top_logits_reader`` reads rows as a
        forward pass produces them.

        Example:
            >>> resid = cache["blocks.1.hook_resid_post"][0]
            >>> values, ids, lse = model.top_logits_from_resid(resid, 2)
            >>> torch.allclose((values - lse[:, None]).exp(), logits[0].softmax(-1).topk(2).values, atol=1e-6)
            True
        """
        reader = TopLogitsReader(self, k, screen_dtype, workers)
        reader.add(resid_ND)
        return reader.result()

    def top_logits_reader(self, k: int, screen_dtype: Optional[torch.dtype] = None,
                          workers: int = 1) -> TopLogitsReader:
        """``top_logits_from_resid``'s readout for rows that come a few at a time (a forward hook's snapshot as the pass
        reaches it): ``add`` them, then ``result()``; with ``workers`` >= 2 each full block of rows is read by a helper
        thread while the caller goes on (``workbench.vocab_readout.TopLogitsReader``). The results equal
        ``top_logits_from_resid`` of all the rows at once.

        Example:
            >>> resid = cache["blocks.1.hook_resid_post"][0]
            >>> with model.top_logits_reader(2, workers=2) as reader:
            ...     for row in resid:
            ...         reader.add(row[None])
            ...     values, ids, lse = reader.result()
            >>> torch.equal(values, model.top_logits_from_resid(resid, 2)[0])
            True
        """
        return TopLogitsReader(self, k, screen_dtype, workers)

    # ---- the norms on sublayer outputs (sandwich, sublayer_output) -------------------------------------
    def _output_norm(self, layer: int, sublayer: str) -> Optional[nn.Module]:
        """ln1_post ("attn") or ln2_post ("mlp") of layer ``layer``, None where the block has none (pre-norm)."""
        check_layer(self.cfg, layer)
        if sublayer not in SUBLAYERS or (sublayer == "mlp" and self.cfg.attn_only):
            raise InputError(f"sublayer must be one of {SUBLAYERS if not self.cfg.attn_only else ('attn',)} for this "
                             f"model, got {sublayer!r}")
        if self.cfg.norm_placement == "post":
            raise InputError("a post-norm block norms the residual sum ln(x + f(x)), not its sublayer's output: no "
                             "norm maps a sublayer's output alone into the residual stream")
        return getattr(self.blocks[layer], "ln1_post" if sublayer == "attn" else "ln2_post")

    def output_norm_scale_hook(self, layer: int, sublayer: str) -> Optional[str]:
        """The hook point holding the divisor [B, P, 1] of the norm on ``sublayer``'s output ("attn" or "mlp") at
        ``layer`` (``blocks.{layer}.ln1_post.hook_scale`` / ``ln2_post``), or None where the output joins the residual
        stream unnormed (pre-norm blocks). A post-norm model is an ``InputError`` (see ``apply_output_norm``).

        Example:
            >>> model.output_norm_scale_hook(0, "attn") is None   # toy-attn-2l is pre-norm
            True
            >>> sandwich = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4,
            ...                                      normalization="RMS", norm_placement="sandwich"))
            >>> sandwich.output_norm_scale_hook(0, "mlp")
            'blocks.0.ln2_post.hook_scale'
        """
        return None if self._output_norm(layer, sublayer) is None else \
            f"blocks.{layer}.{'ln1_post' if sublayer == 'attn' else 'ln2_post'}.hook_scale"

    def apply_output_norm(self, layer: int, sublayer: str, out: Float[Tensor, "... d_model"],
                          frozen_scale: Optional[Float[Tensor, "... 1"]] = None) -> Float[Tensor, "... d_model"]:
        """The norm ``sublayer``'s output ("attn" or "mlp") of ``layer`` passes before it joins the residual stream
        (ln1_post / ln2_post of sandwich and sublayer_output blocks, x + ln_post(f(...))); the identity for pre-norm
        blocks, whose outputs join it as they are.

        With ``frozen_scale`` (the divisor on ``output_norm_scale_hook``, read on this input) only the norm's linear
        part, as ``apply_final_norm`` takes it: the gain as the model applies it (Gemma's 1 + w is already in the
        loaded ``w``), no bias, linear in ``out``, so the shares of the parts of a sublayer's output (its heads, its
        bias) add up to its normed output; a LayerNorm's bias is then ``output_norm_bias(layer, sublayer)``.
        No hook fires on that path. A post-norm model (ln(x + f(x))) is an ``InputError``: there the norm
        mixes the output with the residual, and no share of the output alone enters the stream.

        Example:
            >>> sandwich = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4,
            ...                                      normalization="RMS", norm_placement="sandwich"))
            >>> heads_HD = torch.randn(2, 8)
            >>> scale = (heads_HD.sum(0).pow(2).mean() + sandwich.cfg.norm_eps).sqrt().reshape(1)
            >>> shares_HD = sandwich.apply_output_norm(0, "attn", heads_HD, frozen_scale=scale)
            >>> torch.allclose(shares_HD.sum(0), sandwich.apply_output_norm(0, "attn", heads_HD.sum(0)), atol=1e-6)
            True
            >>> torch.equal(model.apply_output_norm(0, "attn", heads_HD[0].repeat(16)), heads_HD[0].repeat(16))
            True
        """
        norm = self._output_norm(layer, sublayer)
        if norm is None:
            return out
        return norm(out) if frozen_scale is None else norm.linear_part(out, frozen_scale)

    def output_norm_bias(self, layer: int, sublayer: str) -> Optional[Float[Tensor, "d_model"]]:
        """The constant a LayerNorm on ``sublayer``'s output adds to the residual stream (its value on zeros: the norm's
        bias), None where there is none (an RMSNorm, or no output norm): with the scale frozen, a normed output is
        the sum of its parts' linear shares plus this.

        Example:
            >>> sandwich = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4,
            ...                                      normalization="LN", norm_placement="sandwich"))
            >>> torch.equal(sandwich.output_norm_bias(0, "attn"), sandwich.blocks[0].ln1_post.b)
            True
            >>> model.output_norm_bias(0, "attn") is None   # toy-attn-2l: pre-norm
            True
        """
        if self._output_norm(layer, sublayer) is None or self.cfg.normalization != "LN":
            return None
        return self.apply_output_norm(layer, sublayer, torch.zeros(self.cfg.d_model, dtype=self.cfg.dtype,
                                                                   device=self.cfg.device))

    def final_norm_bias(self) -> Optional[Float[Tensor, "d_model"]]:
        """The constant the final LayerNorm adds (its value on zeros: its bias), None for an RMSNorm or no final norm.

        Example:
            >>> torch.equal(model.final_norm_bias(), model.ln_final.b)   # toy-attn-2l: LayerNorm
            True
        """
        if self.ln_final is None or self.cfg.normalization != "LN":
            return None
        return self.apply_final_norm(torch.zeros(1, self.cfg.d_model, dtype=self.cfg.dtype, device=self.cfg.device))[0]

    # ---- MLPs and experts --------------------------------------------------------------------------
    def layer_W_out(self, layer: int, expert: Optional[int] = None, shared: bool = False
                    ) -> Float[Tensor, "d_mlp d_model"]:
        """The output weights [M, D] of layer ``layer``'s dense MLP, its routed ``expert`` or its ``shared``
        expert: the direction each neuron writes to the residual stream.

        Example:
            >>> moe = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, d_mlp=12,
            ...                                 num_experts=4, experts_per_token=2,
            ...                                 moe=wb.MoEConfig(d_shared_expert=24)))
            >>> moe.layer_W_out(1, expert=3).shape, moe.layer_W_out(1, shared=True).shape
            (torch.Size([12, 16]), torch.Size([24, 16]))
            >>> moe.layer_W_out(1)
            Traceback (most recent call last):
            workbench.errors.InputError: layer 1 is a mixture of experts: choose an expert (or the shared one)
        """
        mlp_width(self.cfg, layer, expert, shared)
        mlp = self.blocks[layer].mlp
        if shared:
            return mlp.shared.W_out
        return mlp.W_out if expert is None else mlp.W_out[expert]

    def _mixture(self, layer: int, expert: Optional[int] = None) -> MixtureOfExperts:
        """Layer ``layer``'s mixture of experts, past ``mlp_width``'s checks: an InputError for a model without
        MLPs, a layer out of range, a dense layer, or an expert the layer lacks (expert 0 stands for "any")."""
        mlp_width(self.cfg, layer, 0 if expert is None else expert)
        return self.blocks[layer].mlp

    def expert_hidden(self, layer: int, expert: int, mlp_input_ND: Float[Tensor, "tokens d_model"]
                      ) -> Float[Tensor, "tokens d_mlp"]:
        """Routed expert ``expert`` of layer ``layer`` on MLP inputs ``mlp_input_ND`` (what the layer's MLP
        reads: ``ln2.hook_normalized`` after a norm): its hidden activations, its input to W_out.

        No hook point holds them, since each expert runs only on its routed tokens; this computes them for
        any tokens, by the function the forward pass itself runs (``MixtureOfExperts.expert_hidden``).

        Example:
            >>> moe = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, d_mlp=12,
            ...                                 num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu"))
            >>> moe.expert_hidden(0, 3, torch.randn(5, 16)).shape   # [tokens, d_mlp]
            torch.Size([5, 12])
            >>> model.expert_hidden(0, 3, torch.randn(5, 128))     # toy-attn-2l has no MLP
            Traceback (most recent call last):
            workbench.errors.InputError: this model is attention-only: it has no MLP, so no neurons (open a model with MLPs)
        """
        return self._mixture(layer, expert).expert_hidden(expert, mlp_input_ND)

    def router_probabilities(self, layer: int, router_logits_BPE: Float[Tensor, "batch pos num_experts"]
                             ) -> Float[Tensor, "batch pos num_experts"]:
        """Layer ``layer``'s router distribution over all its experts (float32), from its logits
        (``blocks.{layer}.mlp.hook_router_logits``), as the router scores them (``RoutingRule.probabilities``):
        the softmax over all experts, or for a sigmoid router its scores normalised to sum to one.

        Example:
            >>> moe = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, d_mlp=12,
            ...                                 num_experts=4, experts_per_token=2,
            ...                                 moe=wb.MoEConfig(router_scoring="sigmoid")))
            >>> moe.router_probabilities(0, torch.zeros(1, 2, 4)).tolist()
            [[[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]]
        """
        return self._mixture(layer).routing.probabilities(router_logits_BPE)
