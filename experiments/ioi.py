"""Indirect object identification over a dataset: the logit difference, its head patching map and the top heads.

Legend: B batch, P position.

Each prompt of an ``experiments.datasets.ioi_dataset`` ends right before the indirect object
("When Mary and John went to the store, John gave a drink to" -> " Mary"); its corrupted twin
swaps the subject's repeat for the IO name, so the right answer flips. The metric is
logit[IO] - logit[S] at each prompt's last real token; head patching copies each head's output
from the clean run into the corrupted one, and the heads whose patch restores the most logit
difference (normalized = (patched - corrupt) / (clean - corrupt), over the dataset means) are the
circuit's candidates (Wang et al. 2022).

``python -m experiments.ioi --model smollm2-135m --n 200 --out DIR`` writes ``ioi_prompts``,
``ioi_logit_diff`` (per prompt) and ``ioi_head_patching`` (map and top heads) as CSV/JSON/HTML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from experiments._progress import ProgressArg
from experiments.datasets import IOIDataset
from experiments.distributed import mean_over_prompts
from experiments.metrics import LogitDiff, PromptBatch
from experiments.patching import patch_heads, patching_heatmap


@dataclass(frozen=True)
class IOIResult:
    """The per-prompt logit differences, the head patching map and its top heads.

    Example:
        >>> result = ioi_patching(model, ioi_dataset(model, 50))   # doctest: +SKIP
        >>> result.logit_diff.clean.mean(), result.top_heads.head(3)   # doctest: +SKIP
    """

    logit_diff: pd.DataFrame  # prompt, clean, corrupt: logit[IO] - logit[S] of each prompt
    head_patching: pd.DataFrame  # layer, head, metric, delta, normalized (means over prompts)
    top_heads: pd.DataFrame  # the heads with the largest normalized effect


@torch.no_grad()
def ioi_logit_diffs(model, data: IOIDataset) -> pd.DataFrame:
    """logit[IO] - logit[S] at each prompt's last real token, clean and corrupted: DataFrame[prompt, clean, corrupt].

    Example:
        >>> ioi_logit_diffs(model, ioi_dataset(model, 20)).clean.mean()   # doctest: +SKIP
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
        >>> result = ioi_patching(model, ioi_dataset(model, 200), top_k=5)   # doctest: +SKIP
    """
    heads = patch_heads(model, data.clean_tokens, data.corrupt_tokens, data.answer_tokens, data.wrong_tokens,
                        progress, clean_mask=data.clean_mask, corrupt_mask=data.corrupt_mask)
    top = heads.nlargest(top_k, "normalized").reset_index(drop=True)
    return IOIResult(ioi_logit_diffs(model, data), heads, top)


def logit_diff_figure(logit_diff: pd.DataFrame) -> go.Figure:
    """Histogram of the clean and corrupted logit differences over the prompts.

    Example:
        >>> logit_diff_figure(ioi_logit_diffs(model, data))   # doctest: +SKIP
    """
    fig = go.Figure([go.Histogram(x=logit_diff[column], name=column, opacity=0.7) for column in ("clean", "corrupt")])
    fig.update_layout(barmode="overlay", title="IOI logit difference logit[IO] - logit[S] per prompt",
                      xaxis_title="logit difference", yaxis_title="prompts")
    return fig


@torch.no_grad()
def ioi_per_prompt(model, data: IOIDataset, progress: ProgressArg = False) -> pd.DataFrame:
    """Per prompt: its clean and corrupted logit difference and each head's patching effect.

    DataFrame[prompt, layer, head, clean, corrupt, metric, delta, normalized], prompt-major:
    ``clean``/``corrupt`` as ``ioi_logit_diffs``, the rest as ``patch_heads(..., per_prompt=True)``.

    Example:
        >>> rows = ioi_per_prompt(model, ioi_dataset(model, 8))                      # doctest: +SKIP
        >>> ioi_result(rows).top_heads                                              # doctest: +SKIP
    """
    diffs = ioi_logit_diffs(model, data)
    heads = patch_heads(model, data.clean_tokens, data.corrupt_tokens, data.answer_tokens, data.wrong_tokens,
                        progress, per_prompt=True, clean_mask=data.clean_mask, corrupt_mask=data.corrupt_mask)
    rows = heads.merge(diffs, on="prompt").sort_values(["prompt", "layer", "head"], kind="stable", ignore_index=True)
    return rows[["prompt", "layer", "head", "clean", "corrupt", "metric", "delta", "normalized"]]


def ioi_result(rows: pd.DataFrame, top_k: int = 10, str_tokens: Optional[list[str]] = None) -> IOIResult:
    """``ioi_patching``'s result from ``ioi_per_prompt`` rows (of a whole dataset, e.g. sharded).

    ``head_patching`` holds the means over prompts (normalized = mean delta / (mean clean - mean
    corrupt)); its attrs the clean/corrupt metric means and per-prompt lists (and ``str_tokens``).

    Example:
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli
    from experiments.datasets import ioi_dataset

    parser = _cli.make_parser("IOI over a generated dataset: logit difference, head patching map, top heads.",
                              "ioi", per_prompt=True)
    parser.add_argument("--n", type=int, default=200, help="number of prompt pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corruption", default="swap_subject", choices=("swap_subject", "abc"))
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--names", nargs="+", default=None, help="names to draw (default: the single-token DEFAULT_NAMES)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    data = ioi_dataset(model, args.n, seed=args.seed, names=args.names, corruption=args.corruption)
    if _cli.sharded(args):
        from experiments._tokens import str_tokens

        with _cli.worker_pool(args) as pool:
            rows = pool.run(ioi_per_prompt, data, progress=not args.no_progress)
        result = ioi_result(rows, args.top_k, str_tokens(model, data.clean_tokens[0]))
    else:
        result = ioi_patching(model, data, args.top_k, progress=not args.no_progress)
    summary = {"model": args.model, "n": args.n, "seed": args.seed, "corruption": args.corruption,
               "mean_logit_diff_clean": float(result.logit_diff.clean.mean()),
               "mean_logit_diff_corrupt": float(result.logit_diff.corrupt.mean()),
               "fraction_clean_positive": float((result.logit_diff.clean > 0).mean()),
               "top_heads": result.top_heads[["layer", "head", "normalized"]].to_dict("records")}
    prompts = data.to_frame()
    _cli.write_outputs(args.out, "ioi_prompts", prompts, logit_diff_figure(result.logit_diff), summary)
    _cli.write_outputs(args.out, "ioi_logit_diff", result.logit_diff, logit_diff_figure(result.logit_diff), summary)
    _cli.write_outputs(args.out, "ioi_head_patching", result.head_patching,
                       patching_heatmap(result.head_patching, f"IOI head patching over {args.n} prompts (normalized)"),
                       {**summary, **result.head_patching.attrs})
    print(f"IOI logit difference over {args.n} prompts: clean {summary['mean_logit_diff_clean']:.3f}, "
          f"corrupted {summary['mean_logit_diff_corrupt']:.3f}")
    print("top heads by normalized patching effect:")
    print(result.top_heads.to_string(index=False))


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
