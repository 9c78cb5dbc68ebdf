"""The small models the mixture-of-experts and latent-attention tests build: the families' routers at toy sizes,
attention sinks and latent attention, every gain, bias, sink and correction bias random (none zero) and matrices
spread out so routing and patterns are far from ties; and the recording and snapshot helpers those tests share.
"""

from __future__ import annotations

import torch

import workbench as wb

VOCAB = 53
BASE = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=48, positional="rotary",
            normalization="RMS", gated_mlp=True, act_fn="silu")

# Routers of the families, at toy sizes.
SOFTMAX = dict(n_key_value_heads=2, num_experts=6, experts_per_token=2)  # Mixtral, Qwen2/3-MoE
SIGMOID = dict(num_experts=8, experts_per_token=3, router_scoring="sigmoid", router_score_correction=True,
               router_groups=4, router_topk_groups=2, router_group_score="top2_sum", routed_scaling_factor=2.5,
               d_shared_expert=24)  # DeepSeek-V3
GROUP_MAX = dict(num_experts=8, experts_per_token=3, router_groups=4, router_topk_groups=2, router_group_score="max",
                 router_renormalize=False, routed_scaling_factor=16.0, d_shared_expert=24)  # DeepSeek-V2
TOPK_SOFTMAX = dict(n_key_value_heads=2, num_experts=6, experts_per_token=2, router_scoring="topk_softmax",
                    router_bias=True, expert_bias=True, swiglu_limit=1.5, swiglu_alpha=1.702,
                    attn_sinks=True, attn_bias=True)  # gpt-oss
QWEN_SHARED = dict(SOFTMAX, router_renormalize=False, d_shared_expert=24, shared_expert_gate=True)  # Qwen2-MoE
# Attention: sinks (a sliding window in layer 0, as gpt-oss alternates), and latent attention with
# d_head_v != d_head (K = 12: U = 8 without RoPE, R = 4 with it).
SINKS = dict(n_key_value_heads=2, attn_sinks=True, attn_bias=True, layer_overrides=({"sliding_window": 3}, {}))
LATENT = dict(n_key_value_heads=4, d_head=12, rotary_dim=4, d_head_v=10, kv_lora_rank=16, q_lora_rank=20)


def build(seed: int = 0, **fields) -> wb.Decoder:
    """A model with gains ~N(1, 0.2), every bias, sink and correction bias ~N(0, 0.3) and matrices ~N(0, 0.2)."""
    torch.manual_seed(seed)
    model = wb.Decoder(wb.ModelConfig.from_dict({**BASE, **fields}), attn_impl="eager")  # flat names, as saved
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":
                param.normal_(1.0, 0.2)
            elif leaf == "b" or leaf.startswith(("b_", "_b_")) or leaf in ("sinks", "router_score_correction"):
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def tokens_BP(batch: int = 2, pos: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def run_recording(model: wb.Decoder, tokens: torch.Tensor, names: list[str], edits=(), **kwargs):
    """(logits, {name: activation}) with ``edits`` (hook name, fn) applied; reads after the edits."""
    seen: dict[str, torch.Tensor] = {}

    def record(tensor, hook):
        seen[hook.name] = tensor.detach().clone()

    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=list(edits) + [(n, record) for n in names], **kwargs)
    return logits, seen


def snapshot(model: wb.Decoder):
    return model.cfg, {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_unchanged(model: wb.Decoder, before) -> None:
    cfg, state = before
    assert model.cfg == cfg
    after = model.state_dict()
    assert set(after) == set(state)
    assert all(torch.equal(after[name], state[name]) for name in state)
