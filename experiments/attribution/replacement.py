"""``ReplacementModel``: a model whose MLPs are replaced by transcoders, as attribution graphs see it (circuit-tracer's
"local replacement model"), and the one place in this package that freezes anything.

On a prompt, the replacement model holds every attention pattern (``hook_pattern``) and every norm's divisor
(``hook_scale``) at its value on the prompt (``freeze_hooks``), and writes at each transcoders' output hook the
transcoders' skip term on the live input plus a frozen remainder: what the active features, ``b_dec`` and the error
(the MLP's true output minus the transcoders' reconstruction) wrote on the prompt (``mlp_output``). On the prompt
itself that is the MLP's true output; off it, every path from a source to a target is linear, which is what makes
an attribution graph's edges exact. ``attribute`` (through ``linearised.LinearisedForward``), the attention
explanations and ``intervene`` all freeze through these two methods.

The rest: ``record`` (one run keeping the values to freeze at), ``read_sources`` (every source node and the logits),
``encoder_rows`` and ``decode`` (the transcoders' weights read exactly through their public arithmetic), ``forward``
(the replacement with live features: the transcoders' reconstruction plus given errors; with the true errors it is
the model), and circuit-tracer's ``from_pretrained_and_transcoders`` as ``from_model_and_transcoders``. ``attribute``
and ``intervene`` take a replacement model in place of the model (``attribute(replacement_model, None, prompt)``);
it has no ``attribute`` method of its own, which would make this module and theirs import each other.
``mlp_transcoders`` makes a model's own ReLU MLPs its transcoders (no error: the replacement is the model), for
examples and checks.

Legend: L n_layers, P position, D d_model, X d_sae.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.errors import InputError
from workbench.transcoders import TranscoderSet

_ROW_ELEMENTS = 1 << 24   # how many one-hot entries a weight read builds at once (64 MiB in float32)


@dataclass
class Sources:
    """What ``ReplacementModel.read_sources`` reads. ``F`` the active features, ``R`` their decoder rows (one per
    feature and layer it writes to), ``L`` layers, ``P`` positions."""

    active_features: Int[Tensor, "active 3"]            # (layer, position, feature), lexicographic
    activation_values: Float[Tensor, "active"]
    encoder_vecs: Float[Tensor, "active d_model"]
    decoder_vecs: Float[Tensor, "decoder_row d_model"]        # activation times W_dec row
    decoder_source: Int[Tensor, "decoder_row"]                # which feature each decoder row belongs to
    decoder_layer: Int[Tensor, "decoder_row"]                 # the layer it writes to
    decoder_pos: Int[Tensor, "decoder_row"]
    error_vecs: Float[Tensor, "n_layers pos d_model"]
    token_vecs: Float[Tensor, "pos d_model"]
    logits: Float[Tensor, "d_vocab"]                # at the last position


class ReplacementModel:
    """``model`` with ``transcoders`` (moved to the model's device and dtype) in place of its MLPs.

    Example (a one-layer model whose own MLP is its transcoder):
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
        >>> tc = mlp_transcoders(tiny)
        >>> rm = ReplacementModel.from_model_and_transcoders(tiny, tc)
        >>> tokens = torch.tensor([1, 2, 3])
        >>> torch.allclose(rm.forward(tokens), tiny(tokens[None])[0], atol=1e-5)   # a perfect transcoder: no error
        True
        >>> sorted(name for name, _ in rm.freeze_hooks())
        ['blocks.0.attn.hook_pattern', 'blocks.0.ln1.hook_scale', 'blocks.0.ln2.hook_scale', 'ln_final.hook_scale']
        >>> ReplacementModel(tiny, None)
        Traceback (most recent call last):
        workbench.errors.InputError: ReplacementModel needs a wb.TranscoderSet (wb.load_transcoders), got NoneType
    """

    def __init__(self, model: Any, transcoders: TranscoderSet, caller: str = "ReplacementModel"):
        if not isinstance(transcoders, TranscoderSet):
            raise InputError(f"{caller} needs a wb.TranscoderSet (wb.load_transcoders), got {type(transcoders).__name__}")
        transcoders.check_model(model)
        self.model = model
        self.device, self.dtype = model.W_E.device, model.W_E.dtype
        self.transcoders = transcoders.to(device=self.device, dtype=self.dtype)
        self.scan = getattr(transcoders, "scan", None)   # which transcoders, for the graph's viewer files
        self.n_layers = self.transcoders.n_layers
        self.frozen_names = [name for name in model.hook_dict
                             if name.endswith("attn.hook_pattern") or name.endswith("hook_scale")]

    @classmethod
    def from_model_and_transcoders(cls, model: Any, transcoders: TranscoderSet) -> "ReplacementModel":
        """circuit-tracer's ``from_pretrained_and_transcoders`` for a model already loaded (``wb.load_model``).

        Example:
            >>> ReplacementModel.from_model_and_transcoders(model, [])
            Traceback (most recent call last):
            workbench.errors.InputError: ReplacementModel needs a wb.TranscoderSet (wb.load_transcoders), got list
        """
        return cls(model, transcoders)

    @classmethod
    def of(cls, model: Any, transcoders: Optional[TranscoderSet], caller: str = "ReplacementModel",
           ) -> "ReplacementModel":
        """``model`` itself if it is a replacement model already (``transcoders`` then None or its own), else
        ``model`` with ``transcoders``.

        Example:
            >>> ReplacementModel.of(model, None, caller="attribute")
            Traceback (most recent call last):
            workbench.errors.InputError: attribute needs a wb.TranscoderSet (wb.load_transcoders), got NoneType
        """
        if not isinstance(model, cls):
            return cls(model, transcoders, caller)
        if transcoders is not None and transcoders is not model.transcoders:
            raise InputError(f"{caller}: a ReplacementModel brings its own transcoders; pass None, not another set")
        return model

    # ---- the freezing --------------------------------------------------------------------------------------
    def record(self, tokens: Int[Tensor, "pos"], names: Sequence[str] = ()) -> dict[str, Tensor]:
        """One run on ``tokens`` (no gradients) keeping every pattern and divisor, the transcoders' input and output
        at each layer, and ``names``: the values ``freeze_hooks`` and ``mlp_output`` hold things at.

        Example:
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
            >>> tc = mlp_transcoders(tiny)
            >>> clean = ReplacementModel(tiny, tc).record(torch.tensor([1, 2, 3]))
            >>> clean["blocks.0.attn.hook_pattern"].shape, clean["blocks.0.hook_mlp_out"].shape
            (torch.Size([1, 2, 3, 3]), torch.Size([1, 3, 8]))
        """
        tc = self.transcoders
        wanted = set(self.frozen_names) | set(names) | {tc.input_hook(l) for l in range(self.n_layers)} | \
            {tc.output_hook(l) for l in range(self.n_layers)}
        with torch.no_grad():
            _, cache = self.model.run_with_cache(tokens[None], names_filter=lambda name: name in wanted)
        return {name: cache[name] for name in wanted if name in cache}

    def freeze_hooks(self, clean: Optional[dict[str, Tensor]] = None, scales: bool = True) -> list:
        """Forward hooks freezing every attention pattern and (``scales``) every norm's divisor: at the values of
        ``clean`` (from ``record``), or, without it, at their live values with the gradient through them cut (a
        linearised pass on the prompt itself).

        Example:
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
            >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(4, 8)] * 2, b_enc=[torch.zeros(4)] * 2, threshold=[None] * 2,
            ...     W_dec=[torch.zeros(4, 1, 8)] * 2, b_dec=torch.zeros(2, 8), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> [name for name, _ in ReplacementModel(tiny, tc).freeze_hooks(scales=False)]
            ['blocks.0.attn.hook_pattern', 'blocks.1.attn.hook_pattern']
        """
        def detach(acts: Tensor, hook: Any) -> Tensor:
            return acts.detach()

        def held(acts: Tensor, hook: Any) -> Tensor:
            return clean[hook.name].expand_as(acts)

        return [(name, detach if clean is None else held) for name in self.frozen_names
                if scales or name.endswith("attn.hook_pattern")]

    def mlp_output(self, layer: int, x: Float[Tensor, "... d_model"], frozen_output: Tensor,
                   frozen_input: Optional[Tensor] = None) -> Tensor:
        """What the replacement writes at ``output_hook(layer)`` given the live input ``x``: ``frozen_output`` (the
        MLP's output on the prompt), but for the skip term, which follows ``x`` (from its value at ``frozen_input``,
        by default ``x`` itself). Gradients flow through the skip term only.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), W_skip=[2 * torch.eye(2)],
            ...     feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out")
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=2, n_heads=1, d_vocab=4, n_ctx=4, act_fn="relu"))
            >>> ReplacementModel(tiny, tc).mlp_output(0, torch.ones(2), torch.zeros(2), frozen_input=torch.zeros(2))
            tensor([2., 2.])
        """
        tc = self.transcoders
        skip = tc.skip(layer, x)
        if skip is None:
            return frozen_output.detach()
        skip = skip.to(frozen_output.dtype)
        frozen_skip = skip if frozen_input is None else tc.skip(layer, frozen_input).to(skip.dtype)
        return skip + (frozen_output - frozen_skip).detach()

    # ---- the sources ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def read_sources(self, tokens: Int[Tensor, "pos"]) -> Sources:
        """Every source node of the graph on ``tokens``: the active features (position 0's zeroed, as circuit-tracer
        does) with their encoder rows and activation-scaled decoder rows, one error vector per layer and position
        (the MLP's true output minus the reconstruction; zero at position 0), the token embeddings, and the logits.

        Example:
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
            >>> tc = mlp_transcoders(tiny)
            >>> sources = ReplacementModel(tiny, tc).read_sources(torch.tensor([1, 2, 3]))
            >>> sources.error_vecs.abs().max() < 1e-4, sources.active_features[:, 1].min().item()
            (tensor(True), 1)
        """
        tc, n_layers = self.transcoders, self.n_layers
        names = {"hook_embed"} | {tc.input_hook(l) for l in range(n_layers)} | {tc.output_hook(l) for l in range(n_layers)}
        logits, cache = self.model.run_with_cache(tokens[None], names_filter=lambda name: name in names)
        inputs_LPD = torch.stack([cache[tc.input_hook(l)][0] for l in range(n_layers)]).to(self.dtype)
        outputs_LPD = torch.stack([cache[tc.output_hook(l)][0] for l in range(n_layers)]).to(self.dtype)
        acts = []
        for layer in range(n_layers):
            layer_acts = tc.encode(layer, inputs_LPD[layer])
            layer_acts[0] = 0  # circuit-tracer zeroes the first position's features (and its errors below)
            acts.append(layer_acts)
        acts_LPX = torch.stack(acts)
        active = acts_LPX.nonzero()
        values = acts_LPX[active[:, 0], active[:, 1], active[:, 2]]
        encoder = torch.cat([self.encoder_rows(l, active[active[:, 0] == l, 2]) for l in range(n_layers)])
        dec_vecs, dec_source, dec_layer, dec_pos = [], [], [], []
        for layer in range(n_layers):  # each feature's rows, one per layer it writes to, scaled by its activation
            in_layer = (active[:, 0] == layer).nonzero().flatten()
            out_layers = tc.output_layers(layer)
            scaled = torch.zeros(len(in_layer), tc.d_transcoder, dtype=self.dtype, device=self.device)
            scaled[torch.arange(len(in_layer)), active[in_layer, 2]] = values[in_layer]
            rows = self.decode(layer, scaled)[out_layers.start:out_layers.stop].transpose(0, 1)   # [k, n_out, D]
            dec_vecs.append(rows.reshape(-1, rows.shape[-1]))
            dec_source.append(in_layer.repeat_interleave(len(out_layers)))
            dec_layer.append(torch.arange(out_layers.start, out_layers.stop, device=active.device).repeat(len(in_layer)))
            dec_pos.append(active[in_layer, 1].repeat_interleave(len(out_layers)))
        errors = outputs_LPD - tc.reconstruct(acts, inputs_LPD)
        errors[:, 0] = 0
        return Sources(active_features=active, activation_values=values, encoder_vecs=encoder,
                       decoder_vecs=torch.cat(dec_vecs), decoder_source=torch.cat(dec_source),
                       decoder_layer=torch.cat(dec_layer), decoder_pos=torch.cat(dec_pos), error_vecs=errors,
                       token_vecs=cache["hook_embed"][0].to(errors.dtype), logits=logits[0, -1].float())

    # ---- the weights, read through the transcoders' arithmetic ---------------------------------------------------
    def encoder_rows(self, layer: int, features: Int[Tensor, "feature"]) -> Float[Tensor, "feature d_model"]:
        """The encoder rows of ``features`` of ``layer`` (each feature's pre-activation gradient, exact: the
        pre-activation is affine), a block of rows at a time.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.tensor([[1.0, 2.0], [3.0, 4.0]])], b_enc=[torch.ones(2)],
            ...     threshold=[None], W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2),
            ...     feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out")
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=2, n_heads=1, d_vocab=4, n_ctx=4, act_fn="relu"))
            >>> ReplacementModel(tiny, tc).encoder_rows(0, torch.tensor([1, 0]))
            tensor([[3., 4.],
                    [1., 2.]])
        """
        tc = self.transcoders
        step = max(1, _ROW_ELEMENTS // tc.d_transcoder)
        blocks = [torch.zeros(0, tc.d_model, dtype=self.dtype, device=self.device)]
        for start in range(0, len(features), step):
            chosen = features[start:start + step]
            one_hot = torch.zeros(len(chosen), tc.d_transcoder, dtype=self.dtype, device=self.device)
            one_hot[torch.arange(len(chosen)), chosen] = 1
            x = torch.zeros(len(chosen), tc.d_model, dtype=self.dtype, device=self.device)
            _, pull = torch.func.vjp(lambda x: tc.pre_activations(layer, x), x)
            blocks.append(pull(one_hot)[0])
        return torch.cat(blocks)

    def decode(self, layer: int, acts: Float[Tensor, "row d_transcoder"]) -> Float[Tensor, "n_layers row d_model"]:
        """What activations ``acts`` of ``layer``'s features write to every layer (zero outside
        ``output_layers(layer)``), without ``b_dec`` or skip terms (the reconstruction's derivative along ``acts``,
        exact: it is linear in them), a block of rows at a time.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])], b_dec=torch.ones(1, 2),
            ...     feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out")
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=2, n_heads=1, d_vocab=4, n_ctx=4, act_fn="relu"))
            >>> ReplacementModel(tiny, tc).decode(0, torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
            tensor([[[2., 4.],
                     [3., 4.]]])
        """
        tc, n_layers = self.transcoders, self.n_layers
        step = max(1, _ROW_ELEMENTS // (tc.d_transcoder + n_layers * tc.d_model))
        blocks = [torch.zeros(n_layers, 0, tc.d_model, dtype=self.dtype, device=self.device)]
        for start in range(0, acts.shape[0], step):
            chosen = acts[start:start + step].to(self.dtype)
            others = torch.zeros_like(chosen)
            inputs = torch.zeros(n_layers, len(chosen), tc.d_model, dtype=self.dtype, device=self.device)

            def reconstruct(layer_acts: Tensor) -> Tensor:
                return tc.reconstruct([layer_acts if l == layer else others for l in range(n_layers)], inputs)

            blocks.append(torch.func.jvp(reconstruct, (others,), (chosen,))[1])
        return torch.cat(blocks, dim=1)

    # ---- the replacement run -------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: Int[Tensor, "pos"], errors: Optional[Float[Tensor, "n_layers pos d_model"]] = None,
                ) -> Float[Tensor, "pos d_vocab"]:
        """The logits with every MLP replaced by the transcoders' reconstruction from the live features plus
        ``errors`` (default zero: the transcoders alone). With the true errors (the MLP's output minus the
        reconstruction, layer by layer) it is the model itself. Nothing is frozen here.

        Example:
            >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
            >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(4, 8)] * 2, b_enc=[torch.zeros(4)] * 2, threshold=[None] * 2,
            ...     W_dec=[torch.zeros(4, 1, 8)] * 2, b_dec=torch.zeros(2, 8), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> ReplacementModel(tiny, tc).forward(torch.tensor([1, 2, 3]), errors=torch.zeros(1, 3, 8))
            Traceback (most recent call last):
            workbench.errors.InputError: errors must have shape (2, 3, 8), got (1, 3, 8)
        """
        tc, n_layers, n_pos = self.transcoders, self.n_layers, tokens.shape[0]
        shape = (n_layers, n_pos, tc.d_model)
        if errors is not None and tuple(errors.shape) != shape:
            raise InputError(f"errors must have shape {shape}, got {tuple(errors.shape)}")
        inputs = torch.zeros(shape, dtype=self.dtype, device=self.device)
        acts = [torch.zeros(n_pos, tc.d_transcoder, dtype=self.dtype, device=self.device) for _ in range(n_layers)]

        def read(layer: int):
            def hook(x: Tensor, hook: Any) -> None:
                inputs[layer] = x[0]
                acts[layer] = tc.encode(layer, x[0])
            return hook

        def write(layer: int):   # layers after this one have zero inputs and activations: they add nothing here
            def hook(out: Tensor, hook: Any) -> Tensor:
                replaced = tc.reconstruct(acts, inputs)[layer]
                if errors is not None:
                    replaced = replaced + errors[layer].to(replaced.dtype)
                return replaced[None].to(out.dtype)
            return hook

        hooks = [(tc.input_hook(l), read(l)) for l in range(n_layers)] + \
            [(tc.output_hook(l), write(l)) for l in range(n_layers)]
        return self.model.run_with_hooks(tokens[None], fwd_hooks=hooks)[0]

    __call__ = forward


def mlp_transcoders(model: Any) -> TranscoderSet:
    """The model's own MLPs as a transcoder set, one feature per neuron (``W_in``, ``b_in``, ``W_out``, ``b_out``
    copied, reading ``mlp.hook_in`` and writing ``mlp.hook_out``): exact for ReLU MLPs without a gate or experts, so
    its replacement model has no error; for examples and checks.

    Example:
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
        >>> tc = mlp_transcoders(tiny)
        >>> tc.n_layers, tc.W_enc[1].shape
        (2, torch.Size([32, 8]))
        >>> ReplacementModel(tiny, tc).read_sources(torch.tensor([1, 2, 3])).error_vecs.abs().max() < 1e-4
        tensor(True)
        >>> mlp_transcoders(model)
        Traceback (most recent call last):
        workbench.errors.InputError: mlp_transcoders needs ReLU MLPs without a gate or experts (act_fn 'relu'); this model has attn_only=True, act_fn='gelu', gated_mlp=False, num_experts=0
    """
    cfg = model.cfg
    if cfg.attn_only or cfg.gated_mlp or cfg.num_experts or cfg.act_fn != "relu":
        raise InputError(f"mlp_transcoders needs ReLU MLPs without a gate or experts (act_fn 'relu'); this model has "
                         f"attn_only={cfg.attn_only}, act_fn={cfg.act_fn!r}, gated_mlp={cfg.gated_mlp}, "
                         f"num_experts={cfg.num_experts}")
    layers = range(cfg.n_layers)
    return TranscoderSet(W_enc=[model.W_in[l].T.detach().clone() for l in layers],
                         b_enc=[model.b_in[l].detach().clone() for l in layers], threshold=[None] * cfg.n_layers,
                         W_dec=[model.W_out[l][:, None].detach().clone() for l in layers],
                         b_dec=model.b_out.detach().clone(), feature_input_hook="mlp.hook_in",
                         feature_output_hook="mlp.hook_out")
