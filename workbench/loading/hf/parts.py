"""Checkpoint readers the older dense family modules share (Falcon, the StarCoders, CodeGen, XGLM):
a LayerNorm's gain and bias, one linear map with an optional bias, an ungated MLP, and Q, K and V
split from fused rows laid out per key/value group.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp.
"""

from __future__ import annotations

from torch import Tensor

from workbench.loading.hf.checkpoint import SafetensorsCheckpoint


def layer_norm(ckpt: SafetensorsCheckpoint, hf: str, ours: str, D: int) -> dict[str, Tensor]:
    """``{ours.w, ours.b}`` from the checkpoint's ``hf.weight`` and ``hf.bias`` [D].

    Example:
        >>> layer_norm(SafetensorsCheckpoint(Path("tiny-falcon")), "transformer.ln_f", "ln_final", 48)  # doctest: +SKIP
    """
    return {f"{ours}.w": ckpt.take(f"{hf}.weight", (D,)), f"{ours}.b": ckpt.take(f"{hf}.bias", (D,))}


def shared_layer_norm(ckpt: SafetensorsCheckpoint, hf: str, block: str, D: int) -> dict[str, Tensor]:
    """A block's one norm read by attention and MLP alike (GPT-J's block), as ``block.ln1`` and a clone
    ``block.ln2``, so each can be edited alone.

    Example:
        >>> shared_layer_norm(ckpt, "transformer.h.0.ln_1", "blocks.0", 48)   # doctest: +SKIP
    """
    out = layer_norm(ckpt, hf, f"{block}.ln1", D)
    out.update({f"{block}.ln2.{p}": out[f"{block}.ln1.{p}"].clone() for p in ("w", "b")})
    return out


def linear(ckpt: SafetensorsCheckpoint, hf: str, weight: str, shape: tuple[int, int],
           bias: str | None = None) -> dict[str, Tensor]:
    """``{weight: hf.weight [out, in]}`` in nn.Linear's layout, plus ``{bias: hf.bias [out]}`` when ``bias``
    names where the bias goes (None: a bias-free map).

    Example:
        >>> linear(ckpt, "transformer.h.0.mlp.dense_h_to_4h", "blocks.0.mlp._W_in_lin", (80, 48),
        ...        "blocks.0.mlp.b_in")                                                   # doctest: +SKIP
    """
    out = {weight: ckpt.take(f"{hf}.weight", shape)}
    if bias is not None:
        out[bias] = ckpt.take(f"{hf}.bias", shape[:1])
    return out


def plain_mlp(ckpt: SafetensorsCheckpoint, hf_in: str, hf_out: str, ours: str, D: int, M: int,
              bias: bool) -> dict[str, Tensor]:
    """An ungated MLP's ``_W_in_lin`` [M, D] and ``_W_out_lin`` [D, M] (with ``bias``, ``b_in`` and ``b_out``)
    under ``ours`` from the linear maps ``hf_in`` and ``hf_out``.

    Example:
        >>> plain_mlp(ckpt, "model.layers.0.fc1", "model.layers.0.fc2", "blocks.0.mlp", 48, 80, bias=True)  # doctest: +SKIP
    """
    out = linear(ckpt, hf_in, f"{ours}._W_in_lin", (M, D), f"{ours}.b_in" if bias else None)
    out.update(linear(ckpt, hf_out, f"{ours}._W_out_lin", (D, M), f"{ours}.b_out" if bias else None))
    return out


def split_grouped_qkv(fused: Tensor, n_heads: int, n_kv_heads: int, d_head: int) -> dict[str, Tensor]:
    """{"Q": [H*K, ...], "K": [G*K, ...], "V": [G*K, ...]} from fused rows laid out per key/value
    group as [G, H/G + 2, K] (each group's query heads, its key head, its value head); a weight
    [rows, D] or a bias [rows]. Falcon's new layout is this shape directly; a multi-query layout
    (all queries, one key, one value) is G = 1; a per-head [H, 3, K] layout is G = H.

    Example:
        >>> import torch
        >>> rows = torch.arange(8.0)   # H=2 query heads over G=1 key/value head, K=2: q q | k | v
        >>> {name: t.tolist() for name, t in split_grouped_qkv(rows, 2, 1, 2).items()}
        {'Q': [0.0, 1.0, 2.0, 3.0], 'K': [4.0, 5.0], 'V': [6.0, 7.0]}
    """
    G, per_group = n_kv_heads, n_heads // n_kv_heads
    grouped = fused.view(G, per_group + 2, d_head, *fused.shape[1:])
    return {"Q": grouped[:, :per_group].reshape(n_heads * d_head, *fused.shape[1:]),
            "K": grouped[:, per_group].reshape(G * d_head, *fused.shape[1:]),
            "V": grouped[:, per_group + 1].reshape(G * d_head, *fused.shape[1:])}


def fused_qkv(ckpt: SafetensorsCheckpoint, hf: str, ours: str, n_heads: int, n_kv_heads: int, d_head: int,
              d_model: int, bias: bool) -> dict[str, Tensor]:
    """Our ``_W_{Q,K,V}_lin`` (and ``_b_{Q,K,V}_lin`` with ``bias``) under ``ours`` from the grouped
    fused map ``hf`` (``split_grouped_qkv``'s layout).

    Example:
        >>> fused_qkv(ckpt, "transformer.h.0.self_attention.query_key_value", "blocks.0.attn",
        ...           6, 2, 8, 48, bias=False)                                            # doctest: +SKIP
    """
    rows = (n_heads + 2 * n_kv_heads) * d_head
    parts = {f"_W_{name}_lin": w for name, w in
             split_grouped_qkv(ckpt.take(f"{hf}.weight", (rows, d_model)), n_heads, n_kv_heads, d_head).items()}
    if bias:
        parts.update({f"_b_{name}_lin": b for name, b in
                      split_grouped_qkv(ckpt.take(f"{hf}.bias", (rows,)), n_heads, n_kv_heads, d_head).items()})
    return {f"{ours}.{name}": tensor for name, tensor in parts.items()}
