"""Logit lens and direct logit attribution, of one prompt or averaged over a padded batch.

Legend: B batch, L n_layers, P position, H n_heads, K d_head, D d_model, V d_vocab, T residual snapshots.

Logit lens: the residual stream entering each layer (and the final one) is read out through
the model's own final norm and unembedding (``Decoder.logits_from_resid``), so snapshot L is
exactly the model's logits. ``logit_lens`` shows one prompt's top tokens (``row`` of a padded
batch, its pads dropped); ``logit_lens_metric`` reads a dataset-level metric (e.g. ``LogitDiff`` at
each prompt's last real token) through every snapshot, as the mean over prompts or per prompt.

Direct logit attribution: the final residual is a sum of components (embeddings, each head's
output, each attention bias, each MLP output). With the final norm's scale frozen at its value on
this input, the norm is linear (``Decoder.apply_final_norm`` with ``frozen_scale``), so each
component's share of logit[target] - logit[baseline] is norm(component) . (W_U[target] - W_U[baseline]);
a LayerNorm bias adds one more term. The shares sum exactly to the logit difference.
Sandwich blocks (x + ln_post(f(ln(x))), Gemma 2/3) and sublayer_output blocks (x + ln_post(f(x)), OLMo 2)
keep the residual a plain sum: a sublayer's component is its normed output. Attention's is split
into heads (and its bias) through ln1_post's linear part, its scale frozen at its value on this input
(``Decoder.apply_output_norm``), so the heads' shares sum exactly to the normed output; a LayerNorm
ln1_post's bias is one more component. Post-norm models (ln(x + f(x))) are refused: there the
norm after each residual sum mixes the components.
Over a batch each prompt is read at its own position (its last real token by default) with its
own target and baseline, and the shares are averaged over prompts (they sum to the mean logit difference).

Padded batches take ``attention_mask`` [B, P] (1 real, 0 pad; a list of texts builds it, padded on
``padding_side``); each row's values equal its prompt run alone, and a batch's value is the mean
of its prompts' values.

``python -m experiments.lens --model NAME --out DIR [--prompt TEXT --target TEXT --baseline TEXT]``
The command line is ``experiments.cli.lens``, the figures ``experiments.plots.lens``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.metrics import (MetricLike, PositionSelector, TokenIds, as_metric, per_prompt_table, prompt_batch,
                                 token_ids)
from workbench.errors import InputError
from workbench.readouts import fast_screen_dtype


def _prompt_alone(model, tokens: TextOrTokens, row: int, attention_mask: Optional[Tensor],
                  padding_side: str) -> Int[Tensor, "1 pos"]:
    """Prompt ``row`` of a (padded) batch as its real tokens only, [1, n]: run alone, it gives that row's values."""
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    if not -batch.size <= row < batch.size:
        raise InputError(f"row={row} is outside the batch of {batch.size} prompt(s)")
    tokens_P = batch.tokens[row]
    return (tokens_P if batch.mask is None else tokens_P[batch.mask[row]])[None]


def snapshot_hook_names(model) -> list[str]:
    """The hooks the logit lens reads: the stream entering each block, then after the last.

    Example:
        >>> snapshot_hook_names(model)
        ['blocks.0.hook_resid_pre', 'blocks.1.hook_resid_pre', 'blocks.1.hook_resid_post']
    """
    L = model.cfg.n_layers
    return [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]


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


def _activations(model, tokens_BP: Tensor, mask_BP: Optional[Tensor], names: list[str], cache) -> dict[str, Tensor]:
    """``names`` of a run on ``tokens_BP``: read from ``cache`` (an ``ActivationCache`` or dict of that very run, as
    TransformerLens's analyses take one), or from a run that stops after the blocks."""
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


@torch.no_grad()
def residual_snapshots(model, tokens: TextOrTokens, row: int = 0, *, attention_mask: Optional[Tensor] = None,
                       padding_side: str = "right", cache=None) -> Float[Tensor, "snapshots pos d_model"]:
    """The residual stream of prompt ``row`` entering each layer, then after the last: [L + 1, P, D].

    A padded batch takes ``attention_mask`` (a list of texts builds it); the row's pads are
    dropped (P is its real tokens), so it equals the prompt alone. ``cache``: the activations of a run on the
    prompt alone ([1, P]; ``snapshot_hook_names`` at least), read instead of running the model.

    Example:
        >>> residual_snapshots(model, tokens).shape   # 2 layers: 3 snapshots of 14 positions
        torch.Size([3, 14, 128])
        >>> residual_snapshots(model, ["a b c", "a"], row=1).shape   # BOS and "a"
        torch.Size([3, 2, 128])
        >>> _, cache = model.run_with_cache(tokens)
        >>> torch.allclose(residual_snapshots(model, tokens, cache=cache), residual_snapshots(model, tokens), atol=1e-5)
        True
    """
    tokens_1P = _prompt_alone(model, tokens, row, attention_mask, padding_side)
    names = snapshot_hook_names(model)
    acts = _activations(model, tokens_1P, None, names, cache)
    return torch.cat([acts[name] for name in names])


