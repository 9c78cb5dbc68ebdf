"""``train_clt``: a cross-layer transcoder (Ameisen et al. 2025) on any model with MLPs, saved as a ``wb.TranscoderSet``.

Legend: N flattened tokens, L n_layers, D d_model, X d_sae.

(``X`` is the features per layer.)

Layer ``l``'s features read that layer's MLP input (``blocks.{l}.ln2.hook_normalized``) and write to the MLP output
of every layer from ``l`` on (``blocks.{j}.hook_mlp_out``, ``j >= l``): ``y_hat[j] = b_dec[j] + sum_{l <= j} f_l W_dec[l][:, j - l]``.
Each layer encodes as a per-layer transcoder under training does: its architecture's training form
(``workbench.sae.architectures``) on that layer's ``wb.SAE``, with the layer's slice of the form's state, and
without the decoder-norm rescaling (circuit-tracer's CLTs have none). The loss is the MSE summed over every
layer's output plus the form's sparsity term over every layer's features, as ``train_sae``'s: ``standard`` (ReLU;
L1 of each activation times the norm of its whole decoder, all layers it writes concatenated), ``jumprelu``
(SAELens's JumpReLU and L0 penalty) or ``batchtopk`` (``k`` features per layer on average over the batch; a
per-layer threshold, saved as JumpReLU; no aux-k loss). Inputs and targets are scaled per layer to
mean norm ``sqrt(D)`` while training, folded back at the end. The training loop, buffer, schedule, logging and
checkpoints are ``train_sae``'s (``experiments.sae.train``), reused through ``run_training``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor, nn

from experiments._progress import ProgressArg
from experiments.sae.modules import _kaiming_uniform
from experiments.sae.parallel import current_world
from experiments.sae.train import TrainSAEConfig, _config_overrides, run_training
from experiments.sae.inputs import check_hook, check_matryoshka_aux_loss, hook_widths, token_rows
from workbench.errors import InputError
from workbench.sae.architectures import TRAINING_FORMS, training_form
from workbench.transcoders import TranscoderSet

# The forms saved as (non-skip) transcoders.
CLT_ARCHITECTURES = tuple(name for name, form in TRAINING_FORMS.items() if form.saved_name(transcoder=True, skip=False))
INPUT_HOOK, OUTPUT_HOOK = "ln2.hook_normalized", "hook_mlp_out"


class TrainingCLT(nn.Module):
    """A cross-layer transcoder under training: the training form of a ``wb.TranscoderSet`` (``self.transcoders``,
    whose layers' ``W_enc``, ``b_enc`` and ``W_dec`` are trained), plus the written layers' biases and the
    architecture's training form (``form``: each layer's encode and the losses; its state, such as JumpReLU's
    log-threshold or batch-top-k's running thresholds, with the layers as a first axis).

    Example:
        >>> clt = TrainingCLT("standard", n_layers=2, d_model=4, d_transcoder=8, options={})
        >>> rows = torch.randn(5, 2 * 2 * 4)                   # inputs of both layers, then both targets
        >>> sorted(clt.training_forward(rows[:, :8], rows[:, 8:], torch.zeros(16, dtype=torch.bool))["losses"])
        ['l1_loss', 'mse_loss']
    """

    def __init__(self, architecture: str, n_layers: int, d_model: int, d_transcoder: int, options: dict[str, Any],
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        self.architecture, self.L, self.D, self.F, self.options = architecture, n_layers, d_model, d_transcoder, options
        self.form = training_form(architecture)
        self.n_features = n_layers * d_transcoder
        init_norm = options.get("decoder_init_norm", 0.1)
        encoders = [_kaiming_uniform((d_model, d_transcoder), generator) for _ in range(n_layers)]
        per_layer = []
        for layer in range(n_layers):
            W = _kaiming_uniform((d_transcoder, (n_layers - layer) * d_model), generator)
            if init_norm is not None:
                W = W / W.norm(dim=-1, keepdim=True) * init_norm
            per_layer.append({"W_enc": encoders[layer], "b_enc": torch.zeros(d_transcoder),
                              "W_dec": W.reshape(d_transcoder, n_layers - layer, d_model), "b_dec": torch.zeros(d_model)})
        # The dictionary itself: a ReLU TranscoderSet whose layers' encoders and decoders are the trained parameters
        # (the written layers' biases are b_dec here, folded into the set by to_transcoders).
        self.transcoders = TranscoderSet.from_layer_tensors(per_layer, INPUT_HOOK, OUTPUT_HOOK)
        for sae in self.transcoders.layers:
            for name in ("W_enc", "b_enc", "W_dec"):
                getattr(sae, name).requires_grad_(True)
        self.b_dec = nn.Parameter(torch.zeros(n_layers, d_model))
        self.state_names = self.form.add_state(self, (n_layers,), d_transcoder, options)

    @property
    def form_state(self) -> dict[str, Tensor]:
        """The form's own tensors by name, the layers first."""
        return {name: getattr(self, name) for name in self.state_names}

    def layer_state(self, layer: int) -> dict[str, Tensor]:
        """Layer ``layer``'s slice of the form's tensors (views: updating one updates the whole)."""
        return {name: getattr(self, name)[layer] for name in self.state_names}

    def decoder_norms(self) -> Float[Tensor, "L X"]:
        """Each feature's decoder norm over every layer it writes."""
        return torch.stack([sae.W_dec.norm(dim=-1) for sae in self.transcoders.layers])

    def encode(self, x: Float[Tensor, "N L D"]) -> tuple[Float[Tensor, "N L X"], Float[Tensor, "N L X"]]:
        """(feature activations, pre-activations): each layer's transcoder encoding its input by the form, as a
        per-layer transcoder under training does."""
        per_layer = [self.form.encode(sae, x[:, layer], self.layer_state(layer), self.options, rescale=False)
                     for layer, sae in enumerate(self.transcoders.layers)]
        return torch.stack([acts for acts, _ in per_layer], 1), torch.stack([pre for _, pre in per_layer], 1)

    def decode(self, acts: Float[Tensor, "N L X"]) -> Float[Tensor, "N L D"]:
        out = self.b_dec.expand(acts.shape[0], -1, -1)
        parts = [torch.einsum("nf,fjd->njd", acts[:, layer], W) for layer, W in enumerate(self.transcoders.W_dec)]
        return out + torch.stack([sum(parts[l][:, j - l] for l in range(j + 1)) for j in range(self.L)], dim=1)

    def training_forward(self, x: Tensor, target: Tensor, dead: Tensor, coefficient_scale: float = 1.0) -> dict[str, Any]:
        """``train_sae``'s interface: rows [N, L*D] in, [N, L*D] targets; ``dead`` [L*F]."""
        x, target = x.reshape(-1, self.L, self.D), target.reshape(-1, self.L, self.D)
        acts, hidden_pre = self.encode(x)
        out = self.decode(acts)
        losses = {"mse_loss": (out - target).pow(2).sum((-1, -2)).mean()}
        losses.update(self.form.sparsity_loss(acts, hidden_pre, self.form_state, self.decoder_norms(), self.options,
                                              coefficient_scale))
        for layer in range(self.L):
            self.form.after_batch(acts[:, layer], self.layer_state(layer), self.options)
        return {"loss": sum(losses.values()), "losses": losses, "feature_acts": acts.flatten(1),
                "sae_out": out.flatten(1)}

    @torch.no_grad()
    def to_transcoders(self, scale_in: Tensor, scale_out: Tensor, scan: Any = None) -> TranscoderSet:
        """The trained CLT as a ``TranscoderSet`` reading raw activations (the per-layer scales folded in);
        ``scan`` names the model (circuit-tracer's field)."""
        tc = self.transcoders
        per_layer = [{"W_enc": (tc.layers[l].W_enc * scale_in[l]).float().clone(), "b_enc": tc.b_enc[l].float().clone(),
                      "W_dec": (W / scale_out[l:, None]).float().clone(),
                      "b_dec": (self.b_dec[l] / scale_out[l]).float().clone(),
                      **self.form.inference_tensors(self.layer_state(l), self.F)} for l, W in enumerate(tc.W_dec)]
        return TranscoderSet.from_layer_tensors(per_layer, INPUT_HOOK, OUTPUT_HOOK, scan=scan)


def train_clt(model, data: Any, d_transcoder: int = 1024, architecture: str = "standard", k: Optional[float] = None,
              config: Optional[TrainSAEConfig] = None, activation_cache: Optional[Sequence[Union[str, Path]]] = None,
              out: Union[None, str, Path] = None, checkpoint_dir: Union[None, str, Path] = None,
              resume_from: Union[None, str, Path] = None, progress: ProgressArg = True, **overrides: Any) -> TranscoderSet:
    """Trains a cross-layer transcoder on ``model`` over ``data`` (token rows, texts or a path); returns it as a
    ``wb.TranscoderSet`` (saved to ``out`` in the format ``wb.load_transcoders`` reads, with
    ``training_log.csv``). ``config`` / keywords: ``TrainSAEConfig`` fields (buffer, schedule, checkpoints).

    Example:
        >>> mlp_model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=16))
        >>> tc = train_clt(mlp_model, torch.randint(1, 50, (8, 16)), d_transcoder=16, progress=False,
        ...                training_tokens=256, train_batch_size_tokens=64, buffer_tokens=128)
        >>> tc.cross_layer, tc.n_layers, tc.d_transcoder
        (True, 2, 16)
    """
    cfg = dataclasses.replace(config or TrainSAEConfig(), **_config_overrides(overrides))
    if architecture not in CLT_ARCHITECTURES:
        raise InputError(f"architecture must be one of {CLT_ARCHITECTURES} for a cross-layer transcoder, got {architecture!r}")
    check_matryoshka_aux_loss(architecture, cfg)
    if isinstance(d_transcoder, bool) or not isinstance(d_transcoder, int) or d_transcoder < 1:
        raise InputError(f"d_transcoder must be a positive integer, got {d_transcoder!r}")
    if architecture == "batchtopk" and (isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= d_transcoder):
        raise InputError(f"k must be a number of features from 1 to d_transcoder={d_transcoder} for batchtopk, got {k!r}")
    L = model.cfg.n_layers
    inputs = [f"blocks.{l}.{INPUT_HOOK}" for l in range(L)]
    targets = [f"blocks.{l}.{OUTPUT_HOOK}" for l in range(L)]
    for name in inputs + targets:
        check_hook(model, name, "model (a cross-layer transcoder needs every layer's MLP: " + name + ")")
    tokens = token_rows(model, data)
    D = hook_widths(model, inputs[:1], tokens)[0]
    options = {name: getattr(cfg, name) for name in ("l1_coefficient", "l0_coefficient", "jumprelu_bandwidth",
                                                     "jumprelu_init_threshold", "topk_threshold_lr", "decoder_init_norm")}
    options["k"] = k
    generator = torch.Generator().manual_seed(cfg.seed)
    clt = TrainingCLT(architecture, L, D, d_transcoder, options, generator)
    result = run_training(model, clt, tokens, inputs, targets, cfg, generator, activation_cache, checkpoint_dir,
                          resume_from, progress, scale_groups=L, desc="training cross-layer transcoder")
    tc = clt.to_transcoders(torch.tensor(result.scales[0]), torch.tensor(result.scales[1]),
                            scan=getattr(model.cfg, "model_name", None))
    tc.training_log = result.log
    if out is not None and current_world().writes:  # data-parallel: rank 0 writes
        tc.save(out)
        result.log.to_csv(Path(out) / "training_log.csv", index=False)
    return tc
