"""The model-level weight API of TransformerLens's ``HookedTransformer``, for the ``Decoder``.

Legend: L n_layers, H n_heads, D d_model, K d_head, M d_mlp, V d_vocab.

A mixin of ``workbench.model.Decoder``. ``model.W_Q`` is every layer's ``blocks[l].attn.W_Q``
stacked [L, H, D, K], ``model.W_in`` every ``blocks[l].mlp.W_in`` [L, D, M], and so on, with
TransformerLens's shapes and meaning; ``QK`` and ``OV`` are ``transformer_lens.FactoredMatrix``.
Where a model has no such bias (a Llama has no ``b_Q``), the stacked bias is zeros, as in a
TransformerLens model, so its recipes run unchanged.

Multi-head latent attention (``kv_lora_rank``, DeepSeek-V2/V3) has no per-head linear ``W_K``/``W_V``:
each head's keys and values are ``W_KVB`` applied to the RMS-normed latent, so ``W_Q``, ``W_K``,
``W_V``, their biases, ``QK`` and ``OV`` raise ``InputError`` pointing to ``hook_k``/``hook_v``; ``W_O``
([L, H, d_head_v, D]) and ``b_O`` work. Stacks over layers whose shapes differ (a dense first layer among
expert layers) raise ``InputError`` naming the layers, rather than torch's stacking error.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from workbench.components.moe import MixtureOfExperts
from workbench.errors import InputError
from workbench.processing import process_weights
from workbench.host import DecoderHost

_ATTN_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")
_ATTN_BIASES = {"b_Q": "n_heads d_head", "b_K": "n_heads d_head", "b_V": "n_heads d_head", "b_O": "d_model"}


# Typed against the host it is mixed into (workbench.host.DecoderHost); at run time a plain base.
_Host = DecoderHost if TYPE_CHECKING else object


class WeightMethods(_Host):
    """TransformerLens's stacked weights, factored circuits and bias helpers for a ``Decoder``."""

    # ---- embeddings and unembedding --------------------------------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        """Learned (or sinusoidal) position embeddings; a rotary or ALiBi model has none."""
        if self.pos_embed is None:
            raise InputError(f"this model has no absolute position embedding (positional={self.cfg.positional!r})")
        if hasattr(self.pos_embed, "W_pos"):
            return self.pos_embed.W_pos
        self.pos_embed.grow(self.cfg.n_ctx)  # a sinusoidal table holds the positions used so far: all of them here
        return self.pos_embed.table

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        """The unembedding bias [V]; zeros where the model has none (``unembed.b_U`` too), as in TransformerLens."""
        return self.unembed.b_U

    # ---- stacked attention weights -----------------------------------------------------------------
    def _stack(self, module: str, name: str, zeros_shape: Optional[tuple[int, ...]] = None) -> Tensor:
        """``blocks[l].<module>.<name>`` stacked over layers; zeros for a bias the model lacks."""
        found = []
        for block in self.blocks:
            owner = getattr(block, module, None)
            if owner is None:
                raise InputError(f"this model's blocks have no {module} (attn_only={self.cfg.attn_only}), so no {name}")
            value = getattr(owner, name, None)
            if value is None:
                if zeros_shape is None:
                    raise InputError(f"this model has no {module}.{name}")
                value = torch.zeros(zeros_shape, dtype=self.cfg.dtype, device=self.cfg.device)
            found.append(value)
        shapes = [tuple(value.shape) for value in found]
        if len(set(shapes)) > 1:
            by_shape = {shape: [i for i, s in enumerate(shapes) if s == shape] for shape in dict.fromkeys(shapes)}
            raise InputError(
                f"model.{name}: the layers' {module}.{name} differ in shape ("
                + "; ".join(f"layer(s) {layers}: {list(shape)}" for shape, layers in by_shape.items())
                + f"), so they cannot be stacked (e.g. dense layers among mixture-of-experts ones, "
                f"moe_layers={self.cfg.moe_layers}); read blocks[l].{module}.{name} per layer")
        return torch.stack(found)

    def _no_latent_attention(self, name: str) -> None:
        """Refuses ``name`` (a per-head Q/K/V weight, bias or circuit) on a latent-attention model."""
        if self.cfg.is_latent_attention:
            raise InputError(
                f"model.{name}: this model uses multi-head latent attention (kv_lora_rank={self.cfg.latent.kv_lora_rank}), "
                f"which has no per-head linear W_K/W_V: each head's keys and values are W_KVB applied to the "
                f"RMS-normed latent kv_a_norm(W_KVA x), and its queries' last rotary_dim dimensions meet a RoPE'd "
                f"key shared by every head, so no [n_heads, d_model, d_head] matrices (nor W_Q W_K^T / W_V W_O "
                f"circuits) describe them; read the keys and values from blocks.{{l}}.attn.hook_k / hook_v "
                f"(or the latent from hook_kv_latent) with run_with_cache; W_O [n_layers, n_heads, d_head_v, "
                f"d_model] is available")

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        self._no_latent_attention("W_Q")
        return self._stack("attn", "W_Q")

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        self._no_latent_attention("W_K")
        return self._stack("attn", "W_K")

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        self._no_latent_attention("W_V")
        return self._stack("attn", "W_V")

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head_v d_model"]:
        """Every layer's output projection (d_head_v is d_head except under latent attention).

        Example:
            >>> model.W_O.shape   # [n_layers, n_heads, d_head_v, d_model]   # doctest: +SKIP
        """
        return self._stack("attn", "W_O")

    @property
    def b_Q(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        self._no_latent_attention("b_Q")
        return self._stack("attn", "b_Q", (self.cfg.n_heads, self.cfg.d_head))

    @property
    def b_K(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        self._no_latent_attention("b_K")
        return self._stack("attn", "b_K", (self.cfg.n_heads, self.cfg.d_head))

    @property
    def b_V(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        self._no_latent_attention("b_V")
        return self._stack("attn", "b_V", (self.cfg.n_heads, self.cfg.d_head))

    @property
    def b_O(self) -> Float[Tensor, "n_layers d_model"]:
        return self._stack("attn", "b_O", (self.cfg.d_model,))

    # ---- stacked MLP weights (dense MLPs: [L, D, M]; mixtures of experts: [L, E, D, M]) --------------
    @property
    def W_in(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        return self._stack("mlp", "W_in")

    @property
    def W_gate(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        return self._stack("mlp", "W_gate")

    @property
    def W_out(self) -> Float[Tensor, "n_layers d_mlp d_model"]:
        return self._stack("mlp", "W_out")

    @property
    def b_in(self) -> Float[Tensor, "n_layers d_mlp"]:
        return self._stack("mlp", "b_in", (self.cfg.d_mlp,))

    @property
    def b_out(self) -> Float[Tensor, "n_layers d_model"]:
        return self._stack("mlp", "b_out", (self.cfg.d_model,))

    # ---- TransformerLens-named parameters ------------------------------------------------------------
    def tl_parameters(self) -> dict[str, Tensor]:
        """Every weight under its TransformerLens name and shape (``blocks.0.attn.W_Q`` [n_heads, d_model,
        d_head], ``unembed.W_U`` [d_model, d_vocab] ...), in TransformerBridge's order: what ``named_parameters()``
        holds in `torch.nn.Linear`'s layout under private names. Biases the model lacks are zeros
        (``b_Q``/``b_K``/``b_V``/``b_O``, ``b_in``/``b_out``, ``b_U``), and a GQA model's ``W_K``/``W_V``/``b_K``/
        ``b_V`` are per query head, as TransformerLens gives them. Matrices are views of the weights (writing
        one writes the model) except those per-query-head copies and the zeros.

        Example:
            >>> params = model.tl_parameters()
            >>> params["blocks.0.attn.W_Q"].shape, params["unembed.b_U"].shape
            (torch.Size([4, 128, 32]), torch.Size([2048]))
        """
        params: dict[str, Tensor] = {"embed.W_E": self.embed.W_E}
        if isinstance(getattr(self.pos_embed, "W_pos", None), Tensor):  # learned positions (a table is no weight)
            params["pos_embed.W_pos"] = self.pos_embed.W_pos
        attn_names = ("W_O", "b_O") if self.cfg.is_latent_attention else (*_ATTN_WEIGHTS, *_ATTN_BIASES)
        for layer, block in enumerate(self.blocks):
            prefix = f"blocks.{layer}"
            params.update({f"{prefix}.attn.{name}": getattr(block.attn, name) for name in attn_names})
            if block.has_mlp:
                for name in ("W_in", "W_out", "b_in", "b_out", "W_gate"):
                    value = getattr(block.mlp, name, None)
                    if value is not None:  # a gated MLP's W_gate; a mixture's expert biases when it has them
                        params[f"{prefix}.mlp.{name}"] = value
            for norm_name in ("ln1", "ln2", "ln1_post", "ln2_post"):
                params.update(_norm_parameters(f"{prefix}.{norm_name}", getattr(block, norm_name, None)))
        params.update(_norm_parameters("ln_final", self.ln_final))
        params["unembed.W_U"], params["unembed.b_U"] = self.unembed.W_U, self.unembed.b_U
        return params

    def tl_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """``tl_parameters()`` as (name, tensor) pairs, TransformerBridge's ``tl_named_parameters``.

        Example:
            >>> [(name, tuple(p.shape)) for name, p in model.tl_named_parameters() if name.startswith("blocks.0.attn.W")]
            [('blocks.0.attn.W_Q', (4, 128, 32)), ('blocks.0.attn.W_K', (4, 128, 32)), ('blocks.0.attn.W_V', (4, 128, 32)), ('blocks.0.attn.W_O', (4, 32, 128))]
        """
        return iter(self.tl_parameters().items())

    def tl_state_dict(self) -> dict[str, Tensor]:
        """``tl_parameters()`` detached: a HookedTransformer-style state dict (TransformerLens names and shapes).

        Example:
            >>> model.tl_state_dict()["blocks.1.ln1.w"].requires_grad
            False
        """
        return {name: tensor.detach() for name, tensor in self.tl_parameters().items()}

    # ---- factored circuits -------------------------------------------------------------------------
    @property
    def QK(self) -> FactoredMatrix:
        """Every head's QK circuit W_Q W_K^T [L, H, D, D], as TransformerLens's ``FactoredMatrix``.

        Example:
            >>> model.QK[1, 4].eigenvalues   # doctest: +SKIP
        """
        self._no_latent_attention("QK")
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """Every head's OV circuit W_V W_O [L, H, D, D], as TransformerLens's ``FactoredMatrix``.

        Example:
            >>> (model.W_E @ model.OV[0, 2] @ model.W_U).eigenvalues   # copying score of L0H2   # doctest: +SKIP
        """
        self._no_latent_attention("OV")
        return FactoredMatrix(self.W_V, self.W_O)

    # ---- biases and switches ---------------------------------------------------------------------
    def accumulated_bias(self, layer: int, mlp_input: bool = False,
                         include_mlp_biases: bool = True) -> Float[Tensor, "d_model"]:
        """The sum of the output biases the residual stream holds entering ``layer``
        (attention ``b_O`` and, with ``include_mlp_biases``, MLP ``b_out`` of every earlier layer;
        ``mlp_input`` adds this layer's ``b_O``, for the stream entering its MLP). TransformerLens's.

        Example:
            >>> model.accumulated_bias(model.cfg.n_layers)   # every bias written to the final stream   # doctest: +SKIP
        """
        if not 0 <= layer <= self.cfg.n_layers or (mlp_input and layer == self.cfg.n_layers):
            raise InputError(f"layer must be in 0..{self.cfg.n_layers}{' - 1 with mlp_input' if mlp_input else ''}, "
                             f"got {layer}")
        total = torch.zeros(self.cfg.d_model, dtype=self.cfg.dtype, device=self.cfg.device)
        for index, block in enumerate(self.blocks[:layer]):
            if block.attn.b_O is not None:
                total = total + block.attn.b_O
            if include_mlp_biases and block.has_mlp:
                b_out = _constant_mlp_output_bias(block.mlp, index)
                if b_out is not None:
                    total = total + b_out
        if mlp_input and self.blocks[layer].attn.b_O is not None:
            total = total + self.blocks[layer].attn.b_O
        return total

    def process_weights_(self, fold_ln: bool = True, center_writing_weights: bool = True,
                         center_unembed: bool = True, fold_value_biases: bool = True,
                         refactor_factored_attn_matrices: bool = False):
        """TransformerLens's weight processing, in place (see ``workbench.processing``); returns the model.
        On an RMSNorm model ``center_writing_weights`` warns and is skipped, as in TransformerLens.

        Example:
            >>> model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)   # doctest: +SKIP
        """
        return process_weights(self, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                               center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                               refactor_factored_attn_matrices=refactor_factored_attn_matrices)

    def enable_compatibility_mode(self, disable_warnings: bool = False, no_processing: bool = False,
                                  fold_ln: bool = True, center_writing_weights: bool = True,
                                  center_unembed: bool = True, fold_value_biases: bool = True,
                                  refactor_factored_attn_matrices: bool = False) -> None:
        """TransformerBridge's ``enable_compatibility_mode``, so a TransformerLens 4 notebook's boot lines run
        unchanged: the weight processing ``HookedTransformer.from_pretrained`` applied, with the bridge's
        defaults (every step but ``refactor_factored_attn_matrices``; ``no_processing=True``: none). Our hook
        names and shapes already are TransformerLens's, so there is no other mode to switch to.
        ``disable_warnings`` silences the warning of a skipped step (centring under RMSNorm). A step this
        model cannot take is a ``ConfigError`` and leaves the weights as they were.

        Example:
            >>> twin = wb.Decoder(model.cfg, init_weights=False); _ = twin.load_state_dict(model.state_dict())
            >>> twin.enable_compatibility_mode()
            >>> twin.cfg.weight_processing
            ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
        """
        if no_processing:
            return
        with warnings.catch_warnings():
            if disable_warnings:
                warnings.simplefilter("ignore", UserWarning)
            self.process_weights_(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                  center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                                  refactor_factored_attn_matrices=refactor_factored_attn_matrices)


def _norm_parameters(prefix: str, norm) -> dict[str, Tensor]:
    """A norm's gain ``w`` (and a LayerNorm's bias ``b``) under ``prefix``; nothing for an absent norm."""
    if norm is None:
        return {}
    found = {f"{prefix}.w": norm.w}
    if getattr(norm, "b", None) is not None:
        found[f"{prefix}.b"] = norm.b
    return found


def _constant_mlp_output_bias(mlp, layer: int) -> Optional[Tensor]:
    """The bias an MLP adds to every position alike (``b_out``; a mixture's ungated shared expert's), or None.

    A mixture's expert biases reach the stream weighted by the router, and a gated shared expert's
    scaled per token, so neither is a constant: refused.
    """
    if not isinstance(mlp, MixtureOfExperts):
        return getattr(mlp, "b_out", None)
    if mlp.b_out is not None:
        raise InputError(f"accumulated_bias: layer {layer}'s experts have output biases (expert_bias=True), which "
                         f"reach the residual stream weighted by each token's router weights, not as one constant; "
                         f"pass include_mlp_biases=False")
    shared_b_out = None if mlp.shared is None else mlp.shared.b_out
    if shared_b_out is not None and mlp._W_shared_gate_lin is not None:
        raise InputError(f"accumulated_bias: layer {layer}'s shared expert has an output bias scaled per token by "
                         f"its gate (shared_expert_gate=True), not one constant; pass include_mlp_biases=False")
    return shared_b_out
