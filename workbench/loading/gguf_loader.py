"""GGUF files of the llama architecture (quantised or not) -> ``Decoder``.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp, E num_experts.

Metadata and tensors are read with the PyPI ``gguf`` package (``GGUFReader``), quantised
blocks (Q4_0/Q4_1/Q8_0/K-quants ...) dequantised with its vectorised numpy code
(``gguf.quants.dequantize``). llama.cpp's converter permutes the rows of Q and K within each
head so its RoPE can rotate adjacent pairs (x0, x1); we rotate halves (x_i, x_{i+K/2}) as
transformers does, so the permutation is undone here (transformers' ``reverse_permute``).
Tensor names (GGUF dims are reversed; the arrays below are [rows, cols] as stored):

    token_embd -> embed.W_E; output_norm -> ln_final.w; output -> unembed._W_U_lin (absent: tied)
    blk.{l}.attn_norm / ffn_norm                -> blocks.{l}.ln1.w / ln2.w
    blk.{l}.attn_q / attn_k (un-permuted)       -> blocks.{l}.attn._W_Q_lin / _W_K_lin; attn_v, attn_output -> _W_V_lin, _W_O_lin
    blk.{l}.ffn_gate / ffn_up / ffn_down        -> blocks.{l}.mlp._W_gate_lin / _W_in_lin / _W_out_lin
    blk.{l}.ffn_gate_inp, ffn_{gate,up,down}_exps -> MoE router and stacked experts
    (our names are the nn.Linear-layout storage; W_Q, W_in ... are its TransformerLens views)
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
from workbench.loading.gguf_tokenizer import tokenizer_from_gguf
from workbench.loading.placement import Placement

# general.architecture values we read, and the models they cover.
GGUF_MODELS = {"llama": "Llama-architecture GGUF files (SmolLM2, Llama, Mistral; Mixtral-style experts); "
                        "float and quantised blocks, dequantised"}
SUPPORTED_ARCHITECTURES = tuple(GGUF_MODELS)
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


def model_config_from_gguf(file: GGUFFile) -> ModelConfig:
    """Maps llama.cpp's ``llama.*`` metadata onto ``ModelConfig``.

    Example:
        >>> model_config_from_gguf(GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))).n_layers   # doctest: +SKIP
        30
    """
    arch = file.field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{file.path}: unknown architecture {arch!r} (field 'general.architecture'); "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    scaling = file.field(key("rope.scaling.type"), "none")
    if scaling not in ("none", ""):
        raise file.refuse(key("rope.scaling.type"), scaling, "only unscaled RoPE is supported")
    if "rope_freqs.weight" in file.tensors:
        raise file.refuse("rope_freqs.weight", "present", "per-frequency RoPE scaling (Llama 3.1 style) is not supported")
    d_model, n_heads = int(file.field(key("embedding_length"))), int(file.field(key("attention.head_count")))
    if n_heads <= 0:  # checked before it divides anything
        raise file.refuse(key("attention.head_count"), n_heads, "must be a positive integer")
    n_kv = file.field(key("attention.head_count_kv"), n_heads)
    if not np.isscalar(n_kv):
        raise file.refuse(key("attention.head_count_kv"), "per-layer list", "every layer must have the same KV heads")
    d_head = int(file.field(key("attention.key_length"), d_model // n_heads))
    if int(file.field(key("attention.value_length"), d_head)) != d_head:
        raise file.refuse(key("attention.value_length"), file.field(key("attention.value_length")), "must equal key_length")
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{file.path}: missing tensor 'token_embd.weight'")
    n_experts = int(file.field(key("expert_count"), 0))
    fields = dict(
        n_layers=int(file.field(key("block_count"))), d_model=d_model, n_heads=n_heads, n_key_value_heads=int(n_kv),
        d_head=d_head, d_mlp=int(file.field(key("feed_forward_length"))), d_vocab=int(embed.shape[1]),
        n_ctx=int(file.field(key("context_length"))), normalization="RMS",
        norm_eps=float(file.field(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        positional="rotary", rotary_base=float(file.field(key("rope.freq_base"), 10000.0)),
        rotary_dim=int(file.field(key("rope.dimension_count"), d_head)), act_fn="silu", gated_mlp=True,
        attn_bias="blk.0.attn_q.bias" in file.tensors, tie_embeddings="output.weight" not in file.tensors,
        num_experts=n_experts, experts_per_token=int(file.field(key("expert_used_count"), 0)) if n_experts else 0,
        model_name=str(file.field("general.name", file.path.stem)),
    )
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise ConfigError(f"{file.path}: {error}") from error


def _unpermute_rows(w_RC: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head interleave of rotary rows (rows [n_heads*K, ...])."""
    half = w_RC.shape[0] // n_heads // 2
    return w_RC.reshape(n_heads, half, 2, *w_RC.shape[1:]).swapaxes(1, 2).reshape(w_RC.shape)


class Expected(NamedTuple):
    """One tensor the model needs from a GGUF file: its GGUF name, its shape (rows, cols as stored:
    our parameter's nn.Linear layout) and the heads its rows are interleaved over (None: not rotary)."""

    gguf_name: str
    shape: tuple[int, ...]
    heads: Optional[int] = None


