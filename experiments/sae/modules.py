"""The SAE being trained: the generic training module of a ``wb.SAE``, around its architecture's training form.

The trained parameters are a ``wb.SAE``'s (``TrainingSAE.sae``: ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_out]``,
``b_enc``, ``b_dec``, ``W_skip [d_out, d_in]``), encoded and decoded by its arithmetic (``workbench.sae.math``);
what each architecture adds (SAELens 6's ``*TrainingSAE`` classes: its activation with its straight-through
estimator, its state such as JumpReLU's log-threshold or batch-top-k's running threshold, its sparsity and
auxiliary loss terms, what it is saved as) is its ``TrainingForm``, in that architecture's module of
``workbench.sae.architectures`` (``TRAINING_FORMS``). ``to_sae`` folds the training scales in.

Legend: N flattened tokens, i d_in, X d_sae, o d_out.

(``d_out`` is ``d_in`` for an SAE, the target hook's width for a transcoder.)

The loss is the MSE summed over the width, averaged over rows, plus the form's terms. Initialisation is SAELens's:
``W_dec`` Kaiming-uniform rows scaled to norm ``decoder_init_norm`` (0.1), ``W_enc`` its transpose (a transcoder
whose widths differ gets its own Kaiming ``W_enc``), biases zero; ``b_dec`` is then set from the data
(``b_dec_init``: the mean, or the geometric median, of the first buffer). Training runs on inputs scaled by a
constant so their mean norm is ``sqrt(d_in)`` (SAELens's ``expected_average_only_in``); ``to_sae`` folds that
scale and, for a form that rescales by the decoder norms (top-k's), those norms into the weights, so the saved SAE
reads raw activations.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import SAE, SAEConfig, math
from workbench.sae.architectures import TRAINING_FORMS, training_form

TRAINABLE = tuple(TRAINING_FORMS)
# What each trained architecture is saved as: an SAE, a transcoder, a skip transcoder (None: no such format).
SAVED_AS = {name: form.saved_as for name, form in TRAINING_FORMS.items()}
# How each trained architecture reads k (None: it has none; "integer": per row; "mean": on average over a batch).
K_KIND = {name: form.k_kind for name, form in TRAINING_FORMS.items()}


def _of_the_sae(name: str) -> property:
    """A read-only attribute that is the trained ``wb.SAE``'s parameter ``name``."""
    return property(lambda self: getattr(self.sae, name), doc=f"The SAE's ``{name}``.")


