"""The decoder's building blocks, one module each."""

from workbench.components.attention import Attention, LayerKVCache
from workbench.components.block import TransformerBlock
from workbench.components.embedding import Embed, LearnedPosEmbed, SinusoidalPosEmbed, Unembed
from workbench.components.mlp import MLP, GatedMLP
from workbench.components.moe import MixtureOfExperts
from workbench.components.norm import LayerNorm, RMSNorm
from workbench.components.rotary import Rotary

__all__ = [
    "Attention", "LayerKVCache", "TransformerBlock", "Embed", "LearnedPosEmbed", "SinusoidalPosEmbed",
    "Unembed", "MLP", "GatedMLP", "MixtureOfExperts", "LayerNorm", "RMSNorm", "Rotary",
]
