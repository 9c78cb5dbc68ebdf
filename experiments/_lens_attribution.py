"""Direct logit attribution (re-exported by ``experiments.lens``, whose docstring describes it), and the one reader of
a prompt's activations both it and the logit lens use: from a run's cache the caller hands in, or from a run.

Legend: B batch, L n_layers, P position, H n_heads, K d_head, D d_model, V d_vocab.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import torch
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from experiments.metrics import PositionSelector, TokenIds, per_prompt_table, prompt_batch, token_ids
from workbench.errors import InputError


def attribution_hook_names(model) -> list[str]:
    """The hooks ``direct_logit_attribution`` reads: the embeddings, each layer's ``hook_z`` and MLP output, the
    output norms' divisors (sandwich / sublayer_output blocks) and the final stream.

    Example:
        >>> attribution_hook_names(model)   # toy-attn-2l: attention only, pre-norm, rotary
        ['blocks.0.attn.hook_z', 'blocks.1.attn.hook_z', 'blocks.1.hook_resid_post', 'hook_embed']
    """
    L = model.cfg.n_layers
    names = {"hook_embed", f"blocks.{L - 1}.hook_resid_post"} | ({"hook_pos_embed"} & set(model.hook_dict))
    names |= {f"blocks.{l}.attn.hook_z" for l in range(L)}
    names |= set() if model.cfg.attn_only else {f"blocks.{l}.hook_mlp_out" for l in range(L)}
    names |= {name for l in range(L) if (name := model.output_norm_scale_hook(l, "attn")) is not None}
    return sorted(names)


def activations_of_run(model, tokens_BP: Tensor, mask_BP: Optional[Tensor], names: list[str], cache) -> dict[str, Tensor]:
    """``names`` of a run on ``tokens_BP``: read from ``cache`` (an ``ActivationCache`` or dict of that very run, as
    TransformerLens's analyses take one), or from a run that stops after the blocks.

    Example:
        >>> {name: tuple(t.shape) for name, t in activations_of_run(model, tokens, None, ["hook_embed"], None).items()}
        {'hook_embed': (1, 14, 128)}
        >>> activations_of_run(model, tokens, None, ["blocks.0.attn.hook_z"], {"hook_embed": cache["hook_embed"]})
        Traceback (most recent call last):
        workbench.errors.InputError: the cache lacks ['blocks.0.attn.hook_z']; run model.run_with_cache(tokens) on these tokens (or cache at least those hooks)
    """
    if cache is None:
        _, cache = model.run_with_cache(tokens_BP, attention_mask=mask_BP, stop_at_layer=model.cfg.n_layers,
                                        names_filter=lambda n: n in names)
        return {name: cache[name] for name in names}
    missing = [name for name in names if name not in cache]
    if missing:
        raise InputError(f"the cache lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}; run "
                         "model.run_with_cache(tokens) on these tokens (or cache at least those hooks)")
    wrong = [name for name in names if tuple(cache[name].shape[:2]) != tuple(tokens_BP.shape)]
    if wrong:
        raise InputError(f"the cache's {wrong[0]} is {tuple(cache[wrong[0]].shape[:2])} [batch, pos], but these tokens "
                         f"are {tuple(tokens_BP.shape)}: pass the cache of a run on these very tokens")
    return {name: cache[name] for name in names}


def _attention_share(model, layer: int, scale_B1: Optional[Tensor], share):
    """``share`` of vectors [B, n, D] summing to layer ``layer``'s attention output before its output norm: through
    that norm's linear part (its scale frozen at ``scale_B1``, each row's own) first, where the block has one."""
    if scale_B1 is None:
        return share
    frozen = scale_B1.float()[:, None]  # [B, 1, 1]
    return lambda vectors_BnD: share(model.apply_output_norm(layer, "attn", vectors_BnD, frozen_scale=frozen))


@torch.no_grad()
def direct_logit_attribution(model, tokens: TextOrTokens, target_token: TokenIds, baseline_token: Optional[TokenIds] = None,
                             position: PositionSelector = "last", *, per_prompt: bool = False,
                             attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                             cache=None) -> pd.DataFrame:
    """Each component's direct contribution to logit[target] (minus logit[baseline]) at ``position``.

    Returns DataFrame[component, layer, head, attribution] with component in {"embed",
    "pos_embed", "head", "attn_bias", "attn_norm_bias", "mlp", "ln_final_bias", "unembed_bias"}
    (layer/head -1 where they do not apply); the rows sum to the logit (difference), stored in
    ``df.attrs["logit_diff"]``, with processed weights or without (``df.attrs["weights"]`` says which).
    Pre-norm, sandwich and sublayer_output models (a head's share is read through its layer's output
    norm with the scale frozen, see the module docstring; "attn_norm_bias" is a LayerNorm output
    norm's bias); post-norm models, soft-capped logits and normed embeddings are an ``InputError``.

    Over a batch: ``target_token`` / ``baseline_token`` are one id or text, or one per prompt;
    ``position`` is "last" (each prompt's last real token, the default), an int column or one
    position per prompt; a padded batch takes ``attention_mask`` (a list of texts builds it). The
    attribution is the mean over prompts, so the rows sum to the mean logit difference
    (``attrs["logit_diff"]``; each prompt's in ``attrs["logit_diff_per_prompt"]``);
    ``per_prompt=True`` gives one row per component and prompt (a ``prompt`` column). ``cache``: the activations of
    a run on these tokens (``attribution_hook_names`` at least; ``model.run_with_cache(tokens)``'s serve), read
    instead of running the model, so a logit lens and attributions of one prompt share one forward.

    Example:
        >>> dla = direct_logit_attribution(model, tokens, model.to_single_token(" s"), model.to_single_token(" m"))
        >>> dla.component.unique().tolist()   # toy-attn-2l: LayerNorm, no attention biases, no MLPs
        ['embed', 'head', 'ln_final_bias']
        >>> bool(abs(dla.attribution.sum() - dla.attrs["logit_diff"]) < 1e-4)   # the shares sum to the logit difference
        True
        >>> _, cache = model.run_with_cache(tokens)   # one run read by several attributions
        >>> shared = direct_logit_attribution(model, tokens, " s", cache=cache).attribution
        >>> bool((shared - direct_logit_attribution(model, tokens, " s").attribution).abs().max() < 1e-4)
        True
    """
    cfg = model.cfg
    if cfg.norm_placement == "post":
        raise InputError("direct logit attribution needs a residual stream that is a sum of components "
                         "(norm_placement 'pre', 'sandwich' or 'sublayer_output'); this model is post-norm, "
                         "ln(x + f(x)): the norm after each residual sum mixes the components it sees non-linearly")
    if cfg.output_logits_soft_cap is not None or cfg.embed_norm:
        raise InputError("direct logit attribution needs logits linear in the residual stream and embeddings "
                         "entering it as they are: this model soft-caps its logits or norms its embeddings")
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    B = batch.size
    target_B = token_ids(model, target_token, B, "target_token")
    baseline_B = None if baseline_token is None else token_ids(model, baseline_token, B, "baseline_token")
    positions_B = batch.positions(position)
    if positions_B is None:
        raise InputError("direct logit attribution reads one position per prompt: position must be 'last', an int "
                         "or one position per prompt, not 'all'")
    rows_B = torch.arange(B, device=batch.tokens.device)
    pads = [] if batch.mask is None else (~batch.mask[rows_B, positions_B]).nonzero().flatten().tolist()
    if pads:
        raise InputError(f"position {position!r} is a pad in prompt(s) {pads}; read each prompt at a real token "
                         f"(position='last' is each prompt's last real token)")
    L = cfg.n_layers
    final = f"blocks.{L - 1}.hook_resid_post"
    names = attribution_hook_names(model)
    # Sandwich / sublayer_output blocks norm attention's output before it joins the stream (hook_mlp_out is
    # already normed): its divisor, frozen, makes each head's share of the normed output linear.
    attn_scales = [model.output_norm_scale_hook(l, "attn") for l in range(L)]
    acts = activations_of_run(model, batch.tokens, batch.mask, names, cache)
    at = lambda name: acts[name][rows_B, positions_B]  # noqa: E731  each row at its own position: [B, ...]
    # Only the read positions go through the final norm and unembedding; the norm's scale is kept there.
    kept: dict[str, Tensor] = {}
    with model.hooks(fwd_hooks=[("ln_final.hook_scale", lambda scale, hook: kept.update(scale=scale))]):
        final_BV = model.logits_from_resid(at(final)[:, None])[:, 0].float()
    scale_B1 = kept["scale"][:, 0].float()

    direction_BD = model.tokens_to_residual_directions(target_B).float()
    if baseline_B is not None:
        direction_BD = direction_BD - model.tokens_to_residual_directions(baseline_B).float()

    def share(vectors_BnD: Tensor) -> Tensor:  # [B, n, d_model] -> each vector's share of each row's logit difference
        normed = model.apply_final_norm(vectors_BnD.float(), frozen_scale=scale_B1[:, None]).float()
        return torch.einsum("bnd,bd->bn", normed, direction_BD)

    parts: list[tuple[str, int, int, Tensor]] = [("embed", -1, -1, share(at("hook_embed")[:, None])[:, 0])]
    if "hook_pos_embed" in names:
        parts.append(("pos_embed", -1, -1, share(at("hook_pos_embed")[:, None])[:, 0]))
    for l in range(L):
        attn_share = _attention_share(model, l, None if attn_scales[l] is None else at(attn_scales[l]), share)
        z_BHK = at(f"blocks.{l}.attn.hook_z").float()
        result_BHD = torch.einsum("bhk,hkd->bhd", z_BHK, model.layer_W_O(l).float())
        parts += [("head", l, h, values_B) for h, values_B in enumerate(attn_share(result_BHD).unbind(1))]
        b_O = model.layer_b_O(l)  # None without a bias: no row (model.b_O would be zeros)
        if b_O is not None:
            parts.append(("attn_bias", l, -1, attn_share(b_O.float().expand(B, 1, -1))[:, 0]))
        bias_D = model.output_norm_bias(l, "attn") if attn_scales[l] is not None else None
        if bias_D is not None:  # a LayerNorm output norm's own bias
            parts.append(("attn_norm_bias", l, -1, share(bias_D.float().expand(B, 1, -1))[:, 0]))
        if not cfg.attn_only:
            parts.append(("mlp", l, -1, share(at(f"blocks.{l}.hook_mlp_out")[:, None])[:, 0]))
    final_bias_D = model.final_norm_bias()
    if final_bias_D is not None:
        parts.append(("ln_final_bias", -1, -1, direction_BD @ final_bias_D.float()))
    if cfg.unembed_bias:  # where fold_ln put the final LayerNorm's bias
        b_U = model.b_U.float()
        parts.append(("unembed_bias", -1, -1, b_U[target_B] - (b_U[baseline_B] if baseline_B is not None else 0)))
    labels = pd.DataFrame([part[:3] for part in parts], columns=["component", "layer", "head"])
    values_nB = torch.stack([part[3] for part in parts]).cpu()
    if per_prompt:
        table = per_prompt_table(labels, values_nB, B, "direct logit attribution").rename(columns={"metric": "attribution"})
    else:
        table = labels.assign(attribution=values_nB.mean(1).numpy())
    # Exact with processed or unprocessed weights (the final norm's gain is read from the model); say which.
    table.attrs["weights"] = ("processed: " + ", ".join(cfg.weight_processing)) if cfg.weight_processing else "as loaded"
    logit_diff_B = final_BV[rows_B, target_B] - (final_BV[rows_B, baseline_B] if baseline_B is not None else 0.0)
    table.attrs["logit_diff"] = float(logit_diff_B.mean())
    table.attrs["logit_diff_per_prompt"] = logit_diff_B.tolist()
    return table
