"""``SAE``: a sparse autoencoder (or transcoder) as a TransformerLens ``HookedRootModule``, SAELens's names.

Shapes: inputs ``[..., d_in]``, features ``[..., d_sae]``, outputs ``[..., d_out]`` (``...`` any leading
axes; ``d_out`` is ``d_in`` for an SAE and the written hook's width for a transcoder).

Weights keep SAELens's names and shapes (``W_enc [I, F]``, ``W_dec [F, O]``, ``b_enc``, ``b_dec``, ``threshold``,
``b_gate`` / ``b_mag`` / ``r_mag``, ``W_skip [O, I]``); which an SAE has is its architecture's row in
``workbench.sae.architectures``. Its hook points are SAELens's: ``hook_sae_input``, ``hook_sae_acts_pre``,
``hook_sae_acts_post``, ``hook_sae_recons`` during encode and decode, ``hook_sae_error`` (with the error term)
and ``hook_sae_output`` in ``forward``. They are ``workbench.hook_point.HookPoint``s, so when an SAE is spliced
into a model (``workbench.sae.splicing``) the splice fires hook points of its own, of these names, which the model's
one cacher and hook entry points reach; the SAE's own points fire when it is used directly.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.HookedRootModule import HookedRootModule

from workbench.errors import InputError
from workbench.hook_point import HookPoint
from workbench.sae import math
from workbench.sae.architectures import ArchitectureSpec, architecture_spec
from workbench.sae.config import SAEConfig
from workbench.sae.format import CFG_FILE, WEIGHTS_FILE, save_sae
from workbench.sae.tensors import check_tensors

# SAELens's hook points, in firing order, with the shape each receives when spliced and what it carries.
HOOK_POINTS = {
    "hook_sae_input": (("batch", "pos", "d_in"), "the activation the SAE reads (a hook_z SAE's heads flattened), "
                       "before input normalisation and b_dec"),
    "hook_sae_acts_pre": (("batch", "pos", "d_sae"), "pre-activations x W_enc + b_enc (gated: the magnitude path; "
                          "top-k with rescaling: before the decoder-norm scaling; temporal: of the novel part)"),
    "hook_sae_acts_post": (("batch", "pos", "d_sae"), "feature activations: read, ablate or steer features here"),
    "hook_sae_recons": (("batch", "pos", "d_out"), "features W_dec + b_dec, before de-normalisation and a skip term "
                        "(temporal, spliced: of the features plus the codes predicted from context)"),
    "hook_sae_error": (("batch", "pos", "d_out"), "with use_error_term only: the true activation minus the clean "
                       "reconstruction"),
    "hook_sae_output": (("batch", "pos", "d_out"), "what the SAE writes (a hook_z SAE: [batch, pos, n_heads, d_head] "
                        "again)"),
}
HOOK_NAMES = tuple(HOOK_POINTS)


def hook_points_markdown() -> list[str]:
    """docs/hooks.md's section on SAE hook points (``workbench.hook_table`` appends it).

    Example:
        >>> hook_points_markdown()[0]
        '## SAE hook points'
    """
    lines = ["## SAE hook points", "",
             "A `wb.SAE` has SAELens's hook points. While it is spliced into a model (`model.run_with_saes`,",
             "`add_sae`, `with model.saes(...)`: `workbench.sae.splicing`) the splice's own points of these names join",
             "the model's `hook_dict` as `{hook_name_out}.` plus the name below, SAELens's cache keys",
             "(`blocks.3.hook_resid_post.hook_sae_acts_post`;",
             "a transcoder's under the hook it writes); on an SAE alone they are the bare names. The hook point",
             "`{hook_name_out}` itself then carries what the SAE wrote. `d_in`, `d_sae`, `d_out` are the SAE's widths.",
             "", "| name | shape | note |", "|---|---|---|"]
    for name, (shape, note) in HOOK_POINTS.items():
        lines.append(f"| `{{hook_name_out}}.{name}` | `[{', '.join(shape)}]` | {note} |")
    return lines + [""]


class SAE(HookedRootModule):
    """A sparse autoencoder or transcoder of any architecture SAELens saves, with SAELens's weights and hooks.

    Build one with ``wb.load_sae(path)`` (a SAELens directory) or ``SAE.from_tensors(cfg, tensors)``.

    Example:
        >>> cfg = wb.SAEConfig("topk", d_in=4, d_sae=8, k=2, metadata={"hook_name": "blocks.0.hook_resid_pre"})
        >>> sae = wb.SAE.from_tensors(cfg, {"W_enc": torch.randn(4, 8), "W_dec": torch.randn(8, 4),
        ...                                 "b_enc": torch.zeros(8), "b_dec": torch.zeros(4)})
        >>> features = sae.encode(torch.randn(3, 4))
        >>> features.shape, int((features != 0).sum(-1).max()) <= 2, sae.decode(features).shape
        (torch.Size([3, 8]), True, torch.Size([3, 4]))
    """

    def __init__(self, cfg: SAEConfig, use_error_term: bool = False):
        """An SAE of ``cfg``'s architecture with zero weights (load or assign them; ``from_tensors`` does both)."""
        super().__init__()
        if not isinstance(cfg, SAEConfig):
            raise InputError(f"SAE needs an SAEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.use_error_term = use_error_term  # SAELens's flag for a standalone forward; splicing passes its own
        shapes = self.spec.weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out, cfg)
        for name, shape in shapes.items():
            if "." not in name:  # a dotted name is a submodule's parameter, registered with it below
                self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=cfg.torch_dtype,
                                                                       device=cfg.device)))
        for name, module in self.spec.encoding.submodules(cfg, cfg.device, cfg.torch_dtype).items():
            self.add_module(name, module)
        for name in HOOK_NAMES:
            setattr(self, name, HookPoint())
        self._points = math.Points.of({name: getattr(self, name) for name in HOOK_NAMES})
        # What the last encode leaves for a following decode (SAELens keeps it on the module too).
        self._pending = math.NormState()
        self.setup()

    @classmethod
    def from_pretrained(cls, release: str, sae_id: str, device: Any = None, dtype: Any = None) -> "SAE":
        """SAELens's ``SAE.from_pretrained(release, sae_id)``: the SAE ``sae_id`` of a SAELens release, fetched from
        the Hub (``wb.pretrained_saes()`` lists the releases); the same as ``wb.load_sae(release, sae_id)``.

        Example:
            >>> wb.SAE.from_pretrained("gpt2-small-res-jb", "blocks.99.hook_resid_pre")
            Traceback (most recent call last):
            workbench.errors.InputError: release 'gpt2-small-res-jb' has no SAE 'blocks.99.hook_resid_pre' (13 SAEs); did you mean ...
        """
        from workbench.sae.files import load_sae  # the reader builds SAEs of this module: imported when called

        return load_sae(release, sae_id, device=device, dtype=dtype)

    @classmethod
    def from_tensors(cls, cfg: SAEConfig, tensors: Mapping[str, Tensor], device: Any = None,
                     dtype: Any = None) -> "SAE":
        """An SAE of ``cfg`` holding ``tensors`` (SAELens's names and shapes; each checked: missing, extra,
        mis-shaped or non-finite is an ``InputError`` naming it). ``device`` / ``dtype`` default to ``cfg``'s.

        Example:
            >>> cfg = wb.SAEConfig("standard", d_in=2, d_sae=3)
            >>> wb.SAE.from_tensors(cfg, {"W_enc": torch.ones(2, 3), "W_dec": torch.ones(3, 2),
            ...                           "b_enc": torch.zeros(3), "b_dec": torch.zeros(2)}).W_dec.shape
            torch.Size([3, 2])
            >>> wb.SAE.from_tensors(cfg, {"W_enc": torch.ones(2, 3)})
            Traceback (most recent call last):
            workbench.errors.InputError: SAE tensors: missing 'W_dec', 'b_dec', 'b_enc' (a standard SAE stores W_enc, W_dec, b_dec, b_enc)
        """
        check_tensors(cfg, tensors, "SAE tensors", InputError)
        changes = {"dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {}
        if device is not None:
            changes["device"] = str(torch.device(device))
        sae = cls(dataclasses.replace(cfg, metadata=copy.deepcopy(cfg.metadata), **changes))  # its own config
        with torch.no_grad():
            for name, param in sae.named_parameters():
                param.copy_(tensors[name])
        return sae.eval()

    @property
    def spec(self) -> ArchitectureSpec:
        """The architecture's row (activation, transcoder, skip)."""
        return architecture_spec(self.cfg.architecture_name)

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.W_dec.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (inputs are cast to it, as in SAELens)."""
        return self.W_dec.dtype

    def _apply(self, fn: Any, recurse: bool = True) -> "SAE":
        # .to / .cuda / .half keep cfg.device and cfg.dtype true, as SAELens's ``to`` does (what save writes).
        super()._apply(fn, recurse)
        self.cfg.device, self.cfg.dtype = str(self.W_dec.device), str(self.W_dec.dtype).removeprefix("torch.")
        return self

    # ---- the arithmetic (workbench.sae.math), SAELens's methods ---------------------------------------------
    def encode(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_sae"]:
        """Feature activations of ``x`` (a ``hook_z`` SAE takes ``[..., heads, d_head]``), firing
        ``hook_sae_input``, ``hook_sae_acts_pre`` and ``hook_sae_acts_post``.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("jumprelu", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2), "threshold": torch.ones(2)})
            >>> sae.encode(torch.tensor([0.5, 2.0])).detach()   # under its threshold: zero
            tensor([0., 2.])
        """
        features, self._pending = math.encode(self, x, self._points)
        return features

    def encode_with_predictions(self, x: Float[Tensor, "batch pos d_in"],
                                ) -> tuple[Float[Tensor, "batch pos d_sae"], Float[Tensor, "batch pos d_sae"]]:
        """SAELens's ``TemporalSAE.encode_with_predictions``: (the sparse novel codes ``encode`` returns, the codes
        predicted from earlier positions); ``forward`` decodes their sum. Only an architecture that predicts codes
        from context has it (``temporal``); any other is an ``InputError``.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
            >>> sae.encode_with_predictions(torch.ones(1, 3, 2))
            Traceback (most recent call last):
            workbench.errors.InputError: a standard SAE predicts no codes from context (encode_with_predictions is a temporal SAE's); use encode
        """
        features, state = math.encode(self, x, self._points)
        if state.predicted is None:
            raise InputError(f"a {self.cfg.architecture_name} SAE predicts no codes from context "
                             "(encode_with_predictions is a temporal SAE's); use encode")
        self._pending = state
        return features, state.predicted

    def decode(self, feature_acts: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_out"]:
        """The reconstruction of ``feature_acts`` (firing ``hook_sae_recons``), without a skip transcoder's skip
        term (as SAELens's ``decode``). An SAE that normalises its input uses the last ``encode``'s statistics, once.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.ones(2)})
            >>> sae.decode(torch.tensor([1., 0.])).detach()
            tensor([2., 1.])
        """
        state, self._pending = self._pending, math.NormState(d_head=self._pending.d_head)
        return math.decode(self, feature_acts, state, self._points)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """``decode(encode(x))`` (a temporal SAE: of the features plus the codes predicted from context) plus a skip
        transcoder's skip term, plus the error term with
        ``use_error_term`` (an SAE only: a transcoder's error needs its output hook's activation); fires
        ``hook_sae_output``.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
            >>> sae(torch.tensor([1., -1.])).detach()
            tensor([1., 0.])
        """
        target = x if self.use_error_term and not self.spec.transcoder else None
        return self.reconstruct(x, target)

    def reconstruct(self, x: Float[Tensor, "... d_in"], target: Optional[Float[Tensor, "... d_out"]] = None,
                    ) -> Float[Tensor, "... d_out"]:
        """What the SAE writes for input ``x``: its reconstruction (with a skip term), and with ``target`` (the
        true activation where it writes) plus the error term ``target - clean reconstruction``, computed without
        hooks and gradient as SAELens does, so an edit of a feature moves the output by exactly its decoded change.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
            >>> x = torch.tensor([1., -1.]); sae.reconstruct(x, target=x).detach()   # with the error term: x itself
            tensor([ 1., -1.])
        """
        return self.reconstruct_at(self._points, x, target)

    def reconstruct_at(self, points: math.Points, x: Float[Tensor, "... d_in"],
                       target: Optional[Float[Tensor, "... d_out"]] = None) -> Float[Tensor, "... d_out"]:
        """``reconstruct`` firing ``points`` instead of the SAE's own hook points (a splice passes its own, so a
        direct use of the SAE in another thread never meets that run's hooks or cache). Keeps no state.

        Example:
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
            ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
            >>> sae.reconstruct_at(math.IDENTITY, torch.tensor([1., -1.])).detach()
            tensor([1., 0.])
        """
        features, state = math.encode(self, x, points)
        out = math.decode(self, math.full_codes(features, state), state, points)
        skip = math.skip_term(self, x)
        if skip is not None:
            out = out + skip
        if target is not None:
            target = target.to(out.dtype)
            edited = points.edits_possible()
            with torch.no_grad():
                error = points.error(target - (self._clean_output(x) if edited else out))
            if edited or getattr(points.error, "_forward_hooks", None):
                out = out + error
            else:  # nothing changed the reconstruction: the activation exactly, with gradients through the SAE
                out = target.detach() + (out - out.detach())
        return points.output(out)

    def _clean_output(self, x: Tensor) -> Tensor:
        """The output without any hook (the reference the error term is measured from)."""
        features, state = math.encode(self, x, math.IDENTITY)
        out = math.decode(self, math.full_codes(features, state), state, math.IDENTITY)
        skip = math.skip_term(self, x)
        return out if skip is None else out + skip

    def save(self, path: Union[str, Path]) -> Path:
        """Writes ``cfg.json`` and ``sae_weights.safetensors`` into directory ``path`` (made if missing), SAELens 6's
        format: ``wb.load_sae`` and SAELens's ``SAE.load_from_disk`` read it back. Returns ``path``.

        Example:
            >>> import tempfile
            >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=3), {"W_enc": torch.ones(2, 3),
            ...     "W_dec": torch.ones(3, 2), "b_enc": torch.zeros(3), "b_dec": torch.zeros(2)})
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     torch.equal(wb.load_sae(sae.save(folder)).W_enc, sae.W_enc)
            True
        """
        return save_sae(self, path)

    def save_model(self, path: Union[str, Path]) -> tuple[Path, Path]:
        """SAELens's name for ``save``: returns the weights' and the config's paths, as SAELens's does.

        Example:
            >>> import tempfile
            >>> sae = wb.load_sae("tests/fixtures/sae/standard")
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     [p.name for p in sae.save_model(folder)]
            ['sae_weights.safetensors', 'cfg.json']
        """
        folder = self.save(path)
        return folder / WEIGHTS_FILE, folder / CFG_FILE

    def __repr__(self) -> str:
        return (f"SAE({self.cfg.architecture_name}, d_in={self.cfg.d_in}, d_sae={self.cfg.d_sae}, "
                f"hook_name={self.cfg.hook_name!r})")
