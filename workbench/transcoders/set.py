"""``TranscoderSet``: one transcoder per layer, or one cross-layer transcoder, as a module list of ``wb.SAE``s.

Legend: L n_layers, P position, X d_sae, D d_model.

(``X`` is ``d_transcoder``, the features per layer; ``n_out`` the layers one layer's features write to.)

``layers[l]`` is layer ``l``'s transcoder, a ``wb.SAE`` in SAELens's layout (``W_enc [D, X]``, ``W_dec [X, n_out * D]``,
``W_skip [D, D]`` applied as ``x @ W_skip.T``; see ``workbench.transcoders.layout``), so a layer encodes exactly as
an SAE does (``workbench.sae.math``, its activation from ``workbench.sae.activations``): ReLU, or SAELens's JumpReLU
``relu(x) * (x > threshold)``. A cross-layer transcoder is the same list with wider decoders (layer ``l``'s writes
layers ``l .. L - 1``). Its parameters carry no gradient.

For circuit-tracer's users the set also reads in circuit-tracer's terms: ``W_enc[l] [X, D]`` and ``W_dec[l]
[X, n_out, D]`` (views of the layers' weights, no copy), ``b_enc``, ``threshold``, ``b_dec [L, D]``, ``W_skip``; and it
is built from those tensors with ``TranscoderSet(W_enc=..., ...)`` (converted once, by ``layout``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import ConfigError, InputError
from workbench.sae import SAE, SAEConfig, math
from workbench.transcoders.format import save_transcoders
from workbench.transcoders.hooks import block_hook
from workbench.transcoders.layout import from_circuit_tracer_layout, transcoder_layers, transcoder_sae


class TranscoderSet(nn.Module):
    """Transcoders replacing every MLP of a model: read ``feature_input_hook``, write ``feature_output_hook``
    (block-relative names, circuit-tracer's spelling or ours) at each layer. Build with ``wb.load_transcoders``,
    from circuit-tracer-layout tensors (checked: shapes, finite values), or with ``layers=`` (``wb.SAE``
    transcoders, one per layer).

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
        ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> tc.n_layers, tc.d_transcoder, tc.input_hook(0), tc.output_hook(0)
        (1, 2, 'blocks.0.ln2.hook_normalized', 'blocks.0.hook_mlp_out')
        >>> tc.encode(0, torch.tensor([1.0, -1.0]))
        tensor([1., 0.])
    """

    def __init__(self, W_enc: Optional[Sequence[Tensor]] = None, b_enc: Optional[Sequence[Tensor]] = None,
                 threshold: Optional[Sequence[Optional[Tensor]]] = None, W_dec: Optional[Sequence[Tensor]] = None,
                 b_dec: Optional[Tensor] = None, feature_input_hook: str = "", feature_output_hook: str = "",
                 W_skip: Optional[Sequence[Tensor]] = None, scan: Any = None, *,
                 layers: Optional[Sequence[SAE]] = None):
        super().__init__()
        self.feature_input_hook, self.feature_output_hook, self.scan = feature_input_hook, feature_output_hook, scan
        self._input = block_hook(feature_input_hook, "feature_input_hook")
        self._output = block_hook(feature_output_hook, "feature_output_hook")
        if layers is None:
            if any(value is None for value in (W_enc, b_enc, threshold, W_dec, b_dec)):
                raise InputError("TranscoderSet needs W_enc, b_enc, threshold, W_dec and b_dec (circuit-tracer's "
                                 "layout), or layers= (wb.SAE transcoders)")
            layers = from_circuit_tracer_layout(W_enc, b_enc, threshold, W_dec, b_dec, W_skip,
                                                lambda layer: (self.input_hook(layer), self.output_hook(layer)))
        self.layers = nn.ModuleList(_checked_layers(layers))
        self.requires_grad_(False)

    @classmethod
    def from_layer_tensors(cls, per_layer: Sequence[dict[str, Tensor]], feature_input_hook: str,
                           feature_output_hook: str, scan: Any = None) -> "TranscoderSet":
        """A set from each layer's tensors in SAELens's layout (``W_enc [D, X]``, ``b_enc``, optional ``threshold``
        and ``W_skip [D, D]``, ``W_dec [X, n_out, D]``, ``b_dec [D]``), held as they are (no copy).

        Example:
            >>> tc = wb.TranscoderSet.from_layer_tensors([{"W_enc": torch.eye(2), "b_enc": torch.zeros(2),
            ...     "W_dec": torch.eye(2)[:, None], "b_dec": torch.zeros(2)}], "mlp.hook_in", "mlp.hook_out")
            >>> tc.encode(0, torch.tensor([1.0, -1.0]))
            tensor([1., 0.])
        """
        hooks = (block_hook(feature_input_hook, "feature_input_hook"), block_hook(feature_output_hook, "feature_output_hook"))
        layers = transcoder_layers(per_layer, lambda layer: tuple(f"blocks.{layer}.{name}" for name in hooks))
        return cls(feature_input_hook=feature_input_hook, feature_output_hook=feature_output_hook, scan=scan,
                   layers=layers)

    # ---- shape ----------------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """How many layers the set covers (every layer from 0)."""
        return len(self.layers)

    @property
    def d_model(self) -> int:
        """The width the transcoders read and write."""
        return self.layers[0].cfg.d_in

    @property
    def d_transcoder(self) -> int:
        """Features per layer."""
        return self.layers[0].cfg.d_sae

    @property
    def cross_layer(self) -> bool:
        """Whether a layer's features write to later layers too."""
        return any(sae.cfg.d_out > self.d_model for sae in self.layers)

    @property
    def skip_connection(self) -> bool:
        """Whether each layer adds a linear skip term ``x @ W_skip[l].T`` to what it writes."""
        return self.layers[0].spec.skip

    def input_hook(self, layer: int) -> str:
        """Our full name of the hook layer ``layer``'s transcoder reads."""
        return f"blocks.{layer}.{self._input}"

    def output_hook(self, layer: int) -> str:
        """Our full name of the hook layer ``layer``'s transcoder writes (replacing the MLP's output)."""
        return f"blocks.{layer}.{self._output}"

    def output_layers(self, layer: int) -> range:
        """The layers layer ``layer``'s features write to."""
        return range(layer, layer + self.layers[layer].cfg.d_out // self.d_model)

    # ---- circuit-tracer's view of the weights (no copies but b_dec) -------------------------------------------
    @property
    def W_enc(self) -> list[Float[Tensor, "X D"]]:
        """Each layer's encoder, a row per feature (circuit-tracer's orientation: a transposed view)."""
        return [sae.W_enc.T for sae in self.layers]

    @property
    def b_enc(self) -> list[Float[Tensor, "X"]]:
        """Each layer's encoder bias."""
        return [sae.b_enc for sae in self.layers]

    @property
    def threshold(self) -> list[Optional[Float[Tensor, "X"]]]:
        """Each layer's JumpReLU threshold (None: ReLU)."""
        return [sae.threshold if sae.spec.activation == "jumprelu" else None for sae in self.layers]

    @property
    def W_dec(self) -> list[Float[Tensor, "X n_out D"]]:
        """Each layer's decoder to every layer it writes (a view)."""
        return [sae.W_dec.unflatten(-1, (-1, self.d_model)) for sae in self.layers]

    @property
    def b_dec(self) -> Float[Tensor, "L D"]:
        """The bias of what each layer's transcoders write."""
        return torch.stack([sae.b_dec[:self.d_model] for sae in self.layers])

    @property
    def W_skip(self) -> Optional[list[Float[Tensor, "D D"]]]:
        """Each layer's skip matrix, applied as ``x @ W_skip[l].T`` (None without skip connections)."""
        return [sae.W_skip for sae in self.layers] if self.skip_connection else None

    # ---- arithmetic: each layer's SAE's -------------------------------------------------------------------------
    def pre_activations(self, layer: int, x: Float[Tensor, "... D"]) -> Float[Tensor, "... X"]:
        """``x @ W_enc + b_enc`` of layer ``layer``'s transcoder."""
        return math.pre_activations(self.layers[layer], x)

    def activate(self, layer: int, pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
        """ReLU, or JumpReLU ``relu(pre) * (pre > threshold)``."""
        return math.activate(self.layers[layer], pre)

    def encode(self, layer: int, x: Float[Tensor, "... D"]) -> Float[Tensor, "... X"]:
        """Feature activations of layer ``layer`` on input ``x`` (its SAE's encode, without hooks)."""
        return math.encode(self.layers[layer], x)[0]

    def skip(self, layer: int, x: Float[Tensor, "... D"]) -> Optional[Float[Tensor, "... D"]]:
        """The skip term ``x @ W_skip[layer].T`` (None without skip connections)."""
        return math.skip_term(self.layers[layer], x)

    def reconstruct(self, acts: Sequence[Float[Tensor, "P X"]], inputs_LPD: Float[Tensor, "L P D"],
                    ) -> Float[Tensor, "L P D"]:
        """What the transcoders write at every layer: each layer's features through its decoders (to later layers
        for a cross-layer transcoder), plus ``b_dec`` and the skip terms.

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[2 * torch.eye(2)[:, None]], b_dec=torch.ones(1, 2), feature_input_hook="hook_resid_mid",
            ...     feature_output_hook="hook_mlp_out")
            >>> x = torch.tensor([[[3.0, -1.0]]]); tc.reconstruct([tc.encode(0, x[0])], x)
            tensor([[[7., 1.]]])
        """
        decoders = self.W_dec
        out = self.b_dec[:, None].expand(-1, inputs_LPD.shape[1], -1).clone()
        for layer, layer_acts in enumerate(acts):
            written = torch.einsum("pf,fod->opd", layer_acts.to(decoders[layer].dtype), decoders[layer])
            out[layer:layer + written.shape[0]] += written
            skip = self.skip(layer, inputs_LPD[layer])
            if skip is not None:
                out[layer] += skip
        return out

    def layer_sae(self, layer: int) -> SAE:
        """Layer ``layer``'s transcoder as a standalone ``wb.SAE`` (float32, CPU, a copy; reads ``input_hook(layer)``,
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
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise InputError(f"layer must be in [0, {self.n_layers}), got {layer!r}")
        sae, d = self.layers[layer], self.d_model
        cfg = SAEConfig(sae.cfg.architecture_name, d_in=d, d_sae=self.d_transcoder, d_out=d, apply_b_dec_to_input=False,
                        metadata={"hook_name": self.input_hook(layer), "hook_name_out": self.output_hook(layer)})
        tensors = {name: param for name, param in sae.named_parameters()}
        tensors["W_dec"], tensors["b_dec"] = sae.W_dec[:, :d], sae.b_dec[:d]
        return SAE.from_tensors(cfg, {k: v.detach().float().cpu().clone() for k, v in tensors.items()})

    # ---- moving and saving ----------------------------------------------------------------------------------
    def to(self, device: Any = None, dtype: Any = None) -> "TranscoderSet":  # type: ignore[override]
        """A copy on ``device`` in ``dtype`` (each default: unchanged; a tensor already there is shared).

        Example:
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> tc.to(dtype=torch.float64).W_enc[0].dtype
            torch.float64
        """
        layers = [transcoder_sae({name: param.to(device=device, dtype=dtype) for name, param in sae.named_parameters()},
                                 sae.cfg.hook_name, sae.cfg.hook_name_out) for sae in self.layers]
        moved = TranscoderSet(feature_input_hook=self.feature_input_hook, feature_output_hook=self.feature_output_hook,
                              scan=self.scan, layers=layers)
        return moved

    def save(self, path: Union[str, Path]) -> Path:
        """Writes the set into directory ``path`` (``transcoders.json`` + ``transcoders.safetensors``), which
        ``wb.load_transcoders`` reads back; temporaries renamed into place, so a failed save leaves the previous
        set loadable. Returns ``path``.

        Example:
            >>> import tempfile
            >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[torch.ones(2)],
            ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
            ...     feature_output_hook="mlp.hook_out")
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     torch.equal(wb.load_transcoders(tc.save(folder)).threshold[0], tc.threshold[0])
            True
        """
        return save_transcoders(self, path)

    def __repr__(self) -> str:
        kind = "cross-layer transcoder" if self.cross_layer else "per-layer transcoders"
        return (f"TranscoderSet({kind}, n_layers={self.n_layers}, d_model={self.d_model}, "
                f"d_transcoder={self.d_transcoder}, {self.feature_input_hook} -> {self.feature_output_hook}"
                f"{', skip' if self.skip_connection else ''})")

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


def _checked_layers(layers: Sequence[SAE]) -> list[SAE]:
    """``layers`` after checking they make a set: ReLU / JumpReLU transcoders without input normalisation, one
    width and feature count, all with or all without a skip, layer ``l`` writing ``1`` or ``L - l`` layers."""
    layers = list(layers)
    if not layers:
        raise InputError("TranscoderSet needs at least one layer")
    for layer, sae in enumerate(layers):
        if not isinstance(sae, SAE) or not sae.spec.transcoder or sae.spec.activation not in ("relu", "jumprelu") \
                or sae.cfg.normalize_activations != "none":
            raise InputError(f"TranscoderSet: layer {layer} must be a ReLU or JumpReLU wb.SAE transcoder without input "
                             f"normalisation, got {sae!r}")
    first, n = layers[0], len(layers)
    for layer, sae in enumerate(layers):
        n_out, rest = divmod(sae.cfg.d_out, first.cfg.d_in)
        if (sae.cfg.d_in, sae.cfg.d_sae, sae.spec.skip) != (first.cfg.d_in, first.cfg.d_sae, first.spec.skip) or \
                rest or n_out not in (1, n - layer):
            raise InputError(f"TranscoderSet: layer {layer}'s transcoder {sae!r} (d_in={sae.cfg.d_in}, "
                             f"d_sae={sae.cfg.d_sae}, d_out={sae.cfg.d_out}) does not fit layer 0's "
                             f"(d_in={first.cfg.d_in}, d_sae={first.cfg.d_sae}; d_out d_in or {n - layer} x d_in)")
    return layers
