"""SAEBench 0.6's core measures of one SAE (``sae_bench/evals/core/main.py``), per seed and with their spread.

Legend: B batch, P position, V d_vocab, N flattened tokens, X d_sae, i d_in, o d_out.

One seed's pass (``core_pass``) follows SAEBench's code line for line:

- ``get_recons_loss`` / ``get_downstream_reconstruction_metrics``: per token, the KL divergence of the clean
  next-token distribution from the one with the SAE's output spliced in (``kl_div_with_sae``) and from the one
  with the hook zero-ablated (``kl_div_with_ablation``, every position zeroed); the per-token cross-entropies
  ``ce_loss_without_sae`` / ``ce_loss_with_sae`` / ``ce_loss_with_ablation``. Positions whose input token is
  special (BOS / EOS / pad, SAEBench's ``ignore_tokens``) are dropped before the per-token mean over every batch
  (the CE's last position has no target: its mask is ``mask[:, :-1]``). The SAE is spliced at every position
  unless ``exclude_special_tokens_from_reconstruction`` (SAEBench's default: False). ``kl_div_score`` =
  ``(kl_abl - kl_sae) / kl_abl``; ``ce_loss_score`` = ``(ce_abl - ce_sae) / (ce_abl - ce_clean)``.
- ``get_sparsity_and_variance_metrics``: at the kept positions, per token ``l0`` (features != 0), ``l1`` (their
  sum), ``l2_norm_in`` / ``l2_norm_out`` (||x||, ||x_hat||), ``l2_ratio`` (||x_hat|| / ||x||, a norm under 1e-4
  divided as 1), ``cossim``, and ``mse`` (a token's squared error divided by its batch's kept-token count, as
  SAEBench divides); per batch ``relative_reconstruction_bias`` (E||x_hat||^2 / E<x, x_hat>); all averaged over
  tokens (or batches) at the end. ``explained_variance`` is SAEBench's: ``1 - E||x - x_hat||^2 / (E||x||^2 -
  m^2)`` with ``m`` the mean over dimensions of E[x_d^2] (its ``mean_act_per_dimension``, concatenated then
  averaged), not ``evaluate_sae``'s ``1 - sum ||y - y_hat||^2 / sum ||y - mean y||^2``.
- ``calculate_misc_metrics``: ``frac_alive`` (features that fired on a kept token), ``freq_over_1_percent`` /
  ``freq_over_10_percent`` (dense features), ``normalized_freq_over_*`` (their share of all firings); the density
  (fires > 0) per feature, whose log10 histogram ``core_metrics`` keeps in ``table.attrs``.

For a transcoder the reconstruction is written at ``hook_name_out`` (SAEBench knows only SAEs, which read and write
one hook) and ``x`` in the norms is the target ``y`` there.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.sae.activations import special_token_ids
from experiments.sae.evaluate import DENSE, run_spliced
from workbench.sae import SAE

DENSE_1_PERCENT = 0.01  # SAEBench's other density threshold (freq_over_1_percent)
NORM_FLOOR = 1e-4  # SAEBench divides ||x_hat|| by 1 where ||x|| is under this
PER_TOKEN = ("kl_div_with_sae", "kl_div_with_ablation", "ce_loss_with_sae", "ce_loss_without_sae",
             "ce_loss_with_ablation", "l2_norm_in", "l2_norm_out", "l2_ratio", "l0", "l1", "mse", "cossim")
MEASURES = ("kl_div_score", "kl_div_with_sae", "kl_div_with_ablation", "ce_loss_score", "ce_loss_with_sae",
            "ce_loss_without_sae", "ce_loss_with_ablation", "explained_variance", "mse", "cossim", "l2_norm_in",
            "l2_norm_out", "l2_ratio", "relative_reconstruction_bias", "l0", "l1", "frac_alive",
            "freq_over_1_percent", "freq_over_10_percent", "normalized_freq_over_1_percent",
            "normalized_freq_over_10_percent")


def kl_per_token(clean_logits: Float[Tensor, "B P V"], new_logits: Float[Tensor, "B P V"]) -> Float[Tensor, "B P"]:
    """KL(clean || new) of the next-token distributions at each position, as SAEBench's ``kl`` (probabilities, then
    their logs).

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0]]])
        >>> new = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])  # (1/4, 3/4) against (1/2, 1/2)
        >>> kl_per_token(logits, logits), round(float(kl_per_token(logits, new)[0, 0]), 4)
        (tensor([[0.]]), 0.1438)
    """
    p = torch.softmax(clean_logits.float(), dim=-1)
    q = torch.softmax(new_logits.float(), dim=-1)
    return (p * (torch.log(p) - torch.log(q))).sum(-1)


def density_fractions(density_X: Float[Tensor, "X"]) -> dict[str, float]:
    """SAEBench's ``calculate_misc_metrics`` on a density per feature (fraction of kept tokens it fires on).

    Example:
        >>> density_fractions(torch.tensor([0.0, 0.005, 0.05, 0.5]))["frac_alive"]
        0.75
    """
    density = density_X.float()
    total = density.sum()
    fractions = {"frac_alive": float((density > 0).float().mean())}
    for name, threshold in (("1", DENSE_1_PERCENT), ("10", DENSE)):
        dense = density > threshold
        fractions[f"freq_over_{name}_percent"] = float(dense.float().mean())
        fractions[f"normalized_freq_over_{name}_percent"] = float(density[dense].sum() / total) if total > 0 else 0.0
    return fractions


@torch.no_grad()
def core_pass(model, sae: SAE, tokens: Int[Tensor, "B P"], batch_size: int = 8,
              exclude_special_tokens_from_reconstruction: bool = False,
              progress: ProgressArg = False) -> dict[str, Any]:
    """One seed's core measures on ``tokens``, ``batch_size`` rows per forward pass: a dict of floats (``MEASURES``)
    plus ``feature_density`` [X] and ``n_tokens`` (the kept tokens).

    Example (an SAE that writes nothing is the zero ablation):
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.zeros(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> result = core_pass(model, sae, torch.randint(1, 2048, (2, 16)))
        >>> result["kl_div_score"], result["ce_loss_score"], result["l0"], result["frac_alive"]
        (0.0, 0.0, 0.0, 0.0)
    """
    hook_in, hook_out = sae.cfg.hook_name, sae.cfg.hook_name_out
    special = torch.tensor(special_token_ids(model), dtype=torch.long)
    values: dict[str, list[Tensor]] = {name: [] for name in PER_TOKEN}
    per_batch: dict[str, list[Tensor]] = {"rrb": [], "sum_sq": [], "act_per_dim": [], "resid": []}
    fired_X = torch.zeros(sae.cfg.d_sae, dtype=torch.float64)
    n_kept = 0
    with Progress(progress, total=tokens.shape[0], desc="SAEBench core") as bar:
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start:start + batch_size].to(model.cfg.device)
            keep_BP = ~torch.isin(batch, special.to(batch.device))
            clean_logits, cache = model.run_with_cache(batch, names_filter=list({hook_in, hook_out}),
                                                       return_type="logits")
            x_BPi = cache[hook_in].to(sae.cfg.torch_dtype)
            y_BPo = cache[hook_out].float()
            features_BPX = sae.encode(x_BPi)
            y_hat_BPo = sae.reconstruct(x_BPi).float()  # what it writes (a skip transcoder's skip term included)
            splice_BP = keep_BP if exclude_special_tokens_from_reconstruction else torch.ones_like(keep_BP)
            runs = {"sae": run_spliced(model, batch, hook_out, splice_BP, y_hat_BPo[splice_BP], return_type="logits"),
                    "ablation": run_spliced(model, batch, hook_out, torch.ones_like(keep_BP),
                                            torch.zeros_like(y_BPo).flatten(0, 1), return_type="logits")}
            _add_downstream(values, batch, keep_BP, clean_logits, runs)
            _add_sparsity_variance(values, per_batch, y_BPo[keep_BP], y_hat_BPo[keep_BP].to(y_BPo.dtype),
                                   features_BPX[keep_BP].float())
            fired_X += (features_BPX[keep_BP] > 0).sum(0).double().cpu()
            n_kept += int(keep_BP.sum())
            bar.advance(batch.shape[0])
    from workbench.errors import InputError

    if n_kept == 0:
        raise InputError("data has no token to evaluate (every position holds a special token)")
    result: dict[str, Any] = {name: float(torch.cat(parts).double().mean()) for name, parts in values.items()}
    result["kl_div_score"] = _ratio(result["kl_div_with_ablation"] - result["kl_div_with_sae"],
                                    result["kl_div_with_ablation"])
    result["ce_loss_score"] = _ratio(result["ce_loss_with_ablation"] - result["ce_loss_with_sae"],
                                     result["ce_loss_with_ablation"] - result["ce_loss_without_sae"])
    result["relative_reconstruction_bias"] = float(torch.stack(per_batch["rrb"]).double().mean())
    total_variance = (torch.stack(per_batch["sum_sq"]).double().mean()
                      - torch.cat(per_batch["act_per_dim"]).double().mean() ** 2)
    result["explained_variance"] = float(1 - torch.stack(per_batch["resid"]).double().mean() / total_variance)
    density_X = fired_X / n_kept
    result.update(density_fractions(density_X), feature_density=density_X.float(), n_tokens=n_kept)
    return result


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator + 0.0 if denominator else float("nan")  # + 0.0: no -0.0


def _add_downstream(values: dict[str, list[Tensor]], batch: Tensor, keep_BP: Bool[Tensor, "B P"],
                    clean_logits: Tensor, runs: dict[str, tuple[Tensor, Tensor]]) -> None:
    """``get_downstream_reconstruction_metrics``'s per-token KL and CE of one batch, at the kept positions."""
    keep_ce = keep_BP[:, :-1]
    values["ce_loss_without_sae"].append(_ce_per_token(clean_logits, batch)[keep_ce].cpu())
    for name, logits in runs.items():
        values[f"kl_div_with_{name}"].append(kl_per_token(clean_logits, logits)[keep_BP].cpu())
        values[f"ce_loss_with_{name}"].append(_ce_per_token(logits, batch)[keep_ce].cpu())


def _ce_per_token(logits: Float[Tensor, "B P V"], batch: Int[Tensor, "B P"]) -> Tensor:
    """Next-token cross-entropy [B, P - 1] at each position but the last (TransformerLens's ``loss_per_token``)."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -log_probs.gather(-1, batch[:, 1:, None]).squeeze(-1)


def _add_sparsity_variance(values: dict[str, list[Tensor]], per_batch: dict[str, list[Tensor]],
                           x_Ni: Float[Tensor, "N i"], x_hat_Ni: Float[Tensor, "N i"],
                           features_NX: Float[Tensor, "N X"]) -> None:
    """``get_sparsity_and_variance_metrics``'s per-token and per-batch sums of one batch's kept tokens."""
    if x_Ni.shape[0] == 0:
        return
    norm_in, norm_out = x_Ni.norm(dim=-1), x_hat_Ni.norm(dim=-1)
    divisor = torch.where(norm_in.abs() < NORM_FLOOR, torch.ones_like(norm_in), norm_in)
    resid_N = (x_Ni - x_hat_Ni).pow(2).sum(-1)
    cossim = ((x_Ni / x_Ni.norm(dim=-1, keepdim=True)) * (x_hat_Ni / x_hat_Ni.norm(dim=-1, keepdim=True))).sum(-1)
    for name, value in (("l2_norm_in", norm_in), ("l2_norm_out", norm_out), ("l2_ratio", norm_out / divisor),
                        ("l0", (features_NX != 0).sum(-1).float()), ("l1", features_NX.sum(-1)),
                        ("mse", resid_N / x_Ni.shape[0]), ("cossim", cossim)):
        values[name].append(value.cpu())
    per_batch["rrb"].append((norm_out.pow(2).mean() / (x_Ni * x_hat_Ni).sum(-1).mean()).cpu())
    per_batch["sum_sq"].append(x_Ni.pow(2).sum(-1).mean().cpu())
    per_batch["act_per_dim"].append(x_Ni.pow(2).mean(0).cpu())
    per_batch["resid"].append(resid_N.mean().cpu())


def check_seeds(seeds: Any) -> tuple[int, ...]:
    """``seeds`` as a tuple of distinct non-negative integers, else an ``InputError``.

    Example:
        >>> check_seeds([0, 1])
        (0, 1)
    """
    from workbench.errors import InputError

    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or len(seeds) == 0:
        raise InputError(f"seeds must be a non-empty sequence of integers (e.g. (0, 1, 2)), got {seeds!r}")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seeds must hold non-negative integers, got {seed!r}")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"seeds must be distinct, got {list(seeds)}")
    return tuple(seeds)


def sample_rows(pool_BP: Int[Tensor, "B P"], n_tokens: int, seed: int) -> Int[Tensor, "B P"]:
    """The rows one seed evaluates: ``ceil(n_tokens / P)`` rows of the pool (all of them when it has fewer) in the
    seed's random order.

    Example:
        >>> sample_rows(torch.arange(12).reshape(6, 2), 4, seed=0).shape
        torch.Size([2, 2])
    """
    n_rows = min(pool_BP.shape[0], max(1, math.ceil(n_tokens / pool_BP.shape[1])))
    order = torch.randperm(pool_BP.shape[0], generator=torch.Generator().manual_seed(seed))
    return pool_BP[order[:n_rows]]
