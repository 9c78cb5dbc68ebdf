"""GGUF files (quantised or not) of every architecture in ``architectures`` -> ``Decoder``.

A GGUF file is read as the transformers checkpoint llama.cpp converted it from: its metadata becomes
that checkpoint's config.json (``hf_config``), and ``GGUFCheckpoint`` serves its tensors under
transformers' names, each turned back into transformers' layout (``layouts``: Q/K rows
un-permuted, Gemma's 1 + w gains, GPT-2's transposes, Falcon's QKV order, stacked experts). The
family module of that architecture (``hf/*.py``) then maps both onto ours exactly as it does for an
HF directory, so every family's config mapping and tensor layout is written once.

Metadata and tensors are read with the PyPI ``gguf`` package (``GGUFReader``), quantised blocks
(Q4_0/Q4_1/Q5_x/Q8_0/K-quants ...) dequantised with its vectorised numpy code
(``gguf.quants.dequantize``) to float32. Every name and shape is checked first by running the family's
conversion on meta tensors, so a missing or mis-shaped tensor is reported under its GGUF name before
anything is dequantised; the model is then built once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import gguf
import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from workbench.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.loading.build import build_model, runtime_options
from workbench.loading.common import cannot_honour, check_layer_count, show_progress
from workbench.loading.gguf.architectures import (ARCHITECTURES, POSITIVE_KEYS, REQUIRED_KEYS, GGUFArchitecture,
                                                  Metadata, heads_of, key_map, rotary_fraction)
from workbench.loading.gguf.layouts import LAYOUTS, Heads, Layout
from workbench.loading.gguf.tokenizer import tokenizer_from_gguf
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.loader import ARCHITECTURES as HF_ARCHITECTURES
from workbench.loading.placement import Placement
from workbench.loading.weights_cache import Converted, build_converted

# general.architecture values we read, and the models they cover.
GGUF_MODELS = {arch: f"{spec.models}; as transformers' {spec.hf_architecture}"
               for arch, spec in ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(GGUF_MODELS)
# Tensors whose presence means a computation we do not have, and why.
REFUSED_TENSORS = {"rope_freqs.weight": "per-frequency RoPE scaling (Llama 3.1 style) is not supported",
                   "rope_factors_long.weight": "Phi-3's longrope scaling (128k checkpoints) is not supported"}
ROPE_SCALINGS = ("none", "", "linear")
_MISSING = object()


class _PlainArrayReader(gguf.GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map.

    Why: the reader slices its ``np.memmap`` a few times per metadata string, and every memmap
    slice runs ``memmap.__array_finalize__``; with SmolLM2's 49k-token vocabulary that alone
    takes ~2 s. Slicing a plain ndarray view of the same mapping (the memmap stays alive as the
    view's base) gives identical bytes in ~0.6 s.
    """

    data = property(lambda self: self._plain, lambda self, value: setattr(self, "_plain", value.view(np.ndarray)))


