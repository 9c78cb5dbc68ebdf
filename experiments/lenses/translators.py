"""The tuned lens (Belrose et al. 2023): one affine translator per layer, read out through the model's own unembedding;
``train_tuned_lens`` and ``lens_from_checkpoint``.

Legend: L n_layers, D d_model, V d_vocab.

Layer l's translator maps the residual stream entering block l towards the final one: ``h + A_l h + b_l``
(tuned-lens 0.2's residual form, so ``A_l = 0, b_l = 0`` is the identity and weight decay pulls towards it), then
the model's final norm and unembedding give logits (``model.logits_from_resid``). Layer ``n_layers`` (the stream
after the last block) has no translator: it is the model's own prediction. The translators start at the identity,
so an untrained tuned lens is the logit lens.

Files are tuned-lens 0.2's (``experiments.lenses.tuned_lens_files``); training is ``experiments.lenses.training``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from experiments._progress import ProgressArg
from experiments.lenses.checkpoints import read_checkpoint
from experiments.lenses.config import TunedLensConfig
from experiments.lenses.training import fit_translators
from experiments.lenses.tuned_lens_files import check_state, read_lens, write_lens
from workbench.errors import InputError


class TunedLens:
    """Per-layer affine translators and the model whose unembedding reads them out.

    ``lens(hidden, layer)`` gives logits for the residual stream entering block ``layer`` (``layer == n_layers``:
    the stream after the last block, read as it is). ``TunedLens.for_model(model)`` starts at the identity (the
    logit lens); ``TunedLens.train(model, data, ...)`` fits it; ``TunedLens.load(path, model)`` reads tuned-lens
    0.2's files and ``.save(path)`` writes them.

    Example:
        >>> lens = TunedLens.for_model(model)
        >>> hidden = cache["blocks.1.hook_resid_pre"]
        >>> torch.allclose(lens(hidden, 1), model.logits_from_resid(hidden))   # untrained: the logit lens
        True
    """

    def __init__(self, config: TunedLensConfig, model=None):
        self.config = config
        translator = torch.nn.Linear(config.d_model, config.d_model, bias=config.bias)
        torch.nn.init.zeros_(translator.weight)
        if config.bias:
            torch.nn.init.zeros_(translator.bias)
        translator.requires_grad_(False)
        self.layer_translators = torch.nn.ModuleList(
            [_copy_linear(translator) for _ in range(config.num_hidden_layers)])
        self.model = None
        if model is not None:
            self.attach(model)

    @classmethod
    def for_model(cls, model, bias: bool = True) -> "TunedLens":
        """An identity-initialised lens for ``model`` (its d_model and n_layers; ``bias`` as tuned-lens's).

        Example:
            >>> len(TunedLens.for_model(model).layer_translators)
            2
        """
        cfg = model.cfg
        name = str(getattr(cfg, "model_name", "") or "")
        return cls(TunedLensConfig(name, cfg.d_model, cfg.n_layers, bias=bias), model)

    @classmethod
    def train(cls, model, data, **options) -> "TunedLens":
        """A lens fitted to ``model`` on ``data`` (token windows or texts): ``experiments.lenses.train_tuned_lens``,
        whose keyword arguments it takes (``tokens``, ``tokens_per_step``, ``lr``, ``checkpoint_dir``, ``progress``...).

        Example:
            >>> lens = TunedLens.train(model, tokens.repeat(2, 1), tokens=26, tokens_per_step=13, progress=False)
            >>> len(lens.log)
            2
        """
        return train_tuned_lens(model, data, **options)

    def attach(self, model) -> "TunedLens":
        """Reads out through ``model`` from now on (its d_model and n_layers must match); returns the lens.

        Example:
            >>> TunedLens.for_model(model).attach(model).model is model
            True
        """
        cfg = model.cfg
        if (cfg.d_model, cfg.n_layers) != (self.config.d_model, self.config.num_hidden_layers):
            raise InputError(f"this tuned lens is for d_model={self.config.d_model}, "
                             f"{self.config.num_hidden_layers} layers; the model has d_model={cfg.d_model}, "
                             f"{cfg.n_layers} layers")
        device = getattr(cfg, "device", None) or "cpu"
        self.layer_translators.to(device=device)
        self.model = model
        return self

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -self.n_layers - 1 <= layer <= self.n_layers:
            raise InputError(f"layer must be an int in [0, {self.n_layers}] (the residual stream entering that "
                             f"block; {self.n_layers} is after the last), got {layer!r}")
        return layer % (self.n_layers + 1)

    def transform_hidden(self, hidden: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... d_model"]:
        """``hidden + A_layer hidden + b_layer``: the stream moved towards the final one (unchanged at n_layers).

        Example:
            >>> lens = TunedLens.for_model(model)
            >>> torch.equal(lens.transform_hidden(torch.ones(3, 128), 0), torch.ones(3, 128))   # identity at start
            True
        """
        layer = self._check_layer(layer)
        if hidden.shape[-1] != self.config.d_model:
            raise InputError(f"hidden has width {hidden.shape[-1]}; this tuned lens reads d_model={self.config.d_model}")
        if layer == self.n_layers:
            return hidden
        translator = self.layer_translators[layer]
        return hidden + translator(hidden.to(translator.weight.dtype)).to(hidden.dtype)

    def __call__(self, hidden: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... d_vocab"]:
        """Logits of the tuned lens at ``layer``: the translated stream through the final norm and unembedding."""
        if self.model is None:
            raise InputError("this tuned lens has no model to read out through: TunedLens.load(path, model) or "
                             "lens.attach(model)")
        transformed = self.transform_hidden(hidden, layer)
        squeeze = transformed.dim() == 1
        batched = transformed.reshape(-1, 1, transformed.shape[-1]) if transformed.dim() != 3 else transformed
        logits = self.model.logits_from_resid(batched)
        return logits.reshape(*transformed.shape[:-1], logits.shape[-1]) if not squeeze else logits.reshape(-1)

    def parameters(self):
        return self.layer_translators.parameters()

    def to(self, dtype: torch.dtype) -> "TunedLens":
        """The translators in ``dtype`` (e.g. float16 to ship); returns the lens.

        Example:
            >>> TunedLens.for_model(model).to(torch.float16).layer_translators[0].weight.dtype
            torch.float16
        """
        self.layer_translators.to(dtype=dtype)
        return self

    @classmethod
    def load(cls, path: Union[str, Path], model=None) -> "TunedLens":
        """Reads tuned-lens 0.2's files in folder ``path`` (``config.json`` + ``params.pt``, or ``params.safetensors``),
        or the lens shipped under that name (``wb.shipped(kind="lens")``); with ``model`` it reads out through it.

        Example:
            >>> import tempfile
            >>> folder = TunedLens.for_model(model).save(tempfile.mkdtemp())
            >>> TunedLens.load(folder, model).config.num_hidden_layers
            2
        """
        config, state = read_lens(path)
        lens = cls(config)
        lens.load_state_dict(state)
        return lens.attach(model) if model is not None else lens

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Sets the translators from tuned-lens's ``layer_translators`` state dict ("0.weight", "0.bias", ...),
        checking every key and shape (``CheckpointError`` naming the first wrong one)."""
        check_state(state, self.config)
        dtype = next(iter(state.values())).dtype if state else torch.float32
        self.layer_translators.to(dtype=dtype if dtype.is_floating_point else torch.float32)
        with torch.no_grad():
            for name, tensor in self.layer_translators.state_dict(keep_vars=True).items():
                tensor.copy_(state[name])

    def save(self, path: Union[str, Path]) -> Path:
        """Writes tuned-lens 0.2's ``config.json`` and ``params.pt`` into folder ``path`` (atomically); returns it.

        Example:
            >>> import tempfile
            >>> sorted(p.name for p in TunedLens.for_model(model).save(tempfile.mkdtemp()).iterdir())
            ['config.json', 'params.pt']
        """
        return write_lens(path, self.config, self.layer_translators.state_dict())


def _copy_linear(linear: torch.nn.Linear) -> torch.nn.Linear:
    copy = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    copy.load_state_dict(linear.state_dict())
    return copy


def train_tuned_lens(model, data, *, lens: Optional[TunedLens] = None, **options) -> TunedLens:
    """Fits ``lens`` (default: a new identity-initialised one) to ``model`` on ``data`` (token windows [B, P] or
    texts); returns it, with ``lens.log`` (one row per step: step, tokens, lr, each layer's mean KL). The keyword
    arguments, loss, schedule, bounded memory, checkpoints and resume are ``experiments.lenses.training``'s
    (``fit_translators``): ``tokens``, ``tokens_per_step``, ``batch_windows``, ``chunk_tokens``, ``window``,
    ``optimizer`` ("adam" or "sgd"), ``lr``, ``weight_decay``, ``warmup_steps``, ``checkpoint_dir``,
    ``checkpoint_every``, ``progress``, ``seed``, ``init`` ("identity" or "least_squares"), ``init_tokens``, ``ridge``,
    ``precision`` ("float32", or "bfloat16" autocast as tuned-lens trains).

    Example:
        >>> lens = train_tuned_lens(model, tokens.repeat(4, 1), tokens=104, tokens_per_step=26, progress=False)
        >>> [row["step"] for row in lens.log], lens.log[-1]["tokens"]
        ([1, 2, 3, 4], 104)
    """
    lens = (lens or TunedLens.for_model(model)).attach(model)
    lens.log = fit_translators(model, lens, data, **options)
    return lens


def lens_from_checkpoint(model, checkpoint_dir: Union[str, Path]) -> TunedLens:
    """The lens as the checkpoint in ``checkpoint_dir`` has it (a run stopped early), with its ``log``.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = train_tuned_lens(model, tokens, tokens=26, tokens_per_step=13, checkpoint_dir=folder, progress=False)
        >>> [row["step"] for row in lens_from_checkpoint(model, folder).log]
        [1, 2]
    """
    payload = read_checkpoint(checkpoint_dir)
    lens = TunedLens(TunedLensConfig.from_dict(payload["config"]))
    lens.load_state_dict(payload["translators"])
    lens.attach(model)
    lens.log = payload["log"]
    return lens
