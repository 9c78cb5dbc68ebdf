"""How llama.cpp's converter (``convert_hf_to_gguf.py``) changed a transformers tensor on its way into a
GGUF file, and the inverse we apply on the way out, so the HF family modules read the tensor exactly as
``save_pretrained`` wrote it.

Legend: H n_heads, G n_key_value_heads, K d_head, E num_experts, M d_mlp, D d_model, A kv_lora_rank,
J d_head_v, U d_head - rotary_dim.

Each layout is a pair of functions of ``Heads`` (the head counts, from the file's metadata): ``to_hf``
turns the GGUF tensor(s), [rows, cols] as stored (GGUF lists dims reversed), into the transformers one;
``stored_shapes`` gives, for the transformers shape a family module asks for, the shape each GGUF
tensor must have, so a mis-shaped tensor is named under its GGUF name before anything is dequantised.
Every ``to_hf`` is a few torch view operations, so it also runs on meta tensors (the shape check).

    as_is        no change (most tensors)
    unpermute_q  llama.cpp's ``LlamaModel.permute`` undone: each head's rows interleaved as rotary pairs
    unpermute_k  (x0, x1) go back to halves (x_i, x_{i+K/2}); over H query heads / G key heads
    minus_one    Gemma's and Nemotron's norm gains, stored as 1 + w (their ``norm.weight`` only)
    transposed   GPT-2's Conv1D weights, stored as nn.Linear [out, in]; back to [in, out] (biases as is)
    qkv_grouped  a fused QKV stored as q rows, k rows, v rows; back to transformers' per-group
                 [G, H/G + 2, K] (each group's query heads, its key head, its value head): Falcon's;
                 GPT-NeoX's and BLOOM's per-head [H, 3, K] are G = H. With G = 1 (Falcon-7B,
                 StarCoder's multi-query) both orders are the same.
    stacked_rows several GGUF tensors joined along the rows (dim -2): experts' gate and up [E, M, D]
                 into transformers' fused ``gate_up_proj`` [E, 2M, D], gate rows first
    kv_b_joined  DeepSeek's ``kv_b_proj`` [H*(U + J), A], which newer converters store split per head as
                 ``attn_k_b`` [H, A, U] (transposed) and ``attn_v_b`` [H, J, A]; shapes checked once joined
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor


class Heads(NamedTuple):
    """The attention shape a layout needs, read from the file's metadata."""

    n_heads: int
    n_kv_heads: int
    d_head: int


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """One way a transformers tensor is stored in a GGUF file: its inverse and the stored shapes."""

    to_hf: Callable[[list[Tensor], Heads, str], Tensor]  # (GGUF tensors, heads, ".weight"/".bias") -> HF
    # (HF shape, number of GGUF tensors) -> their shapes; None: checked on the joined tensor instead
    stored_shapes: Callable[[Shape, int], Optional[list[Shape]]]


def unpermute_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undoes llama.cpp's per-head interleave of rotary rows (rows [n_heads*K, ...]; a bias [n_heads*K]).

    Example:
        >>> unpermute_rows(torch.tensor([0., 2., 1., 3.]), 1).tolist()   # one head, K=4: pairs back to halves
        [0.0, 1.0, 2.0, 3.0]
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def grouped_from_concatenated(w: Tensor, heads: Heads) -> Tensor:
    """Fused QKV rows [q (H*K); k (G*K); v (G*K)] as transformers' [G, H/G + 2, K] groups.

    Example:
        >>> grouped_from_concatenated(torch.arange(6.), Heads(2, 2, 1)).tolist()   # q0 q1 | k0 k1 | v0 v1
        [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    H, G, K = heads
    rest = w.shape[1:]
    q, k, v = w.split([H * K, G * K, G * K])
    groups = torch.cat([q.reshape(G, H // G, K, *rest), k.reshape(G, 1, K, *rest), v.reshape(G, 1, K, *rest)], 1)
    return groups.reshape(w.shape)


def kv_b_joined(k_b_HAU: Tensor, v_b_HJA: Tensor) -> Tensor:
    """DeepSeek's ``kv_b_proj`` rows [H*(U + J), A] (each head's key rows, then its value rows) from
    llama.cpp's split ``attn_k_b`` [H, A, U] and ``attn_v_b`` [H, J, A].

    Example:
        >>> kv_b_joined(torch.zeros(2, 3, 4), torch.ones(2, 5, 3)).shape
        torch.Size([18, 3])
    """
    joined_HRA = torch.cat([k_b_HAU.transpose(1, 2), v_b_HJA], dim=1)
    return joined_HRA.reshape(-1, joined_HRA.shape[-1])


def _same(shape: Shape, count: int) -> list[Shape]:
    return [tuple(shape)]


def _split_rows(shape: Shape, count: int) -> list[Shape]:
    return [(*shape[:-2], shape[-2] // count, shape[-1])] * count


LAYOUTS: dict[str, Layout] = {
    "as_is": Layout(lambda ts, heads, suffix: ts[0], _same),
    "unpermute_q": Layout(lambda ts, heads, suffix: unpermute_rows(ts[0], heads.n_heads), _same),
    "unpermute_k": Layout(lambda ts, heads, suffix: unpermute_rows(ts[0], heads.n_kv_heads), _same),
    "minus_one": Layout(lambda ts, heads, suffix: ts[0] - 1 if suffix == ".weight" else ts[0], _same),
    "transposed": Layout(lambda ts, heads, suffix: ts[0].T if ts[0].ndim == 2 else ts[0],
                         lambda shape, count: [tuple(reversed(shape))]),
    "qkv_grouped": Layout(lambda ts, heads, suffix: grouped_from_concatenated(ts[0], heads), _same),
    "stacked_rows": Layout(lambda ts, heads, suffix: torch.cat(ts, dim=-2), _split_rows),
    "kv_b_joined": Layout(lambda ts, heads, suffix: kv_b_joined(*ts), lambda shape, count: None),
}
