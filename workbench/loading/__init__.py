"""Turning checkpoints into ``Decoder``s: registered names, HF directories, GGUF files, our own format.

``load_model`` decides what ``source`` is and hands it to one loader; each loader builds the
config, reads and checks every tensor, and only then returns a model, so a failure never
leaves a half-loaded model behind. A source that is none of those but names a Hub repo is fetched
into the HF cache first (``workbench.hub``) and then loaded as a local checkpoint; nothing is
unpickled but through ``torch.load(weights_only=True)``, and no remote code is run.

``registry`` (registered names), ``hf`` (HF-format directories: the loader and one module per family, checked
against the contract in ``family``), ``gguf`` (GGUF files, through the same family modules), ``native`` (our own
format); what they share: ``common`` (progress bars, refusing a value, the layer-count check), ``weights``
(named tensors into a ``Decoder``, every name and shape checked first), ``build`` (every loader's last step),
``placement`` (device maps and offload folders), ``memory_plan`` (``plan_memory``'s table) and ``weights_cache``
(a converted checkpoint kept on disk, so a GGUF opens in about a second after its first load) with
``entry_stamps`` (a checked entry's stamp, so an unchanged file is not hashed again).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

import pandas as pd
import torch

from workbench.config import ModelConfig
from workbench import hub
from workbench.devices import check_device
from workbench.errors import CheckpointError, ConfigError
from workbench.loading.gguf.loader import GGUF_MODELS, GGUFFile, load_gguf, model_config_from_gguf
from workbench.loading.hf.loader import ARCHITECTURES, hf_checkpoint_dtype, hf_model_config, is_hf_config, load_hf_directory, read_config
from workbench.loading.memory_plan import plan
from workbench.loading.native import FORMAT_TAG, load_native, native_config, read_native_config
from workbench.loading.placement import DeviceMapSpec, MaxMemory, Placement
from workbench.loading.registry import REGISTRY, default_model_name, list_models
from workbench.options import RuntimeOptions

__all__ = ["load_model", "plan_memory", "model_config", "list_models", "default_model_name", "supported_architectures", "CheckpointNotFoundError"]


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """``source`` is neither a registered name nor an existing path (catchable as either base)."""


def load_model(source: Union[str, Path], attn_impl: str = "sdpa", dtype: Optional[torch.dtype] = None,
               device: str = "cpu", progress: Optional[bool] = None, *, fold_ln: bool = False,
               center_writing_weights: bool = False, center_unembed: bool = False, fold_value_biases: bool = False,
               refactor_factored_attn_matrices: bool = False, ungroup_grouped_query_attention: bool = False,
               device_map: Optional[DeviceMapSpec] = None, max_memory: MaxMemory = None,
               offload_folder: Optional[Union[str, Path]] = None, revision: Optional[str] = None,
               cache_dir: Optional[Union[str, Path]] = None, token: Union[str, bool, None] = None,
               local_files_only: bool = False, gguf_file: Optional[str] = None,
               weights_cache: Optional[bool] = None):
    """Loads a model from a registered name, an HF directory, a .gguf file, a saved directory, or the Hub.

    By default the weights are as in the checkpoint (logits equal `transformers`'). The four
    processing options apply TransformerLens's weight processing after loading
    (``workbench.processing.process_weights``; recorded in ``cfg.weight_processing``): all four on
    is what ``HookedTransformer.from_pretrained`` gave. ``center_writing_weights`` needs a pre-norm
    LayerNorm model (GPT-2; an RMSNorm model warns and skips it, as TransformerLens) and ``fold_ln`` a
    pre-norm one: otherwise ``ConfigError``.

    Args:
        source: a name from ``wb.list_models()``, an HF-format directory (config.json +
            *.safetensors), a ``.gguf`` file, a directory written by ``model.save()``, or (none of
            those) a Hub repo id ("org/name") or TransformerLens model name ("gpt2-small"): its files
            are fetched into the HF cache (``workbench.hub``; ``model.hub_origin`` records the commit).
        attn_impl: "eager", "sdpa" or "flash".
        dtype: torch.float32, torch.bfloat16 or torch.float16; None: the checkpoint's own (an HF or
            saved directory's weights are read straight into it; a GGUF file's dequantised blocks
            become float32).
        device: where the weights go (one this machine lacks is a ``ConfigError`` before any file is read).
        progress: progress bar while reading tensors (None: only for checkpoints over 64 MiB).
        fold_ln: fold every norm's gain (and LayerNorm bias) into the weights that read it; the
            norms then compute TransformerLens's LNPre / RMSPre.
        center_writing_weights: centre W_E, W_pos, W_O, b_O, W_out, b_out over d_model (LayerNorm only).
        center_unembed: centre W_U (and b_U) over the vocabulary (log-probabilities unchanged).
        fold_value_biases: fold b_V into b_O.
        refactor_factored_attn_matrices: TransformerLens's refactor of each head's W_Q/W_K and W_V/W_O
            (``workbench.factored_attn``; not with rotary positions or grouped-query attention).
        ungroup_grouped_query_attention: hook_k / hook_v per query head (``model.set_ungroup_grouped_query_attention``),
            so notebooks written for multi-head attention run on grouped-query models.
        device_map: spread the model over several devices through ``accelerate`` (the ``scale``
            extra) instead of ``device``: "auto" (GPUs, then the CPU, then disk, within
            ``max_memory``; blocks balanced over several GPUs), "sequential" (fill each device in
            turn) or a dict {module: device} over whole blocks and top-level modules, e.g.
            ``{"embed": 0, "blocks.0": 0, ..., "blocks": "cpu", "ln_final": "cpu", "unembed": "cpu"}``
            (the longest matching key wins; devices N, "cuda:N", "cpu", "disk"). Each weight goes
            straight to its device; ``model.device_map`` records the map. Hooks receive each block's
            activations on its device; ``run_with_cache(..., device="cpu")`` gathers a cache on one.
            Only blocks can go to "disk". See ``wb.plan_memory`` for the bytes per device first.
        max_memory: with "auto"/"sequential", the most each device may hold, e.g.
            ``{0: "20GiB", "cpu": "60GiB"}`` (default: the free memory of each); what does not fit
            goes to disk.
        offload_folder: where blocks on "disk" are written (a new or empty directory, or one an
            earlier load offloaded to, which is cleared); needed when any block goes to disk.
        revision, cache_dir, token, local_files_only: for a Hub source, as ``transformers``' (branch, tag
            or commit; the HF cache; default ``HF_TOKEN`` or the stored login; cache only).
        gguf_file: load this .gguf file of a Hub repo (or of the directory ``source``).
        weights_cache: a GGUF file's converted weights (config, tokenizer, dequantised tensors) are kept in
            ``$WORKBENCH_CACHE_DIR/weights`` (default ``~/.cache/workbench/weights``) after its first load, so later
            loads are memory-mapped in about a second (``workbench.loading.weights_cache``: keyed by the file's
            identity and the converter's version, checked before use). None: on unless ``WORKBENCH_WEIGHTS_CACHE=0``;
            False: neither read nor written for this load.

    Example:
        >>> import workbench as wb
        >>> toy = wb.load_model("toy-attn-2l", attn_impl="eager", dtype=torch.bfloat16)
        >>> toy.cfg.n_layers, toy.cfg.attn_impl, toy.cfg.dtype
        (2, 'eager', torch.bfloat16)
        >>> model = wb.load_model("smollm2-135m", attn_impl="sdpa")   # doctest: +SKIP
        >>> model = wb.load_model("runs/my-model", attn_impl="flash")  # doctest: +SKIP
        >>> gpt2 = wb.load_model("checkpoints/gpt2", fold_ln=True, center_writing_weights=True,
        ...                      center_unembed=True, fold_value_biases=True)   # doctest: +SKIP
        >>> gpt2.cfg.weight_processing   # doctest: +SKIP
        ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
        >>> llama = wb.load_model("smollm2-135m", fold_ln=True, center_unembed=True)   # doctest: +SKIP
        >>> big = wb.load_model("checkpoints/llama-70b", dtype=torch.bfloat16, device_map="auto",
        ...                     max_memory={0: "70GiB", 1: "70GiB", "cpu": "100GiB"},
        ...                     offload_folder="offload")   # doctest: +SKIP
        >>> big.device_map["blocks.79"]   # doctest: +SKIP
        'cpu'
        >>> pythia = wb.load_model("EleutherAI/pythia-70m", revision="step3000")   # doctest: +SKIP
        >>> pythia.hub_origin.commit   # doctest: +SKIP
        '...'
        >>> gpt2 = wb.load_model("gpt2-small")   # TransformerLens's name for "gpt2"   # doctest: +SKIP
    """
    placement = None
    if device_map is not None:
        if device != "cpu":
            raise ConfigError(f"device={device!r} and device_map={device_map!r} both say where the weights go: "
                              "pass one")
        placement = Placement(device_map, max_memory, offload_folder)
    elif max_memory is not None or offload_folder is not None:
        raise ConfigError("max_memory and offload_folder need a device_map (e.g. device_map='auto')")
    else:
        check_device(device)
    hub_options = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    model = _load(source, attn_impl, dtype, device, progress, placement, hub_options, gguf_file, weights_cache)
    if ungroup_grouped_query_attention:
        model.set_ungroup_grouped_query_attention(True)
    if fold_ln or center_writing_weights or center_unembed or fold_value_biases or refactor_factored_attn_matrices:
        model.process_weights_(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                               center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                               refactor_factored_attn_matrices=refactor_factored_attn_matrices)
    return model


def _load(source: Union[str, Path], attn_impl: str, dtype: Optional[torch.dtype], device: str,
          progress: Optional[bool], placement: Optional[Placement], hub_options: Optional[dict] = None,
          gguf_file: Optional[str] = None, weights_cache: Optional[bool] = None):
    """The model exactly as the checkpoint holds it, by whichever loader ``source`` calls for."""
    if _is_hub_source(source):  # fetched into the HF cache, then loaded as a local checkpoint
        with _hub_checkpoint(source, hub.fetch_model, **(hub_options or {}), gguf_file=gguf_file,
                             progress=progress) as fetched:
            model = _load(fetched.path, attn_impl, dtype, device, progress, placement, weights_cache=weights_cache)
        model.config = model.config.replace(model_name=fetched.origin.repo_id)
        model.hub_origin = fetched.origin
        return model
    if gguf_file is not None:
        source = Path(source) / gguf_file
    options = dict(attn_impl=attn_impl, dtype=dtype, device=device, placement=placement)
    path, kind = _locate(source)
    if kind == "gguf":
        model = load_gguf(path, progress=progress, weights_cache=weights_cache,
                          **{**options, "dtype": dtype or torch.float32})
    elif kind == "native":
        model = load_native(path, **options)
    else:
        model = load_hf_directory(path, progress=progress, **options)
    model.hub_origin = None
    return model


def _is_hub_source(source: Union[str, Path]) -> bool:
    """``source`` is for the Hub: a string that is no registered name and no existing path, shaped as a repo id
    or a TransformerLens name (registered names and local paths win)."""
    return isinstance(source, str) and source not in REGISTRY and not Path(source).exists() and hub.is_hub_name(source)


@contextmanager
def _hub_checkpoint(source: str, fetch, **options) -> Iterator[hub.Fetched]:
    """``fetch(source, **options)``'s checkpoint; a repo the Hub (or, offline, the cache) lacks is a
    ``CheckpointNotFoundError`` that also says ``source`` is no local path or registered name."""
    with ExitStack() as stack:
        try:
            fetched = stack.enter_context(fetch(source, **options))
        except hub.HubNotFoundError as error:
            if not error.whole_repo:
                raise
            raise CheckpointNotFoundError(f"{source}: no such file or directory, and not a registered model name "
                                          f"(registered: {sorted(REGISTRY)}), nor a Hub repo we can read: {error}") from error
        yield fetched


def _locate(source: Union[str, Path]) -> tuple[Path, str]:
    """The file or directory ``source`` names and its format: "gguf", "native" (written by
    ``model.save()``) or "hf"; a ``CheckpointError`` for anything else."""
    if isinstance(source, str) and source in REGISTRY:
        source = REGISTRY[source].path()
    path = Path(source)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{source}: no such file or directory, and not a registered model name (registered: {sorted(REGISTRY)})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path}: a file must be a .gguf checkpoint; for safetensors pass its directory")
        return path, "gguf"
    config_path = path / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: not found; a model directory needs config.json "
                              "(HF format or written by model.save())")
    data = read_config(config_path)
    if data.get("format") == FORMAT_TAG:
        return path, "native"
    if is_hf_config(data):
        return path, "hf"
    raise CheckpointError(f"{config_path}: neither an HF config (no field 'architectures' or 'model_type') "
                          f"nor one written by model.save() (no field 'format': '{FORMAT_TAG}')")


def model_config(source: Union[str, Path], *, revision: Optional[str] = None,
                 cache_dir: Optional[Union[str, Path]] = None, token: Union[str, bool, None] = None,
                 local_files_only: bool = False) -> ModelConfig:
    """The ``ModelConfig`` of a registered name, HF directory, .gguf file, saved directory or Hub repo, with no
    weights read (a Hub repo: config.json and the safetensors headers, by range requests; the other
    arguments as ``load_model``'s).

    Example:
        >>> wb.loading.model_config("toy-attn-2l").n_layers
        2
        >>> wb.model_config("meta-llama/Llama-3.1-8B", token="hf_...").n_key_value_heads   # doctest: +SKIP
        8
    """
    return _config_and_dtype(source, dict(revision=revision, cache_dir=cache_dir, token=token,
                                          local_files_only=local_files_only))[0]


def _config_and_dtype(source: Union[str, Path], hub_options: Optional[dict] = None) -> tuple[ModelConfig, torch.dtype]:
    """The architecture, and the dtype ``load_model(source)`` would give: an HF checkpoint's own (from its
    header), a saved model's, float32 for a GGUF file's dequantised weights."""
    if _is_hub_source(source):  # config.json and the weights' headers only
        with _hub_checkpoint(source, hub.fetch_config, **(hub_options or {})) as fetched:
            cfg, dtype = _config_and_dtype(fetched.path)
        return cfg.replace(model_name=fetched.origin.repo_id), dtype
    path, kind = _locate(source)
    if kind == "gguf":
        return model_config_from_gguf(GGUFFile(path)), torch.float32
    if kind == "native":
        cfg, options = read_native_config(path)
        return cfg, RuntimeOptions(**options).dtype
    return hf_model_config(path), hf_checkpoint_dtype(path)


def plan_memory(source: Union[str, Path], dtype: Optional[torch.dtype] = None, device_map: DeviceMapSpec = "auto",
                max_memory: MaxMemory = None, *, batch: int = 1, pos: int = 1024, names_filter=None,
                revision: Optional[str] = None, cache_dir: Optional[Union[str, Path]] = None,
                token: Union[str, bool, None] = None, local_files_only: bool = False) -> pd.DataFrame:
    """Before loading: where ``load_model(source, dtype=dtype, device_map=..., max_memory=...)`` would put
    each block, and the bytes per device of the weights and of ``run_with_cache`` on ``batch`` x ``pos``
    tokens (every hook, or ``names_filter``'s; each activation is cached on its block's device).

    One row per device: ``device``, ``units`` (e.g. "embed, unembed, blocks.0-11"), ``weights_bytes``,
    ``cache_bytes``, ``cache_on`` (where a disk block's activations land: the CPU), and readable
    ``weights``/``cache``. Nothing is read but the config (shapes come from a model on the meta device);
    a Hub repo's config.json and safetensors headers are fetched, never its weights (``revision``,
    ``cache_dir``, ``token``, ``local_files_only`` as ``load_model``'s). Also ``workbench plan SOURCE`` on
    the command line.

    Example:
        >>> wb.plan_memory("toy-attn-2l", device_map={"embed": "cpu", "ln_final": "cpu", "unembed": "cpu",
        ...                                           "blocks.0": "cpu", "blocks.1": "disk"}, pos=8).units.tolist()
        ['embed, ln_final, unembed, blocks.0', 'blocks.1']
        >>> wb.plan_memory("smollm2-135m", max_memory={"cpu": "300MiB"}, batch=8, pos=128)   # doctest: +SKIP
          device                                 units  weights_bytes  cache_bytes cache_on    weights     cache
        0    cpu  embed, ln_final, unembed, blocks.0-4      297296640     73859968      cpu  283.5 MiB  70.4 MiB
        1   disk                           blocks.5-29      354009600    364134400      cpu  337.6 MiB 347.3 MiB
    """
    if batch < 1 or pos < 1:
        raise ConfigError(f"batch and pos must be at least 1, got batch={batch}, pos={pos}")
    cfg, stored_dtype = _config_and_dtype(source, dict(revision=revision, cache_dir=cache_dir, token=token,
                                                       local_files_only=local_files_only))
    return plan(cfg, Placement(device_map, max_memory), batch=batch, pos=pos, names_filter=names_filter,
                dtype=dtype or stored_dtype)


def supported_architectures() -> pd.DataFrame:
    """Every architecture ``load_model`` reads: format, architecture (as config.json or the GGUF
    file names it), model_type, and the models it covers.

    Example:
        >>> import workbench as wb
        >>> table = wb.supported_architectures()
        >>> "LlamaForCausalLM" in set(table.architecture), table.columns.tolist()
        (True, ['format', 'architecture', 'model_type', 'models'])
    """
    hf_rows = [(architecture, *family.architectures[architecture]) for architecture, family in ARCHITECTURES.items()]
    rows = [{"format": "HF directory", "architecture": architecture, "model_type": model_type, "models": models}
            for architecture, model_type, models in hf_rows]
    rows += [{"format": "GGUF", "architecture": arch, "model_type": arch, "models": models}
             for arch, models in GGUF_MODELS.items()]
    return pd.DataFrame(rows, columns=["format", "architecture", "model_type", "models"])
