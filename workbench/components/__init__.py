"""The decoder's building blocks, one module each.

``block`` (one transformer block on the residual stream), ``attention`` (multi-head, grouped- and multi-query
self-attention), ``attention_kernels`` (eager, sdpa and flash inner functions), ``latent_attention`` (DeepSeek's
multi-head latent attention), ``differential_attention`` (DiffLlama's), ``mlp`` (dense and gated MLPs), ``moe``
(mixtures of experts and their routers), ``norm`` (LayerNorm, RMSNorm), ``embedding`` (token and position
embeddings, the unembedding), ``rotary`` (RoPE and ALiBi slopes), ``zero_biases`` (absent biases read as zeros).
"""

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