class GGUFFile:
    """One opened GGUF: metadata by key and tensors by name, with errors naming the file.

    Example:
        >>> file = GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # doctest: +SKIP
        >>> file.field("llama.block_count"), len(file.tensors)         # doctest: +SKIP
        (30, 272)
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = _PlainArrayReader(str(path))
        except Exception as error:  # the reader raises ValueError, KeyError, IndexError ... on bad bytes
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from error
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = _MISSING) -> Any:
        entry = self.reader.fields.get(key)
        if entry is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.path}: required metadata field '{key}' is missing")
            return default
        return entry.contents()

    def refuse(self, key: str, value: Any, why: str) -> ConfigError:
        return cannot_honour(str(self.path), key, value, why)


class Described(NamedTuple):
    """What a file's metadata says: its table entry, the transformers architecture and config it reads as,
    and the head counts its layouts need."""

    arch: str
    spec: GGUFArchitecture
    hf_architecture: str
    hf_data: dict[str, Any]
    heads: Heads


def describe(file: GGUFFile) -> Described:
    """The file's architecture and its metadata as transformers' config.json, every value checked first.

    Example:
        >>> described = describe(GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf")))   # doctest: +SKIP
        >>> described.hf_architecture, described.hf_data["num_hidden_layers"]       # doctest: +SKIP
        ('LlamaForCausalLM', 30)
    """
    arch = file.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{file.path}: unknown architecture {arch!r} (field 'general.architecture'); "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    spec, meta = ARCHITECTURES[arch], Metadata(file.field, arch, set(file.tensors))
    for key in REQUIRED_KEYS:
        file.field(f"{arch}.{key}")  # a CheckpointError naming the missing field
    for key in POSITIVE_KEYS:
        value = meta.get(key)
        if value is not None and not np.isscalar(value):
            raise file.refuse(f"{arch}.{key}", "per-layer list", "every layer must have the same value")
        if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
            raise file.refuse(f"{arch}.{key}", value, "must be a positive integer")
    for name, why in REFUSED_TENSORS.items():
        if name in file.tensors:
            raise file.refuse(name, "present", why)
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{file.path}: missing tensor 'token_embd.weight'")
    # Before any per-layer list is built from it: a hostile block_count names its field.
    check_layer_count(int(meta.get("block_count")), file.tensors, str(file.path), f"{arch}.block_count")
    heads = Heads(*heads_of(meta))
    data = {hf: meta.get(key) for key, hf in key_map(spec).items() if meta.get(key) is not None}
    data.update(vocab_size=int(embed.shape[1]), tie_word_embeddings="output.weight" not in file.tensors)
    if spec.head_dim_field is not None:
        data[spec.head_dim_field] = heads.d_head
    fraction = rotary_fraction(meta, heads.d_head) if spec.partial_rotary else None
    if fraction is not None:
        data["partial_rotary_factor"] = fraction
    data.update(_rope_scaling(file, meta))
    data.update(spec.fixed)
    if spec.derived is not None:
        data.update(spec.derived(meta))
    hf_architecture = spec.choose(meta) if spec.choose is not None else spec.hf_architecture
    return Described(arch, spec, hf_architecture, data, heads)


def _rope_scaling(file: GGUFFile, meta: Metadata) -> dict[str, Any]:
    """``rope_scaling`` from ``rope.scaling.type``: none, or linear (its factor); any other is refused."""
    kind = meta.get("rope.scaling.type", "none")
    if kind not in ROPE_SCALINGS:
        raise file.refuse(f"{meta.arch}.rope.scaling.type", kind, f"supported RoPE scalings are {list(ROPE_SCALINGS)}")
    if kind != "linear":
        return {}
    return {"rope_scaling": {"rope_type": "linear", "factor": float(file.field(f"{meta.arch}.rope.scaling.factor"))}}


def _hf_config(file: GGUFFile, described: Described) -> HFConfig:
    return HFConfig(described.hf_data, f"{file.path} (metadata as {described.hf_architecture}'s config)")


def model_config_from_gguf(file: GGUFFile) -> ModelConfig:
    """The ``ModelConfig`` a GGUF's metadata describes, through its transformers family's own mapping.

    Example:
        >>> model_config_from_gguf(GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))).n_layers   # doctest: +SKIP
        30
    """
    described = describe(file)
    family = HF_ARCHITECTURES[described.hf_architecture]
    cfg = family.model_config(_hf_config(file, described), described.hf_architecture)
    return cfg.replace(model_name=str(file.field("general.name", file.path.stem)))


class GGUFCheckpoint:
    """A GGUF file's tensors under transformers' names and in transformers' layouts: what the family modules'
    ``convert_tensors`` read (``take``, ``has``, ``untaken`` ... as ``SafetensorsCheckpoint``).

    With ``meta=True`` nothing is dequantised: each tensor is a meta tensor of its shape, so the family's
    conversion checks every name and shape first.

    Example:
        >>> file = GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))                          # doctest: +SKIP
        >>> ckpt = GGUFCheckpoint(file, describe(file), n_layers=30, meta=True)               # doctest: +SKIP
        >>> ckpt.take("model.layers.0.self_attn.k_proj.weight", (192, 576)).device            # doctest: +SKIP
        device(type='meta')
    """

    def __init__(self, file: GGUFFile, described: Described, n_layers: int, meta: bool = False,
                 progress: Optional[bool] = None):
        self.file, self.heads, self.meta, self.hf_data = file, described.heads, meta, described.hf_data
        self.ignored = described.spec.ignored
        self.sources: dict[str, tuple[tuple[str, ...], Layout, str, bool]] = {}
        for rule in described.spec.rules:
            layers = range(n_layers) if "{l}" in rule.hf else (0,)
            for layer in layers:
                if rule.when is not None and rule.when.format(l=layer) not in file.tensors:
                    continue
                stems = rule.gguf if isinstance(rule.gguf, tuple) else (rule.gguf,)
                for suffix in rule.suffixes:
                    names = tuple(stem.format(l=layer) + suffix for stem in stems)
                    self.sources.setdefault(rule.hf.format(l=layer) + suffix,
                                            (names, LAYOUTS[rule.layout], suffix, rule.absent_zero))
        self._taken: set[str] = set()
        show = not meta and show_progress(file.path.stat().st_size, progress)
        self._bar = tqdm(total=len(file.tensors), desc=f"dequantising {file.path.name}", unit="tensor",
                         disable=not show, leave=False)

    @property
    def source(self) -> str:
        return str(self.file.path)

    def has(self, name: str) -> bool:
        entry = self.sources.get(name)
        return entry is not None and all(gguf_name in self.file.tensors for gguf_name in entry[0])

    def take(self, name: str, shape: Optional[tuple[int, ...]] = None) -> Tensor:
        """transformers' tensor ``name`` from its GGUF tensor(s); errors name the GGUF tensor."""
        entry = self.sources.get(name)
        if entry is None:
            raise CheckpointError(f"{self.source}: no GGUF tensor holds transformers' '{name}' in this architecture")
        gguf_names, layout, suffix, absent_zero = entry
        missing = [gguf_name for gguf_name in gguf_names if gguf_name not in self.file.tensors]
        if missing and absent_zero and shape is not None:
            return torch.zeros(shape, device="meta" if self.meta else "cpu")
        if missing:
            raise CheckpointError(f"{self.source}: missing tensor '{missing[0]}'")
        stored = [tuple(int(n) for n in reversed(self.file.tensors[g].shape)) for g in gguf_names]
        expected_stored = layout.stored_shapes(tuple(shape), len(gguf_names)) if shape is not None else None
        for gguf_name, have, expected in zip(gguf_names, stored, expected_stored or ()):
            _check_shape(self.file, gguf_name, have, expected)
        if self.meta:
            parts = [torch.empty(s, device="meta") for s in stored]
        else:
            parts = [_as_tensor(self.file, g, s) for g, s in zip(gguf_names, stored)]
            self._bar.update(len(parts))
        try:
            tensor = layout.to_hf(parts, self.heads, suffix)
        except RuntimeError as error:  # joined tensors that do not fit together
            raise CheckpointError(f"{self.source}: tensors {list(gguf_names)} of shapes {stored} do not join "
                                  f"into transformers' '{name}' ({error})") from error
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{self.source}: tensors {list(gguf_names)} of shapes {stored} give "
                                  f"transformers' '{name}' the shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        self._taken.update(gguf_names)
        return tensor

    def take_unembedding(self, name: str, shape: tuple[int, int], tied: bool) -> dict[str, Tensor]:
        """As ``SafetensorsCheckpoint.take_unembedding``: the output matrix, or nothing when tied (then a
        copy in the file, as GPT-2's converter writes one, is marked used)."""
        if not tied:
            return {"unembed._W_U_lin": self.take(name, shape)}
        if self.has(name):
            self._taken.update(self.sources[name][0])
        return {}

    def config_data(self) -> dict[str, Any]:
        """The metadata as the transformers config.json it stands for (``describe``)."""
        return dict(self.hf_data)

    def skip(self, name: str) -> None:
        if name in self.sources:
            self._taken.update(self.sources[name][0])

    def untaken(self) -> list[str]:
        """GGUF tensors no conversion step has read (copies the architecture says to pass over aside)."""
        return sorted(name for name in set(self.file.tensors) - self._taken if not self.ignored.fullmatch(name))

    def stored_dtype(self) -> torch.dtype:
        return torch.float32  # blocks are dequantised to float32

    def close(self) -> None:
        self._bar.close()