def expected_tensors(cfg: ModelConfig) -> dict[str, Expected]:
    """Our parameter name -> the GGUF tensor it comes from, with the shape ``cfg`` implies (no model is built).

    Example:
        >>> cfg = wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, n_key_value_heads=1, d_mlp=16, d_vocab=10,
        ...                      n_ctx=4, normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True)
        >>> expected_tensors(cfg)["blocks.0.attn._W_K_lin"]
        Expected(gguf_name='blk.0.attn_k.weight', shape=(4, 8), heads=1)
    """
    V, D, M, E = cfg.d_vocab, cfg.d_model, cfg.d_mlp, cfg.num_experts
    HK, GK = cfg.n_heads * cfg.d_head, cfg.n_key_value_heads * cfg.d_head
    names = {"embed.W_E": Expected("token_embd.weight", (V, D)), "ln_final.w": Expected("output_norm.weight", (D,))}
    if not cfg.tie_embeddings:
        names["unembed._W_U_lin"] = Expected("output.weight", (V, D))
    for layer in range(cfg.n_layers):
        blk, ours = f"blk.{layer}", f"blocks.{layer}"
        names[f"{ours}.ln1.w"] = Expected(f"{blk}.attn_norm.weight", (D,))
        names[f"{ours}.ln2.w"] = Expected(f"{blk}.ffn_norm.weight", (D,))
        for gguf_name, our_name, (rows, cols), heads in (("attn_q", "Q", (HK, D), cfg.n_heads),
                                                         ("attn_k", "K", (GK, D), cfg.n_key_value_heads),
                                                         ("attn_v", "V", (GK, D), None), ("attn_output", "O", (D, HK), None)):
            names[f"{ours}.attn._W_{our_name}_lin"] = Expected(f"{blk}.{gguf_name}.weight", (rows, cols), heads)
            if cfg.attn_bias and our_name != "O":
                names[f"{ours}.attn._b_{our_name}_lin"] = Expected(f"{blk}.{gguf_name}.bias", (rows,), heads)
        suffix, experts = ("_exps", (E,)) if cfg.is_moe else ("", ())  # MoE: every expert stacked in one tensor
        for gguf_name, our_name, shape in (("ffn_gate", "_W_gate_lin", (M, D)), ("ffn_up", "_W_in_lin", (M, D)),
                                           ("ffn_down", "_W_out_lin", (D, M))):
            names[f"{ours}.mlp.{our_name}"] = Expected(f"{blk}.{gguf_name}{suffix}.weight", experts + shape)
        if cfg.is_moe:
            names[f"{ours}.mlp._W_router_lin"] = Expected(f"{blk}.ffn_gate_inp.weight", (E, D))
    return names


def read_tensors(file: GGUFFile, cfg: ModelConfig, progress: Optional[bool] = None) -> dict[str, Tensor]:
    """Every tensor the model needs, dequantised to float32 and renamed to ours.

    Each GGUF tensor's shape is checked against the one ``cfg`` implies before it is dequantised, so a
    mis-shaped tensor is reported under its GGUF name and nothing is allocated for it.

    Example:
        >>> file = GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))                   # doctest: +SKIP
        >>> read_tensors(file, model_config_from_gguf(file))["embed.W_E"].shape       # doctest: +SKIP
        torch.Size([49152, 576])
    """
    # Before listing per-layer names for a hostile block_count.
    check_layer_count(cfg.n_layers, file.tensors, str(file.path), f"{file.field('general.architecture')}.block_count")
    expected = expected_tensors(cfg)
    wanted = {tensor.gguf_name for tensor in expected.values()}
    missing = sorted(wanted - set(file.tensors))
    if missing:
        raise CheckpointError(f"{file.path}: missing tensor(s) {missing[:5]}")
    output_biases = {f"blk.{layer}.attn_output.bias": layer for layer in range(cfg.n_layers)}
    unexpected = sorted(set(file.tensors) - wanted - set(output_biases))
    if unexpected:
        raise CheckpointError(f"{file.path}: unexpected tensor(s) {unexpected[:5]} for a {cfg.n_layers}-layer llama model")
    for tensor in expected.values():  # every shape, before any dequantising
        _check_shape(file, tensor.gguf_name, tuple(int(n) for n in reversed(file.tensors[tensor.gguf_name].shape)),
                     tensor.shape)
    show = show_progress(file.path.stat().st_size, progress)
    out = {}
    for our_name, tensor in tqdm(expected.items(), desc=f"dequantising {file.path.name}", unit="tensor",
                                 disable=not show, leave=False):
        array = _dequantised(file, tensor.gguf_name)
        _check_shape(file, tensor.gguf_name, array.shape, tensor.shape)
        if tensor.heads is not None:
            array = _unpermute_rows(array, tensor.heads)
        out[our_name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # F32 data is a read-only map
    if cfg.attn_bias:  # llama's attention output has no bias unless the file says so
        for gguf_name, layer in output_biases.items():
            if gguf_name in file.tensors:
                array = _dequantised(file, gguf_name)
                _check_shape(file, gguf_name, array.shape, (cfg.d_model,))
                out[f"blocks.{layer}.attn.b_O"] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
            else:
                out[f"blocks.{layer}.attn.b_O"] = torch.zeros(cfg.d_model)
    return out


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
              device: str = "cpu", progress: Optional[bool] = None, placement: Optional[Placement] = None):
    """Builds a ``Decoder`` (with its tokenizer) from a llama-architecture GGUF file.

    Example:
        >>> model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
        >>> model.generate("The capital of France is", max_new_tokens=3)   # doctest: +SKIP
    """
    file = GGUFFile(Path(path))
    cfg = model_config_from_gguf(file)
    runtime_options(cfg, dtype=dtype, attn_impl=attn_impl)  # a bad option fails before any tensor is read
    tokenizer = tokenizer_from_gguf(file.field, str(file.path))
    tensors = read_tensors(file, cfg, progress)
    return build_model(cfg, tokenizer, tensors, str(file.path), dtype=dtype, attn_impl=attn_impl, device=device,
                       placement=placement)
