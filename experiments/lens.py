"""Logit lens and direct logit attribution, of one prompt or averaged over a padded batch.

Legend: B batch, L n_layers, P position, H n_heads, K d_head, D d_model, V d_vocab, T residual snapshots.

Logit lens: the residual stream entering each layer (and the final one) is read out through
the model's own final norm and unembedding (``Decoder.logits_from_resid``), so snapshot L is
exactly the model's logits. ``logit_lens`` shows one prompt's top tokens (``row`` of a padded
batch, its pads dropped; ``logit_lens_with_cache`` also returns the run it read, each layer read as the pass
reaches it); ``logit_lens_metric`` reads a dataset-level metric (e.g. ``LogitDiff`` at
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

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache

from experiments._batched import metric_from_final_resid
from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.metrics import MetricLike, PositionSelector, as_metric, per_prompt_table, prompt_batch
from workbench.errors import InputError
from workbench.readouts import fast_screen_dtype
# Direct logit attribution lives in its own module; this one is its public home, as the docstring above says.
from experiments._lens_attribution import (activations_of_run, attribution_hook_names,  # noqa: F401
                                           direct_logit_attribution)


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
    acts = activations_of_run(model, tokens_1P, None, names, cache)
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
               padding_side: str = "right", tuned_lens=None, screen: bool = False, cache=None,
               positions: Optional[Sequence[int]] = None, workers: int = 1) -> pd.DataFrame:
    """Top-k tokens of each layer's residual stream at each position of prompt ``row``.

    Returns DataFrame[layer, position, rank, token, token_id, prob]; layer l < n_layers is the
    stream entering block l, layer n_layers the final stream (the model's own prediction). A padded
    batch takes ``attention_mask``; positions are the row's real tokens (its pads dropped). With
    ``tuned_lens`` (an ``experiments.lenses.TunedLens``) each layer is read through its translator first.
    ``screen=True`` reads the vocabulary through a bfloat16 screen where the device runs bfloat16 fast
    (``Decoder.top_logits_from_resid``; exact elsewhere): about 4x less unembedding time on such a CPU, the top
    tokens' logits exact, and their probabilities off by the screen's error on the rest of the vocabulary (at most
    0.002 over SmolLM2's 31 snapshots of five 64-token prompts); ``df.attrs["screen"]`` names the screen's dtype
    (None: exact). ``cache``: as ``residual_snapshots`` takes it. ``positions``: read only these positions of the
    prompt (each snapshot's readout is per position: the rows are those of the whole table); ``df.attrs["prompt_positions"]``
    is the prompt's length either way. ``workers``: threads reading the vocabulary at once
    (``Decoder.top_logits_from_resid``); the table does not depend on it.

    Example:
        >>> df = logit_lens(model, model.to_tokens("The cat sat"), top_k=5)   # 6 tokens, 3 snapshots
        >>> len(df), list(df.columns)
        (90, ['layer', 'position', 'rank', 'token', 'token_id', 'prob'])
        >>> last = df[(df["rank"] == 1) & (df.position == df.position.max())]   # each snapshot's top token at the end
        >>> last.layer.tolist(), int(last.token_id.iloc[-1]) == int(model(model.to_tokens("The cat sat"))[0, -1].argmax())
        ([0, 1, 2], True)
        >>> logit_lens(model, model.to_tokens("The cat sat"), positions=[4, 5]).position.unique().tolist()
        [4, 5]
    """
    if cache is None:  # one pass, each snapshot read as the pass reaches it
        return logit_lens_with_cache(model, tokens, top_k, row, names_filter=[], attention_mask=attention_mask,
                                     padding_side=padding_side, tuned_lens=tuned_lens, screen=screen,
                                     positions=positions, workers=workers)[0]
    if top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    resid_TPD = residual_snapshots(model, tokens, row, attention_mask=attention_mask, padding_side=padding_side,
                                   cache=cache)
    prompt_positions = resid_TPD.shape[1]
    read_P = np.arange(prompt_positions) if positions is None else _checked_positions(positions, prompt_positions)
    screen_dtype = fast_screen_dtype(resid_TPD.device) if screen else None
    with model.top_logits_reader(top_k, screen_dtype, workers) as reader:
        for t, resid_PD in enumerate(resid_TPD[:, torch.as_tensor(read_P)]):
            reader.add(resid_PD if tuned_lens is None else tuned_lens.transform_hidden(resid_PD, t))
        return _lens_table(model, reader.result(), len(resid_TPD), read_P, screen_dtype, prompt_positions)


@torch.no_grad()
def logit_lens_with_cache(model, tokens: TextOrTokens, top_k: int = 5, row: int = 0, *, names_filter=None,
                          attention_mask: Optional[Tensor] = None, padding_side: str = "right", tuned_lens=None,
                          screen: bool = False, positions: Optional[Sequence[int]] = None,
                          workers: int = 1) -> tuple[pd.DataFrame, ActivationCache]:
    """``logit_lens``'s table, and the activations of the same forward pass that ``names_filter`` selects (as
    ``model.run_with_cache(tokens, names_filter=...)`` keeps them): one pass serves the lens and, say, every
    direct logit attribution asked of the prompt afterwards (``names_filter=attribution_hook_names(model)``).

    Each snapshot is handed to the readout as the pass reaches it (``model.top_logits_reader``): with ``workers`` >= 2
    the first layers' snapshots are read through the unembedding while the later layers run. The table equals
    ``logit_lens``'s, whatever ``workers``. The pass stops after the last block (no logits of its own), so the cache
    holds no hook of the final norm or unembedding. Arguments otherwise as ``logit_lens``.

    Example:
        >>> table, run = logit_lens_with_cache(model, tokens, 3, names_filter=attribution_hook_names(model), workers=2)
        >>> table.equals(logit_lens(model, tokens, 3))
        True
        >>> direct_logit_attribution(model, tokens, 262, cache=run).equals(direct_logit_attribution(model, tokens, 262))
        True
    """
    if top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    tokens_1P = _prompt_alone(model, tokens, row, attention_mask, padding_side)
    prompt_positions = tokens_1P.shape[1]
    read_P = np.arange(prompt_positions) if positions is None else _checked_positions(positions, prompt_positions)
    index_P = torch.as_tensor(read_P, device=tokens_1P.device)
    names = snapshot_hook_names(model)
    snapshot_of = {name: t for t, name in enumerate(names)}
    screen_dtype = fast_screen_dtype(tokens_1P.device) if screen else None
    with model.top_logits_reader(top_k, screen_dtype, workers) as reader:
        def read(resid_1PD: Tensor, hook) -> None:
            resid_PD = resid_1PD[0, index_P]  # a copy: the pass goes on with its own tensor
            if tuned_lens is not None:
                resid_PD = tuned_lens.transform_hidden(resid_PD, snapshot_of[hook.name])
            reader.add(resid_PD)

        with model.hooks(fwd_hooks=[(name, read) for name in names]):
            _, cache = model.run_with_cache(tokens_1P, stop_at_layer=model.cfg.n_layers, names_filter=names_filter)
        return _lens_table(model, reader.result(), len(names), read_P, screen_dtype, prompt_positions), cache


def _lens_table(model, readout: tuple[Tensor, Tensor, Tensor], T: int, read_P: np.ndarray,
                screen_dtype: Optional[torch.dtype], prompt_positions: int) -> pd.DataFrame:
    """The lens's rows (snapshot-major, then position) as DataFrame[layer, position, rank, token, token_id, prob]."""
    values_Nk, ids_Nk, lse_N = readout
    probs_Nk, ids_Nk = (values_Nk - lse_N[:, None]).exp().cpu(), ids_Nk.cpu()
    P, k = len(read_P), ids_Nk.shape[-1]
    flat_ids = ids_Nk.reshape(-1)
    unique, inverse = flat_ids.unique(return_inverse=True)
    text = np.array(str_tokens(model, unique), dtype=object)[inverse.numpy()]
    table = pd.DataFrame({
        "layer": np.repeat(np.arange(T), P * k), "position": np.tile(np.repeat(read_P, k), T),
        "rank": np.tile(np.arange(1, k + 1), T * P), "token": text, "token_id": flat_ids.numpy(),
        "prob": probs_Nk.reshape(-1).numpy(),
    })
    table.attrs["screen"] = None if screen_dtype is None else str(screen_dtype).removeprefix("torch.")
    table.attrs["prompt_positions"] = prompt_positions
    return table


def _checked_positions(positions: Sequence[int], n: int) -> np.ndarray:
    """``positions`` as sorted distinct ints in [0, n), or an ``InputError`` naming what does not fit."""
    try:
        read = sorted({int(p) for p in positions})
    except (TypeError, ValueError):
        raise InputError(f"positions must be ints, got {positions!r}") from None
    if not read or read[0] < 0 or read[-1] >= n:
        raise InputError(f"positions must be some of the prompt's positions 0..{n - 1}, got {list(positions)!r}")
    return np.array(read)


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




if __name__ == "__main__":  # the command line lives in experiments.cli.lens
    from experiments._cli import run_command

    run_command("lens")