def _as_tensor(file: GGUFFile, gguf_name: str, stored: tuple[int, ...]) -> Tensor:
    array = _dequantised(file, gguf_name)
    _check_shape(file, gguf_name, array.shape, stored)
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # F32 data is a read-only map


def read_tensors(file: GGUFFile, cfg: ModelConfig, progress: Optional[bool] = None) -> dict[str, Tensor]:
    """Every tensor the model needs, dequantised to float32 and renamed to ours (through the family module).

    Every name and shape is checked on meta tensors first, so a mis-shaped tensor is reported under its
    GGUF name and nothing is allocated for it; a tensor nothing reads is an error naming it.

    Example:
        >>> file = GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))                   # doctest: +SKIP
        >>> read_tensors(file, model_config_from_gguf(file))["embed.W_E"].shape       # doctest: +SKIP
        torch.Size([49152, 576])
    """
    described = describe(file)
    # Before listing per-layer names for a hostile block_count.
    check_layer_count(cfg.n_layers, file.tensors, str(file.path), f"{described.arch}.block_count")
    family = HF_ARCHITECTURES[described.hf_architecture]
    dry = GGUFCheckpoint(file, described, cfg.n_layers, meta=True)
    family.convert_tensors(dry, cfg, described.hf_architecture)
    unexpected = dry.untaken()
    if unexpected:
        raise CheckpointError(f"{file.path}: unexpected tensor(s) {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''} for a {cfg.n_layers}-layer {described.arch} model")
    ckpt = GGUFCheckpoint(file, described, cfg.n_layers, progress=progress)
    try:
        tensors = family.convert_tensors(ckpt, cfg, described.hf_architecture)
    finally:
        ckpt.close()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def _dequantised(file: GGUFFile, gguf_name: str) -> np.ndarray:
    """A GGUF tensor as a float32 array [rows, cols] (quantised blocks expanded), or a ``CheckpointError``."""
    entry = file.tensors[gguf_name]
    try:
        return gguf.quants.dequantize(entry.data, entry.tensor_type)
    except (NotImplementedError, ValueError) as error:
        raise CheckpointError(f"{file.path}: cannot dequantise tensor '{gguf_name}' "
                              f"of type {entry.tensor_type.name} ({error})") from error


