"""How well a lens predicts: KL to the model's final distribution and next-token cross-entropy, by layer, for the
logit lens and the tuned lens side by side.

Legend: B batch, P position, L n_layers, N flattened tokens.

``lens_kl_by_layer`` reads each window's streams once (``training.streams_and_targets``) and scores both lenses at
every position that has a next token (after BOS); nothing larger than [chunk, V] per layer is held.

The figure is ``experiments.plots.lenses.lens_kl_figure``; the command ``python -m experiments.lenses``
prints the table on the model's held-out English text as CSV (the card's figures).
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.lenses.training import final_kl_terms, kl_per_position, streams_and_targets
from experiments.lenses.translators import TunedLens
from workbench.errors import InputError

COLUMNS = ["layer", "lens", "kl", "cross_entropy", "positions"]


@torch.no_grad()
def lens_kl_by_layer(model, windows_BP: Int[Tensor, "batch pos"], lens: Optional[TunedLens] = None, *,
                     lenses: Sequence[str] = ("logit", "tuned"), chunk_tokens: int = 128,
                     progress: ProgressArg = False) -> pd.DataFrame:
    """DataFrame[layer, lens ("logit", "tuned"), kl, cross_entropy, positions]: mean KL(final || lens) in nats and
    mean next-token cross-entropy, for the stream entering each block (layer l) and after the last (layer n_layers,
    the model's own: KL 0), over every position of ``windows_BP`` that has a next token (BOS not read). Without
    ``lens`` only the logit lens's rows; ``lenses`` picks which are scored (each row depends only on its own lens).

    Example:
        >>> table = lens_kl_by_layer(model, tokens, TunedLens.for_model(model))
        >>> table.pivot(index="layer", columns="lens", values="kl").round(4).values.tolist()[-1]   # final layer: 0
        [0.0, 0.0]
        >>> bool((table[table.lens == "tuned"].kl.values == table[table.lens == "logit"].kl.values).all())  # untrained
        True
    """
    if not isinstance(windows_BP, Tensor) or windows_BP.dim() != 2 or windows_BP.shape[1] < 3:
        raise InputError("windows_BP must be token windows [batch, pos >= 3]")
    if lens is not None:
        lens.attach(model)
    first = 1 if model.bos_first() else 0
    L = model.cfg.n_layers
    if not set(lenses) <= {"logit", "tuned"} or not lenses:
        raise InputError(f"lenses must name 'logit' and/or 'tuned', got {lenses!r}")
    lenses = [name for name in ("logit", "tuned") if name in lenses and (name == "logit" or lens is not None)]
    kl_sum = torch.zeros(len(lenses), L + 1, dtype=torch.float64)
    ce_sum = torch.zeros_like(kl_sum)
    count = 0
    with Progress(progress, total=windows_BP.shape[0], desc="lens KL") as bar:
        for row in range(windows_BP.shape[0]):
            tokens_1P = windows_BP[row:row + 1]
            hidden_LND, final_ND = streams_and_targets(model, tokens_1P, first)
            next_N = tokens_1P[0, first + 1:]
            n = next_N.shape[0]  # the last position has no next token
            streams = torch.cat([hidden_LND[:, :n], final_ND[None, :n]])
            for start in range(0, n, chunk_tokens):
                stop = min(n, start + chunk_tokens)
                final_logprobs = model.logits_from_resid(final_ND[None, start:stop])[0].float().log_softmax(-1)
                final_terms = final_kl_terms(final_logprobs)  # the same for every lens and layer
                for k, name in enumerate(lenses):
                    for l in range(L + 1):
                        hidden = streams[l, start:stop]
                        logits = lens(hidden, l) if name == "tuned" else model.logits_from_resid(hidden[None])[0]
                        logprobs = logits.float().log_softmax(-1)
                        kl_sum[k, l] += kl_per_position(logprobs, final_terms).sum().double()
                        ce_sum[k, l] += -logprobs.gather(-1, next_N[start:stop, None]).sum().double()
            count += n
            bar.advance()
    rows = [{"layer": l, "lens": name, "kl": float(kl_sum[k, l] / count), "cross_entropy": float(ce_sum[k, l] / count),
             "positions": count} for k, name in enumerate(lenses) for l in range(L + 1)]
    return pd.DataFrame(rows, columns=COLUMNS)


def held_out_windows(model, n_windows: int = 32, window: int = 128) -> Int[Tensor, "batch pos"]:
    """``n_windows`` windows of the held-out English documents (``english_documents("held_out")``, every tenth,
    never trained on); needs ``make setup-corpus``.

    Example:
        >>> held_out_windows(model, n_windows=2, window=16).shape
        torch.Size([2, 16])
    """
    from experiments.datasets import corpus_windows
    from experiments.datasets.english import english_documents

    return corpus_windows(model, english_documents("held_out"), window=window, max_windows=n_windows)
