"""The zoo's two recipes: each model's ``ModelConfig`` and the ``TrainConfig`` that trains it.

``python -m experiments.zoo --recipe NAME --out workbench/zoo/NAME`` reproduces a shipped model
from these values alone (plus the stdlib corpus and the BPE trained on it, both deterministic).

Example:
    >>> RECIPES["toy-attn-2l"].model.attn_only, RECIPES["toy-moe-2l"].model.num_experts
    (True, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import ModelConfig
from workbench.train import TrainConfig

VOCAB_SIZE = 2048  # the BPE's size; both models share one tokenizer


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    model: ModelConfig
    train: TrainConfig


# Two attention-only layers as in "A Mathematical Framework for Transformer Circuits". What it
# took to grow a real induction circuit within the CPU budget (max layer-1 induction score on
# repeated random tokens; measured while choosing this recipe):
#   code alone, lr 1e-3, 3,000 steps (12M tokens)                                    0.01
#   a quarter of each batch repeated code, lr 3e-3, 5,000 steps                       0.24
#   every second step BOS + 40 random tokens twice (one fixed length)                 0.99 at length 40 but
#       0.02 at length 50: layer 1 learnt "attend 39 back", a fixed offset, not induction
#   the copy length drawn per step from 8..100, mixed 1:1 with code, 3,000 steps       0.02
#   that induction task alone (lr 1e-3): previous-token heads in layer 0 and
#       induction heads in layer 1 form between steps 1,250 and 2,000               0.93
# Hence the curriculum: the induction task alone for the first 2,200 steps, then code (a quarter
# of each batch repeated code) with one step in four still the induction task, so the circuit
# stays while the model learns code.
TOY_ATTN_2L = Recipe(
    name="toy-attn-2l",
    summary="two attention-only layers (no MLPs), 4 heads each; previous-token head in layer 0, induction head in layer 1",
    model=ModelConfig(
        n_layers=2, d_model=128, n_heads=4, d_head=32, d_vocab=VOCAB_SIZE, n_ctx=256, attn_only=True,
        normalization="LN", positional="rotary", model_name="toy-attn-2l"),
    train=TrainConfig(steps=6000, batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100, seed=0,
                      repeat_fraction=0.25, induction_warmup_steps=2200, induction_every=4, induction_batch=32,
                      induction_len=100, eval_every=500, checkpoint_every=1000),
)

# Two Mixtral-style layers: grouped-query attention (4 query heads sharing 2 K/V heads) and a
# top-2-of-4 SwiGLU mixture of experts, trained with a Switch load-balancing loss so every
# expert keeps receiving tokens while the router learns to pick them by content.
TOY_MOE_2L = Recipe(
    name="toy-moe-2l",
    summary="two layers, grouped-query attention (4 heads / 2 KV heads), top-2-of-4 SwiGLU mixture of experts",
    model=ModelConfig(
        n_layers=2, d_model=128, n_heads=4, n_key_value_heads=2, d_head=32, d_mlp=256, d_vocab=VOCAB_SIZE,
        n_ctx=256, normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True, num_experts=4,
        experts_per_token=2, model_name="toy-moe-2l"),
    train=TrainConfig(steps=2000, batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100, seed=0,
                      aux_loss_coef=0.01, eval_every=500, checkpoint_every=500),
)

RECIPES: dict[str, Recipe] = {recipe.name: recipe for recipe in (TOY_ATTN_2L, TOY_MOE_2L)}
