"""The SAE being trained: SAELens 6's training definitions of each architecture, as the training form of a ``wb.SAE``.

The trained parameters are a ``wb.SAE``'s (``TrainingSAE.sae``: ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_out]``,
``b_enc``, ``b_dec``, ``W_skip [d_out, d_in]``), encoded and decoded by its arithmetic (``workbench.sae.math``) and
the shared activations (``workbench.sae.activations``); training adds only what inference does not keep (JumpReLU's
log-threshold, batch-top-k's running threshold, the losses), and ``to_sae`` folds the training scales in.

Legend: N flattened tokens, i d_in, X d_sae, o d_out.

(``d_out`` is ``d_in`` for an SAE, the target hook's width for a transcoder.)

What each architecture trains (SAELens 6's ``*TrainingSAE`` classes; the loss is MSE summed over the width,
averaged over rows, plus):

- ``standard``: ReLU; ``l1_coefficient * |f * ||W_dec||_row||_p`` (L1 scaled by the decoder norms, ``lp_norm``),
  the coefficient warmed up linearly over ``l1_warm_up_steps``.
- ``topk``: ReLU of the k largest pre-activations, with ``rescale_acts_by_decoder_norm`` (pre-activations times
  the decoder norms, divided again before decoding, so the decoder's norm cannot drift the selection); the
  aux-k loss: the top ``d_in // 2`` dead features reconstruct the residual ``x - x_hat``, scaled by
  ``min(n_dead / (d_in // 2), 1) * aux_loss_coefficient``.
- ``batchtopk``: as top-k but the ``k * N`` largest ReLU'd pre-activations of the whole batch are kept; a global
  threshold follows the smallest kept activation (``topk_threshold_lr`` EMA) and becomes the JumpReLU
  threshold of the saved SAE (SAELens saves batch-top-k as ``jumprelu``).
- ``jumprelu``: ``x * (x > exp(log_threshold))`` with SAELens's straight-through estimators (rectangle kernel of
  ``jumprelu_bandwidth``) for the threshold; ``l0_coefficient * sum_f step(x - threshold)`` (the L0 penalty,
  "step" mode), warmed up over ``l0_warm_up_steps``.

Initialisation is SAELens's: ``W_dec`` Kaiming-uniform rows scaled to norm ``decoder_init_norm`` (0.1), ``W_enc`` its
transpose (a transcoder whose widths differ gets its own Kaiming ``W_enc``), biases zero; ``b_dec`` is then set
from the data (``b_dec_init``: the mean, or the geometric median, of the first buffer). Training runs on inputs
scaled by a constant so their mean norm is ``sqrt(d_in)`` (SAELens's ``expected_average_only_in``); ``to_sae``
folds that scale and the decoder norms into the weights, so the saved SAE reads raw activations.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import SAE, SAEConfig, activations, math

TRAINABLE = ("standard", "topk", "batchtopk", "jumprelu")
# What each trained architecture is saved as: an SAE, a transcoder, a skip transcoder (None: no such format).
SAVED_AS = {"standard": ("standard", "transcoder", "skip_transcoder"),
            "topk": ("topk", None, None),
            "batchtopk": ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder"),
            "jumprelu": ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder")}


def _of_the_sae(name: str) -> property:
    """A read-only attribute that is the trained ``wb.SAE``'s parameter ``name``."""
    return property(lambda self: getattr(self.sae, name), doc=f"The SAE's ``{name}``.")


