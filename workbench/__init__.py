"""workbench: a hookable decoder-only transformer for mechanistic interpretability.

Example:
    >>> import workbench as wb
    >>> model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8))
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 10])
"""

from workbench.cache_batches import cache_size
from workbench.cache_store import load_cache
from workbench.config import LatentAttentionConfig, MoEConfig, ModelConfig
from workbench.errors import CacheTooLargeError, CheckpointError, ConfigError, InputError
from workbench.memory import keep_freed_memory
from workbench.loading import default_model_name, list_models, load_model, model_config, plan_memory, supported_architectures
from workbench.model import Decoder
from workbench.options import ATTN_IMPLS, ConfigView, RuntimeOptions
from workbench.sae import SAE, SAEConfig, SAEMetadata, load_sae, shipped_saes
from workbench.shipped import shipped
from workbench.transcoders import TranscoderSet, load_transcoders

__all__ = ["ModelConfig", "MoEConfig", "LatentAttentionConfig", "RuntimeOptions", "ConfigView", "ATTN_IMPLS", "Decoder", "load_model", "model_config", "plan_memory", "keep_freed_memory", "list_models", "default_model_name", "supported_architectures",
           "ConfigError", "InputError", "CheckpointError", "cache_size", "load_cache", "CacheTooLargeError",
           "SAE", "SAEConfig", "SAEMetadata", "load_sae", "shipped_saes", "shipped", "TranscoderSet", "load_transcoders"]
