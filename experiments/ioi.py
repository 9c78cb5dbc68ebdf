"""Indirect object identification over a dataset: the logit difference, its head patching map and the top heads.

Legend: B batch, P position.

Each prompt of an ``experiments.datasets.ioi_dataset`` ends right before the indirect object
("When Mary and John went to the store, John gave a drink to" -> " Mary"); its corrupted twin
swaps the subject's repeat for the IO name, so the right answer flips. The metric is
logit[IO] - logit[S] at each prompt's last real token; head patching copies each head's output
from the clean run into the corrupted one, and the heads whose patch restores the most logit
difference (normalized = (patched - corrupt) / (clean - corrupt), over the dataset means) are the
circuit's candidates (Wang et al. 2022).

Figures: ``experiments.plots.ioi``. ``python -m experiments.ioi --model smollm2-135m --n 200 --out DIR``
(``experiments.cli.ioi``) writes ``ioi_prompts``, ``ioi_logit_diff`` (per prompt) and
``ioi_head_patching`` (map and top heads) as CSV/JSON/HTML.

The examples draw names that are one token each in toy-attn-2l's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd
import torch

from experiments._progress import ProgressArg
from experiments.datasets import IOIDataset
from experiments.distributed import mean_over_prompts
from experiments.metrics import LogitDiff, PromptBatch
from experiments.patching import PairedPrompts, patch_heads


@dataclass(frozen=True)
class IOIResult:
    """The per-prompt logit differences, the head patching map and its top heads.

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> result = ioi_patching(model, ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"]),
        ...                       top_k=3, progress=False)
        >>> len(result.logit_diff), len(result.head_patching), result.top_heads[["layer", "head"]].values.tolist()
        (4, 8, [[0, 1], [1, 3], [1, 0]])
    """

    logit_diff: pd.DataFrame  # prompt, clean, corrupt: logit[IO] - logit[S] of each prompt
    head_patching: pd.DataFrame  # layer, head, metric, delta, normalized (means over prompts)
    top_heads: pd.DataFrame  # the heads with the largest normalized effect


@torch.no_grad()
def ioi_logit_diffs(model, data: IOIDataset) -> pd.DataFrame:
    """logit[IO] - logit[S] at each prompt's last real token, clean and corrupted: DataFrame[prompt, clean, corrupt].

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> ioi_logit_diffs(model, ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"])).round(2)
           prompt  clean  corrupt
        0       0  -0.63    -0.59
        1       1  -0.23     0.09
        2       2   1.57     1.59
        3       3  -0.66    -0.74
    """
    metric = LogitDiff(data.answer_tokens, data.wrong_tokens)
    values = {}
    for name, tokens, mask in (("clean", data.clean_tokens, data.clean_mask),
                               ("corrupt", data.corrupt_tokens, data.corrupt_mask)):
        logits = model(tokens, attention_mask=mask)
        values[name] = metric.values(logits, PromptBatch(tokens, mask.bool())).cpu().numpy()
    return pd.DataFrame({"prompt": range(len(data)), **values})


def ioi_patching(model, data: IOIDataset, top_k: int = 10, progress: ProgressArg = True) -> IOIResult:
    """The IOI logit difference of every prompt and each head's patching effect over the dataset.

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> data = ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"])
        >>> ioi_patching(model, data, top_k=3, progress=False).top_heads[["layer", "head"]].values.tolist()
        [[0, 1], [1, 3], [1, 0]]
    """
    heads = patch_heads(model, PairedPrompts.from_prompts(model, data), progress)
    top = heads.nlargest(top_k, "normalized").reset_index(drop=True)
    return IOIResult(ioi_logit_diffs(model, data), heads, top)


@torch.no_grad()
def ioi_per_prompt(model, data: IOIDataset, progress: ProgressArg = False) -> pd.DataFrame:
    """Per prompt: its clean and corrupted logit difference and each head's patching effect.

    DataFrame[prompt, layer, head, clean, corrupt, metric, delta, normalized], prompt-major:
    ``clean``/``corrupt`` as ``ioi_logit_diffs``, the rest as ``patch_heads(..., per_prompt=True)``.

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> rows = ioi_per_prompt(model, ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"]))
        >>> rows.shape   # 4 prompts x 8 heads
        (32, 8)
        >>> ioi_result(rows, top_k=3).top_heads[["layer", "head"]].values.tolist()   # as ioi_patching's
        [[0, 1], [1, 3], [1, 0]]
    """
    diffs = ioi_logit_diffs(model, data)
    heads = patch_heads(model, PairedPrompts.from_prompts(model, data), progress, per_prompt=True)
    rows = heads.merge(diffs, on="prompt").sort_values(["prompt", "layer", "head"], kind="stable", ignore_index=True)
    return rows[["prompt", "layer", "head", "clean", "corrupt", "metric", "delta", "normalized"]]


def ioi_result(rows: pd.DataFrame, top_k: int = 10, str_tokens: Optional[list[str]] = None) -> IOIResult:
    """``ioi_patching``'s result from ``ioi_per_prompt`` rows (of a whole dataset, e.g. sharded).

    ``head_patching`` holds the means over prompts (normalized = mean delta / (mean clean - mean
    corrupt)); its attrs the clean/corrupt metric means and per-prompt lists (and ``str_tokens``).

    Example:
        >>> from experiments.distributed import run_sharded
        >>> result = ioi_result(run_sharded(ioi_per_prompt, data, "smollm2-135m"), top_k=5)   # doctest: +SKIP
    """
    logit_diff = rows.drop_duplicates("prompt")[["prompt", "clean", "corrupt"]].reset_index(drop=True)
    heads = mean_over_prompts(rows[["prompt", "layer", "head", "metric", "delta"]], ["layer", "head"])
    gap = float(logit_diff.clean.mean()) - float(logit_diff.corrupt.mean())
    heads["normalized"] = heads["delta"] / gap if abs(gap) > 1e-12 else np.nan
    heads.attrs.update(clean_metric=float(logit_diff.clean.mean()), corrupt_metric=float(logit_diff.corrupt.mean()),
                       clean_metric_per_prompt=logit_diff.clean.tolist(),
                       corrupt_metric_per_prompt=logit_diff.corrupt.tolist(),
                       **({"str_tokens": str_tokens} if str_tokens is not None else {}))
    return IOIResult(logit_diff, heads, heads.nlargest(top_k, "normalized").reset_index(drop=True))


if __name__ == "__main__":  # the command line lives in experiments.cli.ioi
    from experiments._cli import run_command

    run_command("ioi")
