"""``Decoder``: a hookable decoder-only transformer built from one ``ModelConfig``.

Legend: B batch, P position, D d_model, V d_vocab.

It is a `transformer_lens.HookedRootModule`, so ``run_with_hooks``, ``hooks()``, ``add_hook``
and ``reset_hooks`` are TransformerLens's own; ``run_with_cache`` returns a
`transformer_lens.ActivationCache`. Parameter layout: see the component modules. The token helpers
live in ``workbench.tokens_api`` and the hook helpers in ``workbench.hooking`` (mixins of ``Decoder``).

Besides the forward pass, the model offers the narrow surface experiments build on (so they
never reach into components): ``as_tokens`` (checked token ids on the model's device),
``apply_final_norm`` / ``logits_from_resid`` (the output head on any residual stream),
``loss_fn`` / ``loss_from_resid`` (next-token loss), ``tokens_to_residual_directions``,
``layer_of`` (the block a hook point belongs to), ``set_attn_impl`` and ``cfg.device`` / ``cfg.dtype``.

A model is what it is (``model.config``, a ``ModelConfig``) and how it runs (``model.options``, a
``RuntimeOptions``: dtype, device, kernel, TransformerLens's switches, the weight-processing record);
``model.cfg`` reads both as one, as TransformerLens expects. Every option is set in one place: the
setters below (and ``.to``) assign the one options object all components share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.HookedRootModule import HookedRootModule

from workbench.call_lock import model_lock
from workbench.components import Embed, TransformerBlock, Unembed
from workbench.components.embedding import make_pos_embed
from workbench.components.norm import make_norm
from workbench.config import ModelConfig
from workbench.errors import InputError
from workbench.forward_inputs import check_layer_range, positions_and_key_mask
from workbench.generation import KVCache, generate
from workbench.hook_point import HookPoint, add_aliases
from workbench.loss import next_token_loss, token_losses_from_normed
from workbench.options import AttnImpl, ConfigView, RuntimeOptions
from workbench.readouts import ReadoutMethods
from workbench.hooking import HookMethods
from workbench.sae_splicing import SAESpliceMethods
from workbench.saving import save_native
from workbench.tokenizer import Tokenizer
from workbench.tokens_api import TextOrTokens, TokenMethods, check_attention_mask
from workbench.weights_api import WeightMethods

ReturnType = Optional[Literal["logits", "loss", "both"]]


class Decoder(TokenMethods, HookMethods, SAESpliceMethods, WeightMethods, ReadoutMethods, HookedRootModule):
    """A decoder-only transformer whose every activation sits on a named ``HookPoint``.

    Example:
        >>> import workbench as wb
        >>> cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16)
        >>> model = wb.Decoder(cfg)
        >>> tokens = torch.randint(0, 50, (1, 8))
        >>> logits, cache = model.run_with_cache(tokens)
        >>> logits.shape, cache["blocks.1.attn.hook_pattern"].shape
        (torch.Size([1, 8, 50]), torch.Size([1, 4, 8, 8]))
    """

    def __init__(self, cfg: Union[ModelConfig, ConfigView], tokenizer: Optional[Tokenizer] = None,
                 init_weights: bool = True, **options: Any):
        """``cfg``: the architecture (or another model's ``cfg``, whose options are then the defaults);
        ``options``: ``RuntimeOptions``'s (``attn_impl="eager"``, ``dtype=torch.bfloat16``, ...)."""
        super().__init__()
        if isinstance(cfg, ConfigView):
            cfg, options = cfg.config, {**cfg.options.to_saved(), **options}
        self.config = cfg
        self.options = RuntimeOptions(**options)
        self.options.check_for(cfg)
        self.tokenizer = tokenizer
        self.embed = Embed(cfg, self.options)
        self.hook_embed = HookPoint()  # [B, P, D]
        self.ln_embed = make_norm(cfg, self.options) if cfg.embed_norm else None  # BLOOM's norm on the embeddings
        self.pos_embed = make_pos_embed(cfg, self.options)
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()  # [B, P, D]
        self.blocks = nn.ModuleList(TransformerBlock(cfg.for_layer(layer), self.options)
                                    for layer in range(cfg.n_layers))
        self.ln_final = make_norm(cfg, self.options) if cfg.has_final_norm else None
        self.unembed = Unembed(cfg, self.options)
        if cfg.tie_embeddings:
            self.unembed._W_U_lin = self.embed.W_E  # one Parameter under two names (W_U is its transpose)
        if init_weights:
            self.init_weights()
        self.setup()

    # ---- construction --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 initialisation: N(0, std) matrices, output projections scaled by 1/sqrt(2 n_layers),
        norm gains one, biases zero."""
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":
                param.fill_(1.0)
            elif leaf == "b" or leaf.startswith(("b_", "_b_")):
                param.zero_()
            elif leaf in ("_W_O_lin", "_W_out_lin"):
                param.normal_(0.0, std / (2 * self.cfg.n_layers) ** 0.5)
            else:
                param.normal_(0.0, std)

    # Other names of a hook point, as TransformerBridge has them: alias pattern -> the point's own name.
    # The per-head Q/K/V inputs (use_split_qkv_input) are blocks.{l}.hook_q_input in TransformerLens 3 and
    # blocks.{l}.attn.hook_q_input on a bridge, where transformer_lens.patching's direct path patching looks.
    HOOK_ALIASES = {"blocks.{l}.hook_in": "blocks.{l}.hook_resid_pre", "blocks.{l}.hook_out": "blocks.{l}.hook_resid_post",
                    **{f"blocks.{{l}}.attn.hook_{c}_input": f"blocks.{{l}}.hook_{c}_input" for c in "qkv"}}

    def setup(self) -> None:
        """TransformerLens's ``setup`` (names every hook point, fills ``hook_dict`` and ``mod_dict``), then the
        aliases: ``blocks.{l}.hook_in`` / ``hook_out`` are the points ``hook_resid_pre`` / ``hook_resid_post``
        (TransformerBridge's block hooks, what ``utils.get_act_name("in", l)`` names), and
        ``blocks.{l}.attn.hook_{q,k,v}_input`` are ``blocks.{l}.hook_{q,k,v}_input`` (the bridge's names). An alias is one point
        under two names: hooks on either edit the same tensor; ``run_with_cache`` keys it by the name asked
        for. ``hook_dict`` lists each point once; ``hook_aliases`` maps each alias to its point's name.

        Example:
            >>> model.hook_aliases["blocks.0.hook_in"]
            'blocks.0.hook_resid_pre'
            >>> _, in_cache = model.run_with_cache(tokens, names_filter="blocks.0.hook_in")
            >>> list(in_cache), torch.equal(in_cache["blocks.0.hook_in"], cache["blocks.0.hook_resid_pre"])
            (['blocks.0.hook_in'], True)
        """
        super().setup()
        self.hook_aliases = {alias.format(l=layer): own.format(l=layer) for layer in range(len(self.blocks))
                             for alias, own in self.HOOK_ALIASES.items()}
        add_aliases(self.hook_dict, self.mod_dict, self.hook_aliases)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # One call at a time per model: another thread's hooks or cache never see this call (workbench.call_lock).
        with model_lock(self):
            return super().__call__(*args, **kwargs)

    @property
    def cfg(self) -> ConfigView:
        """TransformerLens's ``model.cfg``: the architecture and the runtime options, read-only.

        Example:
            >>> model.cfg.n_layers == model.config.n_layers, model.cfg.attn_impl == model.options.attn_impl
            (True, True)
        """
        return ConfigView(self.config, self.options)

    def _apply(self, fn: Callable, recurse: bool = True) -> "Decoder":
        # .to()/.half()/.cuda() all come through here: keep options.device/dtype true for TL utilities.
        super()._apply(fn, recurse)
        weight = self.embed.W_E
        self.options.device, self.options.dtype = str(weight.device), weight.dtype
        return self

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self,
        input: Union[TextOrTokens, Float[Tensor, "batch pos d_model"]],
        return_type: ReturnType = "logits",
        *,
        loss_per_token: bool = False,
        prepend_bos: Optional[bool] = None,
        tokens: Optional[Int[Tensor, "batch pos"]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        kv_cache: Optional[KVCache] = None,
        attention_mask: Optional[Int[Tensor, "batch pos"]] = None,
        padding_side: Literal["right", "left"] = "right",
    ) -> Any:
        """Runs the model.

        Args:
            input: text, a list of texts, token ids [batch, pos] (or [pos]), or, with
                ``start_at_layer``, the residual stream [batch, pos, d_model] entering that layer.
            return_type: "logits" [batch, pos, d_vocab], "loss" (mean next-token cross-entropy),
                "both" (logits, loss) or None.
            loss_per_token: return the loss per position [batch, pos - 1] instead of the mean.
            tokens: the token ids, needed for the loss when ``input`` is a residual stream.
            start_at_layer / stop_at_layer: run blocks [start, stop) only; with ``stop_at_layer``
                the residual stream entering that layer is returned. Negative values count from
                the end, as in TransformerLens (``stop_at_layer=-1``: every block but the last).
            kv_cache: a ``workbench.generation.KVCache``, extended in place (for generation).
            attention_mask: [batch, pos], 1 for a real token and 0 for padding (left or right). Pads
                are invisible to every real token, positions count from each row's first real token,
                and the loss skips pads and the positions that predict one. A list of texts builds
                its own, padded on ``padding_side``.

        Example:
            >>> model(tokens).shape   # [batch, pos, d_vocab]
            torch.Size([1, 14, 2048])
            >>> resid = model(tokens, stop_at_layer=1)   # the residual stream entering layer 1
            >>> torch.equal(model(resid, start_at_layer=1), model(tokens))   # the rest of the run
            True
            >>> model(tokens, start_at_layer=1)   # token ids where the residual stream belongs
            Traceback (most recent call last):
            workbench.errors.InputError: start_at_layer takes the residual stream [batch, pos, d_model=...] entering that layer as input, got a torch.int64 tensor of shape (1, 14) ...
        """
        L = self.cfg.n_layers
        check_layer_range(input, start_at_layer, stop_at_layer, L, self.cfg.d_model)
        offset = kv_cache.length if kv_cache is not None else 0
        if start_at_layer is None:
            tokens, mask_BP = self.as_tokens_and_mask(input, prepend_bos, offset, attention_mask, padding_side)
            B, P = tokens.shape
            key_mask_BS, positions = positions_and_key_mask(mask_BP, kv_cache, B, P, tokens.device)
            resid_BPD = self.hook_embed(self.embed(tokens))
            if self.ln_embed is not None:
                resid_BPD = self.ln_embed(resid_BPD)
            if self.pos_embed is not None:
                resid_BPD = resid_BPD + self.hook_pos_embed(self.pos_embed(positions).expand(B, P, -1))
        else:
            resid_BPD = input
            B, P = resid_BPD.shape[:2]
            mask_BP = None if attention_mask is None else check_attention_mask(attention_mask, (B, P), resid_BPD.device)
            key_mask_BS, positions = positions_and_key_mask(mask_BP, kv_cache, B, P, resid_BPD.device)

        layers = range(L)[start_at_layer:stop_at_layer]  # Python's slice: negatives count from the end
        for layer in layers:
            layer_cache = kv_cache.layers[layer] if kv_cache is not None else None
            resid_BPD = self.blocks[layer](resid_BPD, positions, layer_cache, key_mask_BS)
        if stop_at_layer is not None:
            return resid_BPD

        if return_type is None:  # the final norm still runs (its hooks fire); the unembedding has none to skip
            self.apply_final_norm(resid_BPD)
            return None
        logits_BPV = self.logits_from_resid(resid_BPD)
        if return_type == "logits":
            return logits_BPV
        if tokens is None:
            raise InputError("the loss needs token ids: pass tokens= when starting from a residual stream")
        loss = self.loss_fn(logits_BPV, tokens, per_token=loss_per_token, attention_mask=mask_BP)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits_BPV, loss
        raise InputError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")

    # ---- the output head, for experiments ------------------------------------------------------
    def apply_final_norm(
        self, resid_BPD: Float[Tensor, "... d_model"], frozen_scale: Optional[Float[Tensor, "... 1"]] = None
    ) -> Float[Tensor, "... d_model"]:
        """The final norm (identity for post-norm models, whose last block already ends in a norm).

        With ``frozen_scale`` (e.g. ``cache["ln_final.hook_scale"]``), the norm's linear part: its
        divisor fixed at that value and no bias, so it is linear in ``resid`` and the shares of the
        components of a residual stream add up (direct logit attribution). A LayerNorm's bias is
        then ``apply_final_norm(zeros)``. No hook fires on this path.

        Example:
            >>> model.apply_final_norm(cache["blocks.1.hook_resid_post"]).shape   # doctest: +SKIP
            torch.Size([1, 8, 32])
        """
        if self.ln_final is None:
            return resid_BPD
        if frozen_scale is None:
            return self.ln_final(resid_BPD)
        return self.ln_final.linear_part(resid_BPD, frozen_scale)

    def logits_from_resid(self, resid_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        """Final norm and unembedding of a residual stream after the last block (the logit lens' readout).

        Example:
            >>> torch.allclose(model.logits_from_resid(cache["blocks.1.hook_resid_post"]), logits)   # doctest: +SKIP
            True
        """
        return self.unembed(self.apply_final_norm(resid_BPD))

    def loss_fn(self, logits_BPV: Float[Tensor, "batch pos d_vocab"], tokens_BP: Int[Tensor, "batch pos"],
                per_token: bool = False, attention_mask: Optional[Tensor] = None) -> Tensor:
        """Next-token cross-entropy of ``logits`` on ``tokens``: the mean, or [batch, pos - 1] with ``per_token``.
        With ``attention_mask`` the pads and the positions predicting a pad are left out of the mean
        (and are 0 per token).

        TransformerLens's ``loss_fn``. Example:
            >>> model.loss_fn(model(tokens), tokens)   # == model(tokens, return_type="loss")   # doctest: +SKIP
        """
        return next_token_loss(logits_BPV, tokens_BP, per_token=per_token, attention_mask=attention_mask)

    def loss_from_resid(self, resid_BPD: Float[Tensor, "batch pos d_model"],
                        targets_BP: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos"]:
        """Cross-entropy of predicting ``targets[b, p]`` from the final residual stream at [b, p].

        Equal to the loss of ``logits_from_resid(resid)`` within float rounding, but the logits are
        made one cache-sized tile at a time and never held whole (a batched sweep's thousands of
        rows times a 49k vocabulary would not fit in memory).

        Example:
            >>> losses = model.loss_from_resid(resid_final[:, :-1], tokens[:, 1:])   # doctest: +SKIP
        """
        normed_BPD = self.unembed.scaled_input(self.apply_final_norm(resid_BPD))  # logits_scale, as Unembed applies it
        return token_losses_from_normed(normed_BPD, self.unembed.W_U.T, targets_BP, self.unembed.stored_bias("b_U"),
                                        self.unembed.soft_cap)

    def tokens_to_residual_directions(self, tokens: Union[int, Int[Tensor, "..."]]) -> Float[Tensor, "... d_model"]:
        """The unembedding direction(s) of token id(s): ``W_U[:, token]`` in TransformerLens's [d_model, d_vocab] terms
        (times ``logits_scale`` where that is not 1, so a normed residual's dot with it is the token's logit).

        Example:
            >>> model.tokens_to_residual_directions(5).shape   # doctest: +SKIP
            torch.Size([576])
        """
        W_U_VD = self.unembed.W_U.T
        return self.unembed.scaled_input(W_U_VD[torch.as_tensor(tokens, device=W_U_VD.device)])

    # ---- runtime options ----------------------------------------------------------------------------
    def set_attn_impl(self, attn_impl: AttnImpl) -> "Decoder":
        """Switches every layer's attention kernel ("eager", "sdpa" or "flash") of this model, in place.

        Example:
            >>> model.set_attn_impl("flash").cfg.attn_impl
            'flash'
        """
        self.options.attn_impl = attn_impl  # checked; every layer reads this one object
        return self

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Always compute ``attn.hook_result`` (per-head outputs [batch, pos, n_heads, d_model]),
        as TransformerLens's flag. Without it the result is computed only for layers whose
        ``hook_result`` is observed (``run_with_cache(names_filter=...)`` naming it), which is faster.

        Example:
            >>> model.set_use_attn_result(True)
            >>> "blocks.0.attn.hook_result" in model.run_with_cache(tokens)[1]
            True
        """
        self.options.use_attn_result = bool(use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give each attention head its own copy of the residual stream it reads, on the hook points
        ``blocks.{l}.hook_q_input`` [batch, pos, n_heads, d_model] and ``hook_k_input``/``hook_v_input``
        [batch, pos, n_key_value_heads, d_model] (each normed by ln1 on its own), as TransformerLens's
        flag: patching one head's input then leaves the others alone. Slower (one matmul per head);
        pre-norm models only.

        Example:
            >>> model.set_use_split_qkv_input(True)
            >>> model.run_with_cache(tokens)[1]["blocks.0.hook_q_input"].shape[2] == model.cfg.n_heads
            True
        """
        checked = self.options.replace(use_split_qkv_input=bool(use_split_qkv_input))
        checked.check_for(self.config)  # pre-norm only: an error leaves the model as it was
        self.options.use_split_qkv_input = checked.use_split_qkv_input

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Always compute ``blocks.{l}.hook_mlp_in`` [batch, pos, d_model] (the MLP's own copy of its input: an
        edit there reaches the MLP only), as TransformerLens's flag; off, only where hooked. Needs MLPs.

        Example:
            >>> with_mlp = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8))
            >>> with_mlp.set_use_hook_mlp_in(True); with_mlp.cfg.use_hook_mlp_in
            True
        """
        self.cfg.use_hook_mlp_in = bool(use_hook_mlp_in)  # checked: an error leaves the model as it was

    def set_ungroup_grouped_query_attention(self, ungroup: bool) -> None:
        """TransformerLens 3's switch: a grouped-query model's ``hook_k``/``hook_v`` (``hook_rot_k``, the split
        inputs, the KV cache) carry [batch, pos, n_heads, d_head], each query head its group's copy, so per-head
        loops written for n_heads run and an edit to head h's key or value reaches head h only. Unedited, the
        logits are exactly the grouped ones; slower, so off by default.

        Example:
            >>> gqa = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=4, n_key_value_heads=2, d_vocab=10,
            ...                                 n_ctx=8, positional="rotary"))
            >>> ids = torch.tensor([[1, 2, 3]])
            >>> grouped = gqa(ids); gqa.set_ungroup_grouped_query_attention(True)
            >>> gqa.run_with_cache(ids)[1]["blocks.0.attn.hook_v"].shape[2], torch.equal(gqa(ids), grouped)
            (4, True)
        """
        checked = self.options.replace(ungroup_grouped_query_attention=bool(ungroup))
        checked.check_for(self.config)  # not for latent attention: an error leaves the model as it was
        self.options.ungroup_grouped_query_attention = checked.ungroup_grouped_query_attention

    # ---- generation and persistence ---------------------------------------------------------------
    def generate(self, input: TextOrTokens, max_new_tokens: int = 20, **kwargs: Any) -> Union[str, list[str], Tensor]:
        """Continues a prompt (greedy by default; ``temperature``/``top_k``/``top_p`` sample).

        Returns text for text input (prompt plus continuation, without the BOS that tokenizing
        added) and token ids for token input. ``prepend_bos`` as in ``to_tokens``. See
        ``workbench.generation.generate`` for every option.

        Example:
            >>> model.generate("The capital of France is", max_new_tokens=5)   # doctest: +SKIP
        """
        return generate(self, input, max_new_tokens, **kwargs)

    def save(self, directory: Union[str, Path]) -> Path:
        """Writes config.json, model.safetensors and (if any) tokenizer.json to ``directory``.

        Example:
            >>> model.save("runs/my-model"); wb.load_model("runs/my-model")   # doctest: +SKIP
        """
        return save_native(self, directory)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