def _check_shape(file: GGUFFile, gguf_name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(f"{file.path}: tensor '{gguf_name}' has shape {tuple(shape)} "
                              f"(rows, cols as stored), expected {tuple(expected)}")


def load_gguf(path: Union[str, Path], attn_impl: str = "sdpa", dtype: torch.dtype = torch.float32,
              device: str = "cpu", progress: Optional[bool] = None, placement: Optional[Placement] = None,
              weights_cache: Optional[bool] = None):
    """Builds a ``Decoder`` (with its tokenizer) from a GGUF file of any architecture in ``GGUF_MODELS``.

    The converted config, tokenizer and float32 tensors are kept in the weights cache
    (``workbench.loading.weights_cache``; ``weights_cache=False``: neither read nor written), so a second load
    opens without dequantising.

    Example:
        >>> model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
        >>> model.generate("The capital of France is", max_new_tokens=3)   # doctest: +SKIP
    """
    path = Path(path)

    def check_options(cfg: ModelConfig) -> None:  # a bad option fails before any tensor is read
        runtime_options(cfg, dtype=dtype, attn_impl=attn_impl)

    def convert() -> Converted:
        file = GGUFFile(path)
        cfg = model_config_from_gguf(file)
        check_options(cfg)
        tokenizer = tokenizer_from_gguf(file.field, str(file.path))
        return Converted(cfg, tokenizer, read_tensors(file, cfg, progress))

    # Dequantised to float32 whatever ``dtype`` is (build_model casts), so the dtype is not the converter's.
    def build(converted: Converted):
        return build_model(*converted, str(path), dtype=dtype, attn_impl=attn_impl, device=device,
                           placement=placement)

    return build_converted(path, "gguf", convert, build, check=check_options, enabled=weights_cache)
