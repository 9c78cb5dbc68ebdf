"""Tiny GGUF files of every architecture we read, written from a random `transformers` model the way
llama.cpp's ``convert_hf_to_gguf.py`` writes them, for parity tests.

Independent of the loader under test: tensor names come from the `gguf` package's own tensor map
(``gguf.get_tensor_name_map``, which the converter uses), metadata keys from its ``GGUFWriter``, and
the value changes are the converter's, written here from its model classes:

- ``LlamaModel`` / ``OlmoModel``: Q and K rows permuted per head (``permute``: K over the KV heads);
- ``GemmaModel`` / ``Gemma2Model`` / ``Gemma3Model``: every ``norm.weight`` stored as 1 + w, lm_head dropped;
- ``GPT2Model``: Conv1D weights transposed, the output matrix written as a copy of the embedding;
- ``FalconModel``: the fused QKV's per-group rows reordered to all q, all k, all v;
- experts (Mixtral, Qwen-MoE): stacked per layer as ``ffn_{gate,up,down}_exps`` [E, ...];
- Gemma 2/3 files carry no ``query_pre_attn_scalar`` (llama.cpp scales by 1/sqrt(head_dim)), so the
  configs here set it to head_dim.

``quantised_reference`` gives the transformers model whose weights are what a quantised file holds
after dequantising: the quantisation round trip is applied to each weight in the layout the file
stores it (rows of blocks), which commutes with the converter's row permutations and splits and is
undone around GPT-2's transposes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration.gguf_tiny import _write_tokenizer, vocabulary
from tests.integration.hf_tiny import randomize

VOCAB = len(vocabulary("gpt2"))
Q = gguf.GGMLQuantizationType
_LLAMA_SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=2, intermediate_size=96, max_position_embeddings=64)


@dataclass(frozen=True)
class Recipe:
    """One GGUF architecture: the transformers config, llama.cpp's name for it, its extra metadata and
    the converter's changes to tensor values."""

    arch: str
    config: Callable[[], Any]
    quant: Q  # the quantised type its parity test uses
    metadata: Callable[[gguf.GGUFWriter, Any], None] = lambda writer, c: None
    permute_qk: bool = False
    norm_plus_one: bool = False
    transposed: tuple[str, ...] = ()  # Conv1D weights (name fragments)
    falcon_qkv: bool = False
    drop: tuple[str, ...] = ()  # tensors the converter skips
    output_copy_of_embedding: bool = False
    split_kv_b: bool = False  # DeepSeek since llama.cpp's MLA rewrite: kv_b_proj as per-head attn_k_b, attn_v_b
    own_head_metadata: bool = False  # the recipe writes head_count_kv and key/value lengths itself
    strip_prefix: str = ""  # a prefix the converter removes from every name first (BLOOM's "transformer.")
    std: float = 0.2  # the weights' spread (smaller where logits would reach hundreds)
    extra: dict[str, Any] = field(default_factory=dict)


def _config(model_type: str, **fields: Any):
    return lambda: AutoConfig.for_model(model_type, **fields)


