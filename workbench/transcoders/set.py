"""``TranscoderSet``: one transcoder per layer, or one cross-layer transcoder, in a single representation.

Shapes (``F`` the features per layer, ``D`` the model width, ``O_l`` the layers layer ``l``'s features write to):
``W_enc[l] [F, D]`` (circuit-tracer's orientation: a row per feature), ``b_enc[l] [F]``, ``threshold[l] [F]`` or
None (ReLU), ``W_dec[l] [F, O_l, D]`` (a per-layer transcoder writes to its own layer, ``O_l = 1``; a cross-layer
transcoder's layer ``l`` writes to layers ``l .. n_layers - 1``), ``b_dec [L, D]`` and ``W_skip[l] [D, D]`` applied
as ``x @ W_skip[l]`` (a per-layer file's ``W_skip`` is stored transposed, as circuit-tracer applies it).

The activation is circuit-tracer's: ReLU, or JumpReLU ``x * (x > threshold)`` (SAELens's
``relu(x) * (x > threshold)`` is the same rule with the threshold clamped at zero, which its loader does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from safetensors.torch import save_file
from torch import Tensor

from workbench.errors import ConfigError, InputError
from workbench.transcoders.hooks import block_hook

OUR_CONFIG, OUR_WEIGHTS = "transcoders.json", "transcoders.safetensors"
FORMAT_NAME = "workbench-transcoders"


@dataclass
class TranscoderSet:
    """Transcoders replacing every MLP of a model: read ``feature_input_hook``, write ``feature_output_hook``
    (block-relative names, circuit-tracer's spelling or ours) at each layer. Build with ``wb.load_transcoders`` or
    directly from tensors (checked: shapes, finite values).

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
        ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> tc.n_layers, tc.d_transcoder, tc.input_hook(0), tc.output_hook(0)
        (1, 2, 'blocks.0.ln2.hook_normalized', 'blocks.0.hook_mlp_out')
        >>> tc.encode(0, torch.tensor([1.0, -1.0]))
        tensor([1., 0.])
    """

    W_enc: list[Tensor]
    b_enc: list[Tensor]
    threshold: list[Optional[Tensor]]
    W_dec: list[Tensor]
    b_dec: Tensor
    feature_input_hook: str
    feature_output_hook: str
    W_skip: Optional[list[Tensor]] = None
    scan: Any = None

    def __post_init__(self) -> None:
        self._input, self._output = (block_hook(self.feature_input_hook, "feature_input_hook"),
                                     block_hook(self.feature_output_hook, "feature_output_hook"))
        self._check()

    # ---- shape ----------------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """How many layers the set covers (every layer from 0)."""
        return len(self.W_enc)

    @property
    def d_model(self) -> int:
        """The width the transcoders read and write."""
        return self.W_enc[0].shape[1]

    @property
    def d_transcoder(self) -> int:
        """Features per layer."""
        return self.W_enc[0].shape[0]

    @property
    def cross_layer(self) -> bool:
        """Whether a layer's features write to later layers too."""
        return any(dec.shape[1] > 1 for dec in self.W_dec)

    @property
    def skip_connection(self) -> bool:
        """Whether each layer adds a linear skip term ``x @ W_skip[l]`` to what it writes."""
        return self.W_skip is not None

    def input_hook(self, layer: int) -> str:
        """Our full name of the hook layer ``layer``'s transcoder reads."""
        return f"blocks.{layer}.{self._input}"

    def output_hook(self, layer: int) -> str:
        """Our full name of the hook layer ``layer``'s transcoder writes (replacing the MLP's output)."""
        return f"blocks.{layer}.{self._output}"

    def output_layers(self, layer: int) -> range:
        """The layers layer ``layer``'s features write to."""
        return range(layer, layer + self.W_dec[layer].shape[1])

    # ---- arithmetic -----------------------------------------------------------------------------------------
    def pre_activations(self, layer: int, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_transcoder"]:
        """``x @ W_enc[layer].T + b_enc[layer]``."""
        return torch.nn.functional.linear(x.to(self.b_enc[layer].dtype), self.W_enc[layer], self.b_enc[layer])

    def activate(self, layer: int, pre: Float[Tensor, "... d_transcoder"]) -> Float[Tensor, "... d_transcoder"]:
        """ReLU, or JumpReLU ``pre * (pre > threshold)``."""
        threshold = self.threshold[layer]
        return torch.relu(pre) if threshold is None else pre * (pre > threshold).to(pre.dtype)

    def encode(self, layer: int, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_transcoder"]:
        """Feature activations of layer ``layer`` on input ``x``."""
        return self.activate(layer, self.pre_activations(layer, x))

    def skip(self, layer: int, x: Float[Tensor, "... d_model"]) -> Optional[Float[Tensor, "... d_model"]]:
        """The skip term ``x @ W_skip[layer]`` (None without skip connections)."""
        return None if self.W_skip is None else x.to(self.W_skip[layer].dtype) @ self.W_skip[layer]

    def reconstruct(self, acts: Sequence[Float[Tensor, "pos d_transcoder"]], inputs_LPD: Float[Tensor, "layer pos d_model"],
                    ) -> Float[Tensor, "layer pos d_model"]:
        """What the transcoders write at every layer: each layer's features through its decoders (to later layers
        for a cross-layer transcoder), plus ``b_dec`` and the skip terms.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[2 * torch.eye(2)[:, None]], b_dec=torch.ones(1, 2), feature_input_hook="hook_resid_mid",
            ...     feature_output_hook="hook_mlp_out")
            >>> x = torch.tensor([[[3.0, -1.0]]]); tc.reconstruct([tc.encode(0, x[0])], x)
            tensor([[[7., 1.]]])
        """
        out = self.b_dec[:, None].expand(-1, inputs_LPD.shape[1], -1).clone()
        for layer, layer_acts in enumerate(acts):
            written = torch.einsum("pf,fod->opd", layer_acts.to(self.W_dec[layer].dtype), self.W_dec[layer])
            out[layer:layer + written.shape[0]] += written
            skip = self.skip(layer, inputs_LPD[layer])
            if skip is not None:
                out[layer] += skip
        return out

    def layer_sae(self, layer: int) -> Any:
        """Layer ``layer``'s transcoder as a ``wb.SAE`` (SAELens's transcoder layout: reads ``input_hook(layer)``,
        writes ``output_hook(layer)``), so SAE tools (the dashboard's feature card) read its features. A cross-layer
        transcoder's features keep only their decoder to their own layer.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[torch.ones(2)],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> sae = tc.layer_sae(0)
            >>> sae.cfg.architecture(), sae.cfg.hook_name, sae.cfg.hook_name_out
            ('jumprelu_transcoder', 'blocks.0.ln2.hook_normalized', 'blocks.0.hook_mlp_out')
        """
        from workbench.sae import SAE, SAEConfig

        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise InputError(f"layer must be in [0, {self.n_layers}), got {layer!r}")
        jump, skip = self.threshold[layer] is not None, self.W_skip is not None
        name = ("jumprelu_" if jump else "") + ("skip_" if skip else "") + "transcoder"
        cfg = SAEConfig(name, d_in=self.d_model, d_sae=self.d_transcoder, d_out=self.d_model,
                        apply_b_dec_to_input=False,
                        metadata={"hook_name": self.input_hook(layer), "hook_name_out": self.output_hook(layer)})
        tensors = {"W_enc": self.W_enc[layer].T, "b_enc": self.b_enc[layer], "W_dec": self.W_dec[layer][:, 0],
                   "b_dec": self.b_dec[layer]}
        if jump:
            tensors["threshold"] = self.threshold[layer]
        if skip:
            tensors["W_skip"] = self.W_skip[layer].T   # ours is x @ W_skip, SAELens's x @ W_skip.T
        return SAE.from_tensors(cfg, {k: v.detach().float().cpu() for k, v in tensors.items()})

    # ---- moving and saving ----------------------------------------------------------------------------------
    def to(self, device: Any = None, dtype: Any = None) -> "TranscoderSet":
        """A copy on ``device`` in ``dtype`` (each default: unchanged).

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> tc.to(dtype=torch.float64).W_enc[0].dtype
            torch.float64
        """
        def move(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.to(device=device, dtype=dtype)

        return TranscoderSet(
            W_enc=[move(t) for t in self.W_enc], b_enc=[move(t) for t in self.b_enc],
            threshold=[move(t) for t in self.threshold], W_dec=[move(t) for t in self.W_dec], b_dec=move(self.b_dec),
            W_skip=None if self.W_skip is None else [move(t) for t in self.W_skip],
            feature_input_hook=self.feature_input_hook, feature_output_hook=self.feature_output_hook, scan=self.scan)

    def save(self, path: Union[str, Path]) -> Path:
        """Writes the set into directory ``path`` (``transcoders.json`` + ``transcoders.safetensors``), which
        ``wb.load_transcoders`` reads back. Returns ``path``.

        Example:
            >>> import tempfile
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[torch.ones(2)],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     torch.equal(wb.load_transcoders(tc.save(folder)).threshold[0], tc.threshold[0])
            True
        """
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{path}: exists and is not a directory")
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"b_dec": self.b_dec}
        for layer in range(self.n_layers):
            tensors[f"W_enc.{layer}"], tensors[f"b_enc.{layer}"] = self.W_enc[layer], self.b_enc[layer]
            tensors[f"W_dec.{layer}"] = self.W_dec[layer]
            if self.threshold[layer] is not None:
                tensors[f"threshold.{layer}"] = self.threshold[layer]
            if self.W_skip is not None:
                tensors[f"W_skip.{layer}"] = self.W_skip[layer]
        save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(folder / OUR_WEIGHTS))
        config = {"format": FORMAT_NAME, "version": 1, "n_layers": self.n_layers,
                  "feature_input_hook": self.feature_input_hook, "feature_output_hook": self.feature_output_hook,
                  "scan": self.scan if isinstance(self.scan, (str, list, type(None))) else str(self.scan)}
        (folder / OUR_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        return folder

    def __repr__(self) -> str:
        kind = "cross-layer transcoder" if self.cross_layer else "per-layer transcoders"
        return (f"TranscoderSet({kind}, n_layers={self.n_layers}, d_model={self.d_model}, "
                f"d_transcoder={self.d_transcoder}, {self.feature_input_hook} -> {self.feature_output_hook}"
                f"{', skip' if self.skip_connection else ''})")

    # ---- checks ---------------------------------------------------------------------------------------------
    def _check(self) -> None:
        n = len(self.W_enc)
        if n == 0:
            raise InputError("TranscoderSet needs at least one layer")
        for name in ("b_enc", "threshold", "W_dec") + (("W_skip",) if self.W_skip is not None else ()):
            if len(getattr(self, name)) != n:
                raise InputError(f"TranscoderSet: {name} has {len(getattr(self, name))} layers, W_enc has {n}")
        f, d = self.W_enc[0].shape
        expected = {"b_dec": (self.b_dec, (n, d))}
        for layer in range(n):
            expected[f"W_enc[{layer}]"] = (self.W_enc[layer], (f, d))
            expected[f"b_enc[{layer}]"] = (self.b_enc[layer], (f,))
            n_out = self.W_dec[layer].shape[1] if self.W_dec[layer].dim() == 3 else -1
            if n_out not in (1, n - layer):
                raise InputError(f"TranscoderSet: W_dec[{layer}] has shape {tuple(self.W_dec[layer].shape)}; expected "
                                 f"[{f}, 1, {d}] (per layer) or [{f}, {n - layer}, {d}] (cross-layer)")
            expected[f"W_dec[{layer}]"] = (self.W_dec[layer], (f, n_out, d))
            if self.threshold[layer] is not None:
                expected[f"threshold[{layer}]"] = (self.threshold[layer], (f,))
            if self.W_skip is not None:
                expected[f"W_skip[{layer}]"] = (self.W_skip[layer], (d, d))
        problems = []
        for name, (tensor, shape) in expected.items():
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
                problems.append(f"{name} must be a floating-point tensor")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
            elif tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):  # meta: plans
                problems.append(f"{name} holds NaN or infinity")
        if problems:
            raise InputError(f"TranscoderSet: {'; '.join(problems)}")

    def check_model(self, model: Any) -> None:
        """Raises ``ConfigError`` unless ``model`` has exactly these layers, this width and both hooks per layer.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> tc.check_model(model)
            Traceback (most recent call last):
            workbench.errors.ConfigError: these transcoders cover 1 layers of width 2, the model has 2 layers of width 128
        """
        n_layers, d_model = model.cfg.n_layers, model.cfg.d_model
        if (n_layers, d_model) != (self.n_layers, self.d_model):
            raise ConfigError(f"these transcoders cover {self.n_layers} layers of width {self.d_model}, the model has "
                              f"{n_layers} layers of width {d_model}")
        missing = [name for layer in range(n_layers) for name in (self.input_hook(layer), self.output_hook(layer))
                   if name not in model.hook_dict]
        if missing:
            raise ConfigError(f"the model has no hook {missing[0]!r} (feature_input_hook={self.feature_input_hook!r}, "
                              f"feature_output_hook={self.feature_output_hook!r}; an MLP-less layer cannot be replaced)")
        if self._output == "hook_mlp_out" and "blocks.0.ln2_post.hook_scale" in model.hook_dict and \
                self.feature_output_hook == "mlp.hook_out":
            raise ConfigError("feature_output_hook='mlp.hook_out' is the MLP's output before its post-norm, which this "
                              "model has no hook for; transcoders of such a model write 'hook_mlp_out'")
