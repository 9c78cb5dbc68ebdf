"""``evaluate_sae``: how good an SAE or transcoder is on some text, with SAELens's definitions.

Legend: B batch, P position, N flattened tokens, X d_sae, o d_out.

- ``l0``: mean number of active features per evaluated token.
- ``explained_variance``: ``1 - sum ||y - y_hat||^2 / sum ||y - mean(y)||^2`` over the evaluated tokens (SAELens 6's
  ``explained_variance``; ``y`` is the activation the SAE writes: its input for an SAE, the target hook for a
  transcoder).
- ``ce_loss_without_sae`` / ``ce_loss_with_sae`` / ``ce_loss_with_ablation``: mean next-token cross-entropy of the
  clean model, with the SAE's output written in place of ``hook_name_out``, and with ``hook_name_out`` zeroed;
  ``ce_loss_score`` (loss recovered) is ``(ablation - with_sae) / (ablation - without_sae)``.
- ``dead_fraction``: features that never fire on the evaluated tokens; ``dense_fraction``: features firing on
  more than ``DENSE`` of them; ``feature_density`` per feature.

With ``exclude_special_tokens`` (the default, as the SAE was trained) positions holding BOS / EOS / pad are
neither scored nor spliced nor ablated: they keep the model's own activation (BOS's residual has a norm hundreds
of times the others' in many models, which no SAE trained without it reconstructs).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from jaxtyping import Bool
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.sae.activations import kept_positions, not_outliers, special_token_ids
from experiments.sae.inputs import check_hook, token_rows
from workbench.errors import InputError
from workbench.sae import SAE

DENSE = 0.1  # a feature active on more than this fraction of tokens is dense


def evaluate_sae(model, sae: SAE, data: Any, batch_size: int = 8, exclude_special_tokens: bool = True,
                 outlier_norm_ratio: Optional[float] = "trained", progress: ProgressArg = True) -> dict[str, Any]:
    """L0, explained variance, CE loss recovered, dead and dense fractions of ``sae`` on ``data`` (token rows
    [B, P], texts or a path), ``batch_size`` rows per forward pass. ``outlier_norm_ratio``: positions whose input
    norm exceeds this many times the batch's median are left as they are and not counted (default: what the SAE
    was trained with, ``metadata.outlier_norm_ratio``; None: none left out). Returns a dict of floats plus
    ``feature_density`` (a tensor [X]), ``n_tokens`` and ``n_outliers`` (positions left out as outliers).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.zeros(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> metrics = evaluate_sae(model, sae, torch.randint(1, 2048, (2, 16)), progress=False)
        >>> metrics["l0"], metrics["dead_fraction"], metrics["ce_loss_score"] == 0   # the zero SAE is the ablation
        (0.0, 1.0, True)
    """
    if not isinstance(sae, SAE):
        raise InputError(f"sae must be a wb.SAE (wb.load_sae or train_sae), got {type(sae).__name__}")
    if sae.spec.encoding.reads_sequences:  # its codes read earlier positions: per-token splicing is not its metric
        raise InputError(f"evaluate_sae scores SAEs that code each token alone; a {sae.cfg.architecture()!r} SAE's "
                         "codes read the positions before them (encode it on [batch, pos, d_in] with sae.encode)")
    check_hook(model, sae.cfg.hook_name, "sae.cfg.metadata.hook_name")
    check_hook(model, sae.cfg.hook_name_out, "sae.cfg.metadata.hook_name_out")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if outlier_norm_ratio == "trained":
        outlier_norm_ratio = sae.cfg.metadata.outlier_norm_ratio
    tokens = token_rows(model, data)
    n_outliers = 0
    keep_BP = kept_positions(tokens, special_token_ids(model) if exclude_special_tokens else [])
    sums = {"ce_loss_without_sae": 0.0, "ce_loss_with_sae": 0.0, "ce_loss_with_ablation": 0.0}
    n_scored, n, active, sq_error, sum_y, sum_sq_y = 0, 0, 0.0, 0.0, 0.0, 0.0
    fired = torch.zeros(sae.cfg.d_sae)
    with Progress(progress, total=tokens.shape[0], desc="evaluating SAE") as bar, torch.no_grad():
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start:start + batch_size].to(model.cfg.device)
            keep = keep_BP[start:start + batch_size].to(model.cfg.device)
            clean, cache = model.run_with_cache(batch, names_filter=list({sae.cfg.hook_name, sae.cfg.hook_name_out}),
                                                return_type="loss", loss_per_token=True)
            if outlier_norm_ratio is not None:
                ordinary = keep.clone()
                ordinary[keep] = not_outliers(cache[sae.cfg.hook_name][keep], outlier_norm_ratio)
                n_outliers += int(keep.sum() - ordinary.sum())
                keep = ordinary
            x = cache[sae.cfg.hook_name][keep].to(sae.cfg.torch_dtype)
            y = cache[sae.cfg.hook_name_out][keep].float()
            features = sae.encode(x)
            y_hat = sae.reconstruct(x)  # what it writes (a skip transcoder's skip term included)
            spliced = run_spliced(model, batch, sae.cfg.hook_name_out, keep, y_hat.to(y.dtype))
            ablated = run_spliced(model, batch, sae.cfg.hook_name_out, keep, torch.zeros_like(y))
            for name, loss in (("ce_loss_without_sae", clean), ("ce_loss_with_sae", spliced),
                               ("ce_loss_with_ablation", ablated)):
                sums[name] += float(loss.float().sum())
            n_scored += clean.numel()
            fired += (features > 0).sum(0).float().cpu()
            active += float((features > 0).sum())
            sq_error += float((y - y_hat.float()).pow(2).sum())
            sum_y = sum_y + y.sum(0).double()
            sum_sq_y += float(y.double().pow(2).sum())
            n += y.shape[0]
            bar.advance(batch.shape[0])
    if n == 0:
        raise InputError("data has no token to evaluate (every position holds a special token)")
    metrics: dict[str, Any] = {name: total / n_scored for name, total in sums.items()}
    gap = metrics["ce_loss_with_ablation"] - metrics["ce_loss_without_sae"]
    metrics["ce_loss_score"] = (metrics["ce_loss_with_ablation"] - metrics["ce_loss_with_sae"]) / gap if gap else float("nan")
    variance = sum_sq_y - float(sum_y.pow(2).sum()) / n
    density = fired / n
    metrics.update(l0=active / n, explained_variance=1 - sq_error / variance if variance else float("nan"),
                   dead_fraction=float((density == 0).float().mean()), dense_fraction=float((density > DENSE).float().mean()),
                   n_tokens=n, n_outliers=n_outliers, feature_density=density)
    return metrics


def run_spliced(model, batch: Tensor, hook_name: str, keep_BP: Bool[Tensor, "B P"], replacement_No: Tensor,
                return_type: str = "loss") -> Tensor:
    """The model's output (``return_type``: per-token ``"loss"`` or ``"logits"``) on ``batch`` with ``hook_name``'s
    activation at the kept positions replaced by ``replacement_No`` [N kept, o] (what ``evaluate_sae`` and
    ``experiments.sae.bench`` splice in: an SAE's output, or zeros for the ablation).

    Example:
        >>> batch = torch.tensor([[1, 2, 3]]); keep = torch.ones(1, 3, dtype=torch.bool)
        >>> clean = model(batch, return_type="logits")
        >>> torch.equal(run_spliced(model, batch, "hook_embed", keep, model.embed(batch)[0], "logits"), clean)
        True
    """
    def write(activation, hook):
        activation = activation.clone()
        activation[keep_BP] = replacement_No.to(activation.dtype)
        return activation

    kwargs = {"loss_per_token": True} if return_type == "loss" else {}
    return model.run_with_hooks(batch, fwd_hooks=[(hook_name, write)], return_type=return_type, **kwargs)