def _gemma2_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    writer.add_sliding_window(c.sliding_window)
    if getattr(c, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(c.final_logit_softcapping)


def _gemma3_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    writer.add_sliding_window(c.sliding_window)
    full = c.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def _moe_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    writer.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _phi3_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    rot = c.rope_parameters.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0
    writer.add_rope_dimension_count(int(rot * c.hidden_size) // c.num_attention_heads)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)


def _deepseek_meta(mla: bool) -> Callable[[gguf.GGUFWriter, Any], None]:
    """``DeepseekV2Model.set_gguf_parameters`` (``mla``: as written since llama.cpp's MLA rewrite)."""
    def write(writer: gguf.GGUFWriter, c: Any) -> None:
        writer.add_leading_dense_block_count(c.first_k_dense_replace)
        if c.q_lora_rank is not None:
            writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_kv_lora_rank(c.kv_lora_rank)
        key, value = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        if mla:  # one latent "KV head" of width kv_lora_rank + rope; the heads' own widths in *_mla
            writer.add_head_count_kv(1)
            writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
            writer.add_value_length(c.kv_lora_rank)
            writer.add_key_length_mla(key)
            writer.add_value_length_mla(value)
        else:
            writer.add_head_count_kv(c.num_key_value_heads)
            writer.add_key_length(key)
            writer.add_value_length(value)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        if c.model_type == "deepseek_v3":
            if c.norm_topk_prob:  # written only when true
                writer.add_expert_weights_norm(c.norm_topk_prob)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            writer.add_expert_group_count(c.n_group)
            writer.add_expert_group_used_count(c.topk_group)
        writer.add_rope_dimension_count(c.qk_rope_head_dim)
    return write


_MLA = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
            intermediate_size=96, max_position_embeddings=64, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=12, moe_intermediate_size=32, num_experts_per_tok=2, first_k_dense_replace=1)
def _granite_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    writer.add_attention_scale(c.attention_multiplier)
    writer.add_embedding_scale(c.embedding_multiplier)
    writer.add_residual_scale(c.residual_multiplier)
    writer.add_logit_scale(c.logits_scaling)


def _rotary_fraction(c: Any) -> float:
    rope = getattr(c, "rope_parameters", None) or {}
    return rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or getattr(c, "rotary_pct", 1.0)


def _rotary_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    """Phi-2, Nemotron: ``int(factor * n_embd) // n_head`` rotary dimensions."""
    writer.add_rope_dimension_count(int(_rotary_fraction(c) * c.hidden_size) // c.num_attention_heads)


def _neox_meta(writer: gguf.GGUFWriter, c: Any) -> None:
    """GPT-NeoX, StableLM: ``int(factor * head_dim)`` rotary dimensions, the parallel-residual switch."""
    writer.add_rope_dimension_count(int(_rotary_fraction(c) * (c.hidden_size // c.num_attention_heads)))
    writer.add_parallel_residual(bool(c.use_parallel_residual))


_GEMMA = dict(_LLAMA_SIZES, head_dim=16)
RECIPES = {
    "llama": Recipe("llama", _config("llama", **_LLAMA_SIZES, rms_norm_eps=1e-5), Q.Q4_1, permute_qk=True,
                    metadata=lambda w, c: w.add_rope_dimension_count(16)),
    "llama_moe": Recipe("llama", _config("mixtral", **_LLAMA_SIZES, num_local_experts=4, num_experts_per_tok=2),
                        Q.Q8_0, permute_qk=True, metadata=_moe_meta),
    "qwen2": Recipe("qwen2", _config("qwen2", **_LLAMA_SIZES, tie_word_embeddings=True), Q.Q8_0),
    "qwen3": Recipe("qwen3", _config("qwen3", **{**_LLAMA_SIZES, "head_dim": 32}), Q.Q5_0),
    "qwen2moe": Recipe("qwen2moe", _config("qwen2_moe", **_LLAMA_SIZES, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=64),
                       Q.Q8_0, metadata=_moe_meta),
    "qwen3moe": Recipe("qwen3moe", _config("qwen3_moe", **_LLAMA_SIZES, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
                       Q.Q4_0, metadata=_moe_meta),
    "gemma": Recipe("gemma", _config("gemma", **_GEMMA), Q.Q4_0, norm_plus_one=True, drop=("lm_head.weight",)),
    "gemma2": Recipe("gemma2", _config("gemma2", **_GEMMA, query_pre_attn_scalar=16, sliding_window=5),
                     Q.Q5_1, norm_plus_one=True, drop=("lm_head.weight",), metadata=_gemma2_meta),
    "gemma3": Recipe("gemma3", _config("gemma3_text", **{**_GEMMA, "num_hidden_layers": 6}, query_pre_attn_scalar=16,
                                       sliding_window=5, rope_parameters={
                                           "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e4},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                     Q.Q8_0, norm_plus_one=True, drop=("lm_head.weight",), metadata=_gemma3_meta),
    "phi3": Recipe("phi3", _config("phi3", **_LLAMA_SIZES, partial_rotary_factor=0.5, sliding_window=None, pad_token_id=None),
                   Q.Q4_1, metadata=_phi3_meta),
    "gpt2": Recipe("gpt2", _config("gpt2", vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=64),
                   Q.Q8_0, transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
                   output_copy_of_embedding=True),
    "starcoder": Recipe("starcoder", _config("gpt_bigcode", vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2,
                                             n_positions=64, multi_query=True), Q.Q8_0),
    "starcoder2": Recipe("starcoder2", _config("starcoder2", **_LLAMA_SIZES, use_bias=True, sliding_window=None),
                         Q.Q5_0),
    "falcon": Recipe("falcon", _config("falcon", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                       num_kv_heads=2, num_hidden_layers=2, new_decoder_architecture=True,
                                       num_ln_in_parallel_attn=2), Q.Q8_0, falcon_qkv=True),
    "falcon_7b_style": Recipe("falcon", _config("falcon", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                num_hidden_layers=2, multi_query=True, parallel_attn=True,
                                                new_decoder_architecture=False), Q.Q4_1, falcon_qkv=True),
    "deepseek2": Recipe("deepseek2", _config("deepseek_v2", **_MLA, q_lora_rank=None, n_routed_experts=4,
                                             n_shared_experts=1, routed_scaling_factor=1.5),
                        Q.Q8_0, metadata=_deepseek_meta(mla=False), own_head_metadata=True),
    "deepseek2_v3_mla": Recipe("deepseek2", _config("deepseek_v3", **_MLA, q_lora_rank=32, n_routed_experts=8,
                                                    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5),
                               Q.Q4_1, metadata=_deepseek_meta(mla=True), own_head_metadata=True, split_kv_b=True),
    "granite": Recipe("granite", _config("granite", **_LLAMA_SIZES, embedding_multiplier=2.0, attention_multiplier=0.1,
                                         residual_multiplier=0.5, logits_scaling=4.0), Q.Q8_0, permute_qk=True,
                      metadata=_granite_meta),
    "arcee": Recipe("arcee", _config("arcee", **_LLAMA_SIZES), Q.Q8_0, permute_qk=True),
    "ernie4_5": Recipe("ernie4_5", _config("ernie4_5", **_LLAMA_SIZES, head_dim=16, use_bias=True), Q.Q4_0),
    "nemotron": Recipe("nemotron", _config("nemotron", **_LLAMA_SIZES, partial_rotary_factor=0.5, norm_eps=1e-5),
                       Q.Q8_0, norm_plus_one=True, metadata=_rotary_meta, std=0.1),
    "stablelm": Recipe("stablelm", _config("stablelm", **_LLAMA_SIZES, partial_rotary_factor=0.25, use_qkv_bias=True,
                                           use_parallel_residual=False), Q.Q5_1, metadata=_neox_meta),
    "phi2": Recipe("phi2", _config("phi", **{**_LLAMA_SIZES, "num_key_value_heads": 4}, partial_rotary_factor=0.5),
                   Q.Q8_0, metadata=_rotary_meta),
    "gptneox": Recipe("gptneox", _config("gpt_neox", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                         num_hidden_layers=2, intermediate_size=96, max_position_embeddings=64,
                                         rotary_pct=0.25, use_parallel_residual=True), Q.Q4_0,
                      falcon_qkv=True, metadata=_neox_meta),
    "bloom": Recipe("bloom", _config("bloom", vocab_size=VOCAB, hidden_size=64, n_head=4, n_layer=2), Q.Q8_0,
                    falcon_qkv=True, output_copy_of_embedding=True, strip_prefix="transformer."),
    "olmo": Recipe("olmo", _config("olmo", **_LLAMA_SIZES, clip_qkv=0.5), Q.Q8_0, permute_qk=True,
                   metadata=lambda w, c: w.add_clamp_kqv(c.clip_qkv)),
    "olmo2": Recipe("olmo2", _config("olmo2", **_LLAMA_SIZES), Q.Q4_0),
}


def build(name: str, seed: int = 1):
    """The randomised eager transformers model of recipe ``name`` (logits reach a few units)."""
    torch.manual_seed(seed)
    config = RECIPES[name].config()
    extra = {"experts_implementation": "eager"} if "moe" in name or "deepseek" in name else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **extra)
    return randomize(model, seed=seed, std=RECIPES[name].std).eval()


def _base_metadata(writer: gguf.GGUFWriter, c: Any, heads: bool = True) -> None:
    """``TextModel.set_gguf_parameters``: the sizes every converter writes (under the config's names)."""
    get = lambda *names: next((getattr(c, n) for n in names if getattr(c, n, None) is not None), None)  # noqa: E731
    writer.add_block_count(get("num_hidden_layers", "n_layer"))
    writer.add_context_length(get("max_position_embeddings", "n_positions") or 2048)
    d_model = get("hidden_size", "n_embd")
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(get("intermediate_size", "n_inner", "ffn_hidden_size") or 4 * d_model)
    n_heads = get("num_attention_heads", "n_head")
    writer.add_head_count(n_heads)
    n_kv = get("num_key_value_heads", "num_kv_heads")
    if _multi_query(c):
        n_kv = 1
    if n_kv is not None and heads:
        writer.add_head_count_kv(n_kv)
    rope = getattr(c, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    if get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(get("rms_norm_eps"))
    eps = get("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")
    if eps is not None:
        writer.add_layer_norm_eps(eps)
    if getattr(c, "head_dim", None) is not None and heads:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)


def _multi_query(c: Any) -> bool:
    """One key/value head: StarCoder's and old Falcon's ``multi_query`` (Falcon's new layout ignores it)."""
    return bool(getattr(c, "multi_query", False)) and not getattr(c, "new_decoder_architecture", False)


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _falcon_reorder(w: torch.Tensor, n_heads: int, n_kv: int, d_head: int) -> torch.Tensor:
    qkv = w.reshape(n_kv, n_heads // n_kv + 2, d_head, *w.shape[1:])
    return torch.cat([qkv[:, :-2].reshape(n_heads * d_head, *w.shape[1:]), qkv[:, -2].reshape(n_kv * d_head, *w.shape[1:]),
                      qkv[:, -1].reshape(n_kv * d_head, *w.shape[1:])])


def gguf_tensors(name: str, model) -> dict[str, tuple[torch.Tensor, bool]]:
    """{GGUF name: (tensor as the file stores it, whether it was transposed)} for recipe ``name``."""
    recipe, c = RECIPES[name], model.config
    n_layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[recipe.arch.upper()], n_layers)
    n_heads = getattr(c, "num_attention_heads", None) or c.n_head
    n_kv = 1 if _multi_query(c) else (getattr(c, "num_key_value_heads", None)
                                                       or getattr(c, "num_kv_heads", None) or n_heads)
    out = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name in recipe.drop or hf_name.endswith((".attn.bias", ".masked_bias")):
            continue
        if hf_name == "lm_head.weight" and getattr(c, "tie_word_embeddings", False):
            continue  # save_pretrained leaves a tied output matrix out, so the converter never sees it
        tensor = tensor.detach().float().clone()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # stacked experts, gate rows first
            layer = hf_name.split(".")[2]
            half = tensor.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = (tensor[:, :half], False)
            out[f"blk.{layer}.ffn_up_exps.weight"] = (tensor[:, half:], False)
            continue
        if hf_name.endswith("mlp.experts.down_proj"):
            out[f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight"] = (tensor, False)
            continue
        if hf_name.endswith("e_score_correction_bias"):  # the converter's rename, then the map's name
            out[f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"] = (tensor, False)
            continue
        if recipe.split_kv_b and hf_name.endswith("kv_b_proj.weight"):
            kv_b = tensor.view(n_heads, c.qk_nope_head_dim + c.v_head_dim, tensor.shape[-1])
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            layer = hf_name.split(".")[2]
            out[f"blk.{layer}.attn_k_b.weight"] = (k_b.transpose(1, 2).contiguous(), False)
            out[f"blk.{layer}.attn_v_b.weight"] = (v_b.contiguous(), False)
            continue
        if recipe.permute_qk and "q_proj" in hf_name:
            tensor = _llama_cpp_permute(tensor, n_heads)
        if recipe.permute_qk and "k_proj" in hf_name:
            tensor = _llama_cpp_permute(tensor, n_kv)
        if recipe.norm_plus_one and hf_name.endswith("norm.weight"):
            tensor = tensor + 1
        if recipe.falcon_qkv and "query_key_value" in hf_name:
            tensor = _falcon_reorder(tensor, n_heads, n_kv, c.hidden_size // n_heads)
        transposed = any(hf_name.endswith(part) for part in recipe.transposed)
        gguf_name = names.get_name(hf_name.removeprefix(recipe.strip_prefix), try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{name}: gguf-py maps no tensor name to {hf_name}"
        out[gguf_name] = (tensor.T.contiguous() if transposed else tensor, transposed)
        if recipe.output_copy_of_embedding and gguf_name == "token_embd.weight":
            out["output.weight"] = (tensor, False)
    return out


def _stored(array: np.ndarray, quant: Optional[Q]) -> tuple[np.ndarray, Optional[Q]]:
    """What the file holds: float32, or ``quant`` blocks for matrices whose rows split into blocks."""
    block = gguf.GGML_QUANT_SIZES[quant][0] if quant is not None else 1
    if quant is None or array.ndim < 2 or array.shape[-1] % block:
        return array, None
    return gguf.quants.quantize(array, quant), quant


def write(name: str, model, path: Path, quant: Optional[Q] = None, skip: Optional[str] = None,
          extra_tensors: Optional[dict[str, torch.Tensor]] = None, arch: Optional[str] = None,
          tokenizer: str = "gpt2") -> Path:
    """Writes ``model`` as llama.cpp would convert it (``quant``: matrices in that type, else float32);
    for error tests, ``skip`` leaves a tensor out, ``extra_tensors`` adds some, ``arch`` names another
    architecture, ``tokenizer`` the vocabulary ("gpt2" byte-level or "llama" sentencepiece: gguf_tiny's)."""
    recipe = RECIPES[name]
    writer = gguf.GGUFWriter(str(path), arch or recipe.arch)
    writer.add_name(f"tiny-{name}")
    _base_metadata(writer, model.config, heads=not recipe.own_head_metadata)
    recipe.metadata(writer, model.config)
    _write_tokenizer(writer, tokenizer)
    tensors = {**gguf_tensors(name, model), **{k: (v, False) for k, v in (extra_tensors or {}).items()}}
    for gguf_name, (tensor, _) in tensors.items():
        if gguf_name == skip:
            continue
        array, kind = _stored(tensor.numpy().astype(np.float32), quant)
        if kind is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _round_trip(tensor: torch.Tensor, quant: Q) -> torch.Tensor:
    array, kind = _stored(tensor.numpy().astype(np.float32), quant)
    return tensor if kind is None else torch.from_numpy(gguf.quants.dequantize(array, kind).copy()).reshape(tensor.shape)


@torch.no_grad()
def quantised_reference(name: str, model, quant: Q):
    """A copy of ``model`` whose weights are those a ``quant`` file holds, dequantised (see the module doc)."""
    recipe = RECIPES[name]
    reference, seen = copy.deepcopy(model), set()
    for hf_name, param in reference.state_dict(keep_vars=True).items():
        if not param.is_floating_point() or param.ndim < 2 or id(param) in seen:  # a tied matrix once
            continue
        seen.add(id(param))
        if any(hf_name.endswith(part) for part in recipe.transposed):
            param.copy_(_round_trip(param.detach().T.contiguous(), quant).T)
        else:
            param.copy_(_round_trip(param.detach().contiguous(), quant))
    return reference