class TrainingSAE(nn.Module):
    """An SAE or (skip) transcoder under training, SAELens 6's parameters; ``to_sae`` gives the ``wb.SAE``.

    ``options`` are the architecture's coefficients (``TrainSAEConfig`` fills them): ``k``, ``l1_coefficient``,
    ``lp_norm``, ``l0_coefficient``, ``jumprelu_bandwidth``, ``jumprelu_init_threshold``, ``aux_loss_coefficient``,
    ``topk_threshold_lr``, ``decoder_init_norm``.

    Example:
        >>> sae = TrainingSAE("topk", d_in=8, d_sae=32, options={"k": 4}, generator=torch.Generator().manual_seed(0))
        >>> out = sae.training_forward(torch.randn(16, 8), torch.randn(16, 8), dead=torch.zeros(32, dtype=torch.bool))
        >>> sorted(out["losses"]), int((out["feature_acts"] > 0).sum(-1).max()) <= 4
        (['aux_loss', 'mse_loss'], True)
    """

    def __init__(self, architecture: str, d_in: int, d_sae: int, d_out: Optional[int] = None, skip: bool = False,
                 transcoder: bool = False, options: Optional[dict[str, Any]] = None,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        self.architecture, self.transcoder, self.skip = architecture, transcoder, skip
        self.d_in, self.d_sae, self.d_out = d_in, d_sae, d_out or d_in
        self.n_features = d_sae
        self.options = dict(options or {})
        init_norm = self.options.get("decoder_init_norm", 0.1)
        W_dec = _kaiming_uniform((self.d_sae, self.d_out), generator)
        if init_norm is not None:
            W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True) * init_norm
        W_enc = W_dec.T.clone() if self.d_in == self.d_out else _kaiming_uniform((self.d_in, self.d_sae), generator)
        # The dictionary itself: a ReLU wb.SAE (or transcoder) whose parameters are the ones trained; the training
        # form adds the architecture's activation (and JumpReLU's log-threshold, batch-top-k's running threshold).
        name = ("skip_transcoder" if skip else "transcoder") if transcoder else "standard"
        self.sae = SAE(SAEConfig(name, d_in=d_in, d_sae=d_sae, d_out=self.d_out, apply_b_dec_to_input=not transcoder))
        with torch.no_grad():
            self.sae.W_enc.copy_(W_enc)
            self.sae.W_dec.copy_(W_dec)
        if architecture == "jumprelu":
            init = self.options.get("jumprelu_init_threshold", 0.01)
            self.log_threshold = nn.Parameter(torch.full((d_sae,), float(torch.tensor(init).log())))
        if architecture == "batchtopk":
            # double precision, as SAELens keeps it (the EMA of small minima loses bits in float32)
            self.register_buffer("topk_threshold", torch.tensor(0.0, dtype=torch.float64))

    # ---- the dictionary's parameters: the SAE's (W_skip [d_out, d_in], applied as x @ W_skip.T) ----------------
    W_enc, W_dec, b_enc, b_dec, W_skip = (_of_the_sae(name) for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip"))

    # ---- forward ---------------------------------------------------------------------------------------------
    @property
    def rescales(self) -> bool:
        """Whether pre-activations are scaled by the decoder norms (top-k and batch-top-k, SAELens's default)."""
        return self.architecture in ("topk", "batchtopk")

    def encode_with_hidden_pre(self, x: Float[Tensor, "N i"]) -> tuple[Float[Tensor, "N X"], Float[Tensor, "N X"]]:
        """(feature activations, pre-activations) as SAELens's ``encode_with_hidden_pre``."""
        sae_in = x if self.transcoder else x - self.b_dec  # apply_b_dec_to_input (SAEs only, as SAELens)
        hidden_pre = math.pre_activations(self.sae, sae_in)
        if self.rescales:
            hidden_pre = hidden_pre * self.W_dec.norm(dim=-1)
        if self.architecture == "standard":
            acts = activations.relu(hidden_pre)
        elif self.architecture == "topk":
            acts = activations.topk(hidden_pre, self.options["k"])
        elif self.architecture == "batchtopk":
            acts = activations.batch_topk(hidden_pre, self.options["k"])
        else:
            acts = activations.jumprelu(hidden_pre, self.log_threshold.exp(), self.options.get("jumprelu_bandwidth", 0.05))
        return acts, hidden_pre

    def decode(self, acts: Float[Tensor, "N X"], x: Optional[Float[Tensor, "N i"]] = None) -> Float[Tensor, "N o"]:
        """``acts @ W_dec + b_dec`` (top-k: activations divided by the decoder norms first), plus the skip term
        ``x @ W_skip.T`` when ``x`` is given."""
        if self.rescales:
            acts = acts / self.W_dec.norm(dim=-1)
        out = math.decode(self.sae, acts, math.NormState())
        return out + math.skip_term(self.sae, x) if self.skip and x is not None else out

    def decode_sparse(self, indices: Tensor, values: Tensor) -> Float[Tensor, "N o"]:
        """``decode`` of activations given as (feature indices [N, k], values [N, k]) without the zeros: one
        ``embedding_bag`` (a dense decode costs N * F * O; this N * k * O), used by top-k in training."""
        if self.rescales:
            values = values / self.W_dec.norm(dim=-1)[indices]
        return nn.functional.embedding_bag(indices, self.W_dec, per_sample_weights=values, mode="sum") + self.b_dec

    def training_forward(self, x: Float[Tensor, "N i"], target: Float[Tensor, "N o"], dead: Tensor,
                         coefficient_scale: float = 1.0) -> dict[str, Any]:
        """Losses of one batch (``loss``, the named ``losses``), ``feature_acts`` and ``sae_out``.

        ``dead``: the dead-feature mask (aux-k loss); ``coefficient_scale``: the sparsity warm-up factor in [0, 1].
        """
        acts, hidden_pre = self.encode_with_hidden_pre(x)
        if self.architecture == "topk":  # the same numbers as decode(acts), k columns instead of d_sae
            top = hidden_pre.topk(self.options["k"], dim=-1, sorted=False)
            out = self.decode_sparse(top.indices, top.values.relu())
        else:
            out = self.decode(acts, x)
        losses = {"mse_loss": (out - target).pow(2).sum(-1).mean()}
        if self.architecture == "standard":
            weighted = acts * self.W_dec.norm(dim=-1)
            sparsity = weighted.norm(p=self.options.get("lp_norm", 1.0), dim=-1)
            losses["l1_loss"] = (coefficient_scale * self.options.get("l1_coefficient", 1.0) * sparsity).mean()
        elif self.architecture == "jumprelu":
            l0 = activations.step(hidden_pre, self.log_threshold.exp(), self.options.get("jumprelu_bandwidth", 0.05)).sum(-1)
            losses["l0_loss"] = (coefficient_scale * self.options.get("l0_coefficient", 1.0) * l0).mean()
        else:
            losses["aux_loss"] = self._aux_k_loss(hidden_pre, target - out, dead)
            if self.architecture == "batchtopk":
                self._update_threshold(acts)
        return {"loss": sum(losses.values()), "losses": losses, "feature_acts": acts, "sae_out": out}

    def _aux_k_loss(self, hidden_pre: Tensor, residual: Tensor, dead: Tensor) -> Tensor:
        """SAELens's top-k aux loss: ``decode`` of the top ``d_out // 2`` dead features (by pre-activation) fits
        the detached residual of the live reconstruction."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return hidden_pre.new_tensor(0.0)
        k_aux = min(self.d_out // 2, n_dead)
        scale = min(n_dead / (self.d_out // 2), 1.0)
        masked = torch.where(dead[None], hidden_pre, torch.tensor(-torch.inf, dtype=hidden_pre.dtype))
        top = masked.topk(k_aux, sorted=False)
        recons = self.decode_sparse(top.indices, top.values)
        return self.options.get("aux_loss_coefficient", 1.0) * scale * (recons - residual.detach()).pow(2).sum(-1).mean()

    @torch.no_grad()
    def _update_threshold(self, acts: Tensor) -> None:
        positive = acts[acts > 0]
        if positive.numel():
            lr = self.options.get("topk_threshold_lr", 0.01)
            self.topk_threshold.mul_(1 - lr).add_(lr * positive.min().double())

    # ---- inference form --------------------------------------------------------------------------------------
    @torch.no_grad()
    def to_sae(self, metadata: dict[str, Any], scale_in: float = 1.0, scale_out: float = 1.0,
               dtype: str = "float32") -> SAE:
        """The trained dictionary as a ``wb.SAE`` in SAELens's inference format, reading raw activations.

        ``scale_in`` / ``scale_out``: the constants training multiplied inputs / targets by (folded in here, as
        SAELens's ``fold_activation_norm_scaling_factor``); top-k's decoder norms are folded into ``W_enc``,
        ``b_enc`` (SAELens's ``_fold_norm_topk``); batch-top-k's threshold becomes a per-feature JumpReLU one.
        """
        W_enc, b_enc, W_dec, b_dec = (t.detach().float().clone() for t in (self.W_enc, self.b_enc, self.W_dec, self.b_dec))
        tensors: dict[str, Tensor] = {}
        if self.rescales:
            norms = W_dec.norm(dim=-1)
            W_enc, b_enc, W_dec = W_enc * norms, b_enc * norms, W_dec / norms[:, None]
        if self.architecture == "jumprelu":
            tensors["threshold"] = self.log_threshold.detach().float().exp()
        elif self.architecture == "batchtopk":
            tensors["threshold"] = torch.full((self.d_sae,), float(self.topk_threshold))
        # inputs were x * scale_in, targets y * scale_out: encode raw x with W_enc * scale_in (an SAE's b_dec is
        # subtracted from the scaled input, so b_dec / scale_in on raw input), decode to raw y by / scale_out.
        W_enc = W_enc * scale_in
        W_dec, b_dec = W_dec / scale_out, b_dec / scale_out
        if self.skip:
            tensors["W_skip"] = self.W_skip.detach().float() * scale_in / scale_out
        tensors.update(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec)
        name = SAVED_AS[self.architecture][(2 if self.skip else 1) if self.transcoder else 0]
        extra = {"k": int(self.options["k"]), "rescale_acts_by_decoder_norm": True} if name == "topk" else {}
        if self.transcoder:
            extra["d_out"] = self.d_out
        cfg = SAEConfig(name, d_in=self.d_in, d_sae=self.d_sae, dtype="float32", apply_b_dec_to_input=not self.transcoder,
                        metadata=metadata, **extra)
        sae = SAE.from_tensors(cfg, tensors)
        return sae if dtype == "float32" else SAE.from_tensors(cfg, tensors, dtype=dtype)


def _kaiming_uniform(shape: tuple[int, int], generator: Optional[torch.Generator]) -> Tensor:
    """``nn.init.kaiming_uniform_`` (a=0: bound sqrt(6 / fan_in), fan_in the second size) from ``generator``."""
    bound = (6.0 / shape[1]) ** 0.5
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