@torch.no_grad()
def logit_lens_logits(model, tokens: TextOrTokens, row: int = 0, *, attention_mask: Optional[Tensor] = None,
                      padding_side: str = "right") -> Float[Tensor, "snapshots pos d_vocab"]:
    """Every snapshot of prompt ``row`` through the final norm and unembedding: [L + 1, P, V]; the last is the model's logits.

    Arguments as ``residual_snapshots`` (a padded row's pads dropped).

    Example:
        >>> torch.allclose(logit_lens_logits(model, tokens)[-1], model(tokens)[0])
        True
    """
    return model.logits_from_resid(residual_snapshots(model, tokens, row, attention_mask=attention_mask,
                                                      padding_side=padding_side))


@torch.no_grad()
def logit_lens(model, tokens: TextOrTokens, top_k: int = 5, row: int = 0, *, attention_mask: Optional[Tensor] = None,
               padding_side: str = "right", tuned_lens=None, screen: bool = False, cache=None) -> pd.DataFrame:
    """Top-k tokens of each layer's residual stream at each position of prompt ``row``.

    Returns DataFrame[layer, position, rank, token, token_id, prob]; layer l < n_layers is the
    stream entering block l, layer n_layers the final stream (the model's own prediction). A padded
    batch takes ``attention_mask``; positions are the row's real tokens (its pads dropped). With
    ``tuned_lens`` (an ``experiments.lenses.TunedLens``) each layer is read through its translator first.
    ``screen=True`` reads the vocabulary through a bfloat16 screen where the device runs bfloat16 fast
    (``Decoder.top_logits_from_resid``; exact elsewhere): about 4x less unembedding time on such a CPU, the top
    tokens' logits exact, and their probabilities off by the screen's error on the rest of the vocabulary (at most
    0.002 over SmolLM2's 31 snapshots of five 64-token prompts); ``df.attrs["screen"]`` names the screen's dtype
    (None: exact). ``cache``: as ``residual_snapshots`` takes it.

    Example:
        >>> df = logit_lens(model, model.to_tokens("The cat sat"), top_k=5)   # 6 tokens, 3 snapshots
        >>> len(df), list(df.columns)
        (90, ['layer', 'position', 'rank', 'token', 'token_id', 'prob'])
        >>> last = df[(df["rank"] == 1) & (df.position == df.position.max())]   # each snapshot's top token at the end
        >>> last.layer.tolist(), int(last.token_id.iloc[-1]) == int(model(model.to_tokens("The cat sat"))[0, -1].argmax())
        ([0, 1, 2], True)
    """
    if top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    resid_TPD = residual_snapshots(model, tokens, row, attention_mask=attention_mask, padding_side=padding_side,
                                   cache=cache)
    T, P, D = resid_TPD.shape
    if tuned_lens is not None:  # each snapshot through its layer's translator, then the model's own readout
        resid_TPD = torch.stack([tuned_lens.transform_hidden(resid_TPD[t], t) for t in range(T)])
    screen_dtype = fast_screen_dtype(resid_TPD.device) if screen else None
    values_Nk, ids_Nk, lse_N = model.top_logits_from_resid(resid_TPD.reshape(-1, D), top_k, screen_dtype)
    probs_Nk, ids_Nk = (values_Nk - lse_N[:, None]).exp().cpu(), ids_Nk.cpu()
    k = ids_Nk.shape[-1]
    flat_ids = ids_Nk.reshape(-1)
    unique, inverse = flat_ids.unique(return_inverse=True)
    text = np.array(str_tokens(model, unique), dtype=object)[inverse.numpy()]
    table = pd.DataFrame({
        "layer": np.repeat(np.arange(T), P * k), "position": np.tile(np.repeat(np.arange(P), k), T),
        "rank": np.tile(np.arange(1, k + 1), T * P), "token": text, "token_id": flat_ids.numpy(),
        "prob": probs_Nk.reshape(-1).numpy(),
    })
    table.attrs["screen"] = None if screen_dtype is None else str(screen_dtype).removeprefix("torch.")
    return table