class TrainingSAE(nn.Module):
    """An SAE or (skip) transcoder under training, SAELens 6's parameters; ``to_sae`` gives the ``wb.SAE``.

    ``options`` are the architecture's coefficients (``TrainSAEConfig`` fills them): ``k``, ``l1_coefficient``,
    ``lp_norm``, ``l0_coefficient``, ``jumprelu_bandwidth``, ``jumprelu_init_threshold``, ``aux_loss_coefficient``,
    ``topk_threshold_lr``, ``decoder_init_norm``, ``matryoshka_widths``, ``use_matryoshka_aux_loss``.

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
        self.form = training_form(architecture)
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
        # the form's own tensors (JumpReLU's log-threshold, batch-top-k's running threshold)
        self.state_names = self.form.add_state(self, (), d_sae, self.options)

    # ---- the dictionary's parameters: the SAE's (W_skip [d_out, d_in], applied as x @ W_skip.T) ----------------
    W_enc, W_dec, b_enc, b_dec, W_skip = (_of_the_sae(name) for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip"))

    # ---- forward ---------------------------------------------------------------------------------------------
    @property
    def rescales(self) -> bool:
        """Whether pre-activations are scaled by the decoder norms (top-k and batch-top-k, SAELens's default)."""
        return self.form.rescales

    @property
    def form_state(self) -> dict[str, Tensor]:
        """The form's own tensors by name."""
        return {name: getattr(self, name) for name in self.state_names}

    def encode_with_hidden_pre(self, x: Float[Tensor, "N i"]) -> tuple[Float[Tensor, "N X"], Float[Tensor, "N X"]]:
        """(feature activations, pre-activations) as SAELens's ``encode_with_hidden_pre``."""
        sae_in = x if self.transcoder else x - self.b_dec  # apply_b_dec_to_input (SAEs only, as SAELens)
        return self.form.encode(self.sae, sae_in, self.form_state, self.options, rescale=self.rescales)

    def decode(self, acts: Float[Tensor, "N X"], x: Optional[Float[Tensor, "N i"]] = None) -> Float[Tensor, "N o"]:
        """``acts @ W_dec + b_dec`` (top-k: activations divided by the decoder norms first), plus the skip term
        ``x @ W_skip.T`` when ``x`` is given."""
        if self.rescales:
            acts = acts / self.W_dec.norm(dim=-1)
        out = math.decode(self.sae, acts, math.NormState())
        return out + math.skip_term(self.sae, x) if self.skip and x is not None else out

    def decode_sparse(self, indices: Tensor, values: Tensor, with_bias: bool = True) -> Float[Tensor, "N o"]:
        """``decode`` of activations given as (feature indices [N, k], values [N, k]) without the zeros: one
        ``embedding_bag`` (a dense decode costs N * F * O; this N * k * O), used by top-k in training;
        ``with_bias=False``: without ``b_dec`` (the aux-k reconstruction of the residual, which holds it already)."""
        if self.rescales:
            values = values / self.W_dec.norm(dim=-1)[indices]
        out = nn.functional.embedding_bag(indices, self.W_dec, per_sample_weights=values, mode="sum")
        return out + self.b_dec if with_bias else out

    def training_forward(self, x: Float[Tensor, "N i"], target: Float[Tensor, "N o"], dead: Tensor,
                         coefficient_scale: float = 1.0) -> dict[str, Any]:
        """Losses of one batch (``loss``, the named ``losses``), ``feature_acts`` and ``sae_out``.

        ``dead``: the dead-feature mask (aux-k loss); ``coefficient_scale``: the sparsity warm-up factor in [0, 1].
        """
        acts, hidden_pre = self.encode_with_hidden_pre(x)
        sparse = self.form.sparse_features(hidden_pre, self.options)
        out = self.decode_sparse(*sparse) if sparse is not None else self.decode(acts, x)
        losses = {"mse_loss": (out - target).pow(2).sum(-1).mean()}
        losses.update(self.form.sparsity_loss(acts, hidden_pre, self.form_state, self.W_dec.norm(dim=-1), self.options,
                                              coefficient_scale))
        # SAELens 6.54's aux-k reconstruction is W_dec z without b_dec (the residual holds b_dec already)
        aux_decode = functools.partial(self.decode_sparse, with_bias=False)
        losses.update(self.form.auxiliary_loss(hidden_pre, target - out, dead, aux_decode, self.options))
        losses.update(self.form.nested_losses(acts, hidden_pre, target, dead, self.W_dec, self.b_dec, aux_decode,
                                              self.options, self.rescales))
        self.form.after_batch(acts, self.form_state, self.options)
        return {"loss": sum(losses.values()), "losses": losses, "feature_acts": acts, "sae_out": out}

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
        tensors.update(self.form.inference_tensors(self.form_state, self.d_sae))
        # inputs were x * scale_in, targets y * scale_out: encode raw x with W_enc * scale_in (an SAE's b_dec is
        # subtracted from the scaled input, so b_dec / scale_in on raw input), decode to raw y by / scale_out.
        W_enc = W_enc * scale_in
        W_dec, b_dec = W_dec / scale_out, b_dec / scale_out
        if self.skip:
            tensors["W_skip"] = self.W_skip.detach().float() * scale_in / scale_out
        tensors.update(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec)
        name = self.form.saved_name(self.transcoder, self.skip)
        extra = self.form.inference_config(self.options)
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
