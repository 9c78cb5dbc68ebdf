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
from typing import Any, Optional, Union

import gguf
import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from workbench.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.loading.common import cannot_honour, show_progress
from workbench.loading.gguf_tokenizer import tokenizer_from_gguf
from workbench.loading.placement import Placement, build_model, empty_model

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


def _tensor_names(cfg: ModelConfig) -> dict[str, tuple[str, Optional[int]]]:
    """Our parameter name -> (GGUF tensor name, heads to un-permute by or None)."""
    names = {"embed.W_E": ("token_embd.weight", None), "ln_final.w": ("output_norm.weight", None)}
    if not cfg.tie_embeddings:
        names["unembed._W_U_lin"] = ("output.weight", None)
    for layer in range(cfg.n_layers):
        blk, ours = f"blk.{layer}", f"blocks.{layer}"
        names[f"{ours}.ln1.w"] = (f"{blk}.attn_norm.weight", None)
        names[f"{ours}.ln2.w"] = (f"{blk}.ffn_norm.weight", None)
        for gguf_name, our_name, heads in (("attn_q", "Q", cfg.n_heads), ("attn_k", "K", cfg.n_key_value_heads),
                                           ("attn_v", "V", None), ("attn_output", "O", None)):
            names[f"{ours}.attn._W_{our_name}_lin"] = (f"{blk}.{gguf_name}.weight", heads)
            if cfg.attn_bias and our_name != "O":
                names[f"{ours}.attn._b_{our_name}_lin"] = (f"{blk}.{gguf_name}.bias", heads)
        suffix, prefix = ("_exps", f"{ours}.mlp") if cfg.is_moe else ("", f"{ours}.mlp")
        for gguf_name, our_name in (("ffn_gate", "_W_gate_lin"), ("ffn_up", "_W_in_lin"), ("ffn_down", "_W_out_lin")):
            names[f"{prefix}.{our_name}"] = (f"{blk}.{gguf_name}{suffix}.weight", None)
        if cfg.is_moe:
            names[f"{prefix}._W_router_lin"] = (f"{blk}.ffn_gate_inp.weight", None)
    return names


def read_tensors(file: GGUFFile, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                 progress: Optional[bool] = None) -> dict[str, Tensor]:
    """Every tensor the model needs, dequantised to float32 and renamed to ours.

    ``shapes`` (our name -> shape) is checked against each GGUF tensor before it is used, so a
    mis-shaped tensor is reported under its GGUF name.

    Example:
        >>> file = GGUFFile(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))                   # doctest: +SKIP
        >>> cfg = model_config_from_gguf(file)                                         # doctest: +SKIP
        >>> shapes = {n: p.shape for n, p in Decoder(cfg, init_weights=False).state_dict().items()}  # doctest: +SKIP
        >>> read_tensors(file, cfg, shapes)["embed.W_E"].shape                         # doctest: +SKIP
        torch.Size([49152, 576])
    """
    names = _tensor_names(cfg)
    wanted = {gguf_name for gguf_name, _ in names.values()}
    missing = sorted(wanted - set(file.tensors))
    if missing:
        raise CheckpointError(f"{file.path}: missing tensor(s) {missing[:5]}")
    unexpected = sorted(set(file.tensors) - wanted - {f"blk.{l}.attn_output.bias" for l in range(cfg.n_layers)})
    if unexpected:
        raise CheckpointError(f"{file.path}: unexpected tensor(s) {unexpected[:5]} for a {cfg.n_layers}-layer llama model")
    show = show_progress(file.path.stat().st_size, progress)
    out = {}
    for our_name, (gguf_name, heads) in tqdm(names.items(), desc=f"dequantising {file.path.name}", unit="tensor",
                                             disable=not show, leave=False):
        entry = file.tensors[gguf_name]
        try:
            array = gguf.quants.dequantize(entry.data, entry.tensor_type)
        except (NotImplementedError, ValueError) as error:
            raise CheckpointError(f"{file.path}: cannot dequantise tensor '{gguf_name}' "
                                  f"of type {entry.tensor_type.name} ({error})") from error
        if tuple(array.shape) != tuple(shapes[our_name]):
            raise CheckpointError(f"{file.path}: tensor '{gguf_name}' has shape {tuple(array.shape)} "
                                  f"(rows, cols as stored), expected {tuple(shapes[our_name])}")
        if heads is not None:
            array = _unpermute_rows(array, heads)
        out[our_name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # F32 data is a read-only map
    if cfg.attn_bias:  # llama's attention output has no bias unless the file says so
        for layer in range(cfg.n_layers):
            bias = file.tensors.get(f"blk.{layer}.attn_output.bias")
            out[f"blocks.{layer}.attn.b_O"] = (torch.from_numpy(gguf.quants.dequantize(bias.data, bias.tensor_type).copy())
                                             if bias is not None else torch.zeros(cfg.d_model))
    return out


def load_gguf(path: Union[str, Path], attn_impl: str = "sdpa", dtype: torch.dtype = torch.float32,
              device: str = "cpu", progress: Optional[bool] = None, placement: Optional[Placement] = None):
    """Builds a ``Decoder`` (with its tokenizer) from a llama-architecture GGUF file.

    Example:
        >>> model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
        >>> model.generate("The capital of France is", max_new_tokens=3)   # doctest: +SKIP
    """
    file = GGUFFile(Path(path))
    cfg = model_config_from_gguf(file)
    tokenizer = tokenizer_from_gguf(file.field, str(file.path))
    shapes = {name: tuple(param.shape) for name, param in empty_model(cfg).state_dict(keep_vars=True).items()}
    tensors = read_tensors(file, cfg, shapes, progress)
    return build_model(cfg, tokenizer, tensors, str(file.path), device, placement, attn_impl=attn_impl, dtype=dtype)
