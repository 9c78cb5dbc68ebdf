"""workbench: a hookable decoder-only transformer for mechanistic interpretability.

The model and its description:
    ``model`` (``Decoder``), ``config`` (``ModelConfig``), ``config_checks`` (its allowed values and checks),
    ``sub_configs`` (``MoEConfig``, ``LatentAttentionConfig``), ``options`` (``RuntimeOptions``), ``host`` (what
    the ``Decoder``'s mixins rely on), ``components`` (attention, MLPs, norms, embeddings ...), ``kernels``
    (optional fused GPU kernels), ``errors`` (``InputError``, ``ConfigError``, ``CheckpointError``).
The model's surface, one mixin or helper module per side:
    ``hooking`` (hook contexts), ``hook_point`` (hook points and observing them), ``call_lock`` (one model,
    many threads), ``tokens_api`` (text <-> ids), ``tokenizer`` (the tokenizer wrapper), ``weights_api``
    (TransformerLens's weight views), ``readouts`` (per-layer reads experiments use; ``vocab_readout``, the top-k readout through the
    unembedding in row blocks on helper threads), ``processing`` (weight
    processing), ``factored_attn`` (``refactor_factored_attn_matrices``), ``generation`` (KV-cached sampling),
    ``loss`` (next-token cross-entropy), ``forward_inputs`` (the forward's argument checks and positions), ``cache_batches`` and ``cache_store`` (caches over datasets, on disk; ``cache_index``, a cache directory's format and checks), ``cache_dir`` (the one cache root on disk), ``devices`` (the one check of a ``device=`` argument),
    ``memory`` (keeping freed memory in the process).
Checkpoints and training:
    ``loading`` (``load_model``: registered names, HF directories, GGUF files, our format), ``hub`` (models
    from the Hugging Face Hub by repo id), ``shipped`` (``wb.shipped``: the one table of shipped artifacts), ``saving`` (our
    format), ``safe_files`` (the one folder-bound save and path check), ``zoo`` (the repository's small models),
    ``train`` (training a ``Decoder``), ``corpus`` (the training corpus), ``bpe`` (the zoo's tokenizer trainer),
    ``cli`` (the ``workbench`` command), ``extras`` (optional dependencies).
Sparse dictionaries:
    ``sae`` (SAELens-format SAEs), ``transcoders`` (transcoder sets), ``sae_splicing`` (splicing SAEs into a run).
The generated hook table:
    ``hook_table`` (docs/hooks.md) and ``hook_table_models`` (the models it is generated from).

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
from workbench.hub.sae_releases import pretrained_saes
from workbench.shipped import shipped
from workbench.transcoders import TranscoderSet, load_transcoders

__all__ = ["ModelConfig", "MoEConfig", "LatentAttentionConfig", "RuntimeOptions", "ConfigView", "ATTN_IMPLS", "Decoder", "load_model", "model_config", "plan_memory", "keep_freed_memory", "list_models", "default_model_name", "supported_architectures",
           "ConfigError", "InputError", "CheckpointError", "cache_size", "load_cache", "CacheTooLargeError",
           "SAE", "SAEConfig", "SAEMetadata", "load_sae", "pretrained_saes", "shipped_saes", "shipped", "TranscoderSet", "load_transcoders"]