@torch.no_grad()
def logit_lens_metric(model, tokens: TextOrTokens, metric: MetricLike, *, position: Optional[PositionSelector] = None,
                      per_prompt: bool = False, attention_mask: Optional[Tensor] = None,
                      padding_side: str = "right") -> pd.DataFrame:
    """A metric read through the final norm and unembedding from every snapshot: DataFrame[layer, metric].

    The logit lens of a dataset-level metric: ``metric`` (``LogitDiff``, ``TokenProbability``, "loss"
    or a callable ``(logits, tokens) -> scalar or [batch]``; see ``experiments.metrics``) evaluated
    on the residual stream entering each layer (layer l) and after the last (layer n_layers, equal
    to the metric of the model's own logits). ``position`` replaces the metric's selector ("last":
    each row's last real token). Means over prompts; ``per_prompt=True`` gives a ``prompt``
    column. A metric at one position per row unembeds only those positions ([B, D] per snapshot);
    the loss is tiled; only a metric over "all" positions unembeds every position. Snapshots are
    scored as the forward pass reaches them, so no cache of every layer is held.

    Example:
        >>> table = logit_lens_metric(model, ["The cat sat on the mat.", "The cat"], "loss")   # a padded batch
        >>> table.layer.tolist(), bool(table.metric.is_monotonic_decreasing)   # the loss falls layer by layer
        ([0, 1, 2], True)
        >>> final_loss = logit_lens_metric(model, tokens, "loss").metric.iloc[-1]   # the model's own loss
        >>> bool(abs(final_loss - model(tokens, return_type="loss").item()) < 1e-4)
        True
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    values: dict[str, Tensor] = {}

    def score(resid_BPD: Tensor, hook) -> None:
        values[hook.name] = metric_from_final_resid(model, resid_BPD, batch, metric)[0].float().cpu()

    # stop_at_layer=n_layers: the blocks run and the model does not unembed every position itself.
    model.run_with_hooks(batch.tokens, attention_mask=batch.mask, stop_at_layer=L,
                         fwd_hooks=[(name, score) for name in names])
    values_TR = torch.stack([values[name] for name in names])
    labels = pd.DataFrame({"layer": np.arange(L + 1)})
    if per_prompt:
        table = per_prompt_table(labels, values_TR, batch.size, "logit lens")
    else:
        table = labels.assign(metric=values_TR.mean(1).numpy())
    table.attrs.update(snapshots=names, metric_per_prompt=values_TR.tolist())
    return table


def promoted_and_suppressed(model, effect_V: Float[Tensor, "d_vocab"], k: int = 10) -> pd.DataFrame:
    """The ``k`` tokens a direct effect on the logits raises most and lowers most.

    DataFrame[direction ("promoted", then "suppressed"), rank, token, token_id, effect]: promoted from
    the largest effect down, suppressed from the most negative up. The one table behind a neuron's
    direct effect (``experiments.neurons``) and a block's vocabulary projection (``experiments.flow``).

    Example:
        >>> effect_V = torch.arange(float(model.cfg.d_vocab))   # an effect rising with the token id
        >>> promoted_and_suppressed(model, effect_V, k=2)[["direction", "rank", "token_id", "effect"]].values.tolist()
        [['promoted', 1, 2047, 2047.0], ['promoted', 2, 2046, 2046.0], ['suppressed', 1, 0, 0.0], ['suppressed', 2, 1, 1.0]]
    """
    if k < 1:
        raise InputError(f"k must be at least 1, got {k}")
    effect_V = effect_V.detach().float().cpu()
    k = min(k, effect_V.numel())
    top, bottom = effect_V.topk(k), effect_V.topk(k, largest=False)
    ids = torch.cat([top.indices, bottom.indices])
    return pd.DataFrame({"direction": ["promoted"] * k + ["suppressed"] * k, "rank": list(range(1, k + 1)) * 2,
                         "token": str_tokens(model, ids), "token_id": ids.numpy(),
                         "effect": torch.cat([top.values, bottom.values]).numpy()})


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
    acts = _activations(model, batch.tokens, batch.mask, names, cache)
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
        if attn_scales[l] is not None and cfg.normalization == "LN":  # the output norm's bias: its norm of zeros
            bias_D = model.apply_output_norm(l, "attn", torch.zeros(cfg.d_model, dtype=cfg.dtype, device=cfg.device))
            parts.append(("attn_norm_bias", l, -1, share(bias_D.float().expand(B, 1, -1))[:, 0]))
        if not cfg.attn_only:
            parts.append(("mlp", l, -1, share(at(f"blocks.{l}.hook_mlp_out")[:, None])[:, 0]))
    if cfg.normalization == "LN":  # the bias is the norm of a zero vector
        bias_D = model.apply_final_norm(torch.zeros(1, cfg.d_model, dtype=cfg.dtype, device=cfg.device))[0]
        parts.append(("ln_final_bias", -1, -1, direction_BD @ bias_D.float()))
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




if __name__ == "__main__":  # the command line lives in experiments.cli.lens
    from experiments._cli import run_command

    run_command("lens")
