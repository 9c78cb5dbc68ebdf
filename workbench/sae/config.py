"""``SAEConfig``: what a sparse autoencoder is, in SAELens's layout, read from and written to its ``cfg.json``.

SAELens 6 writes ``architecture``, ``d_in``, ``d_sae``, ``dtype``, ``device``, ``apply_b_dec_to_input``,
``normalize_activations``, ``reshape_activations``, the architecture's own fields (top-k's ``k`` and
``rescale_acts_by_decoder_norm``, a transcoder's ``d_out``) and ``metadata`` (``hook_name``, ``hook_name_out``,
``model_name``, ...). Before 6.0 the metadata sat at the top level under older names (``hook_point``), and top-k
was ``activation_fn: topk`` with ``activation_fn_kwargs.k``: ``config_from_dict`` reads both, as SAELens's
``handle_pre_6_0_config`` does. Fields SAELens ignores at inference (a training config's coefficients) are
ignored here too; a value we cannot honour is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Mapping, Optional

import torch
from packaging.version import InvalidVersion, Version

from workbench.errors import ConfigError
from workbench.sae.architectures import ARCHITECTURES, architecture_spec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
RESHAPES = ("none", "hook_z")
# The metadata keys a pre-6.0 config kept at its top level (SAELens's LLM_METADATA_KEYS).
METADATA_KEYS = ("model_name", "hook_name", "model_class_name", "hook_head_index", "model_from_pretrained_kwargs",
                 "prepend_bos", "exclude_special_tokens", "neuronpedia_id", "context_size", "seqpos_slice",
                 "dataset_path", "sae_lens_version", "sae_lens_training_version", "hook_name_out",
                 "hook_head_index_out", "hf_hook_name", "hf_hook_name_out")
# How deeply a config may nest (SAELens's nest two or three levels): deeper is refused before anything recurses.
MAX_CONFIG_DEPTH = 32
_PRE_6_RENAMES = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
                  "activation_fn_str": "activation_fn"}


class SAEMetadata(Mapping[str, Any]):
    """How an SAE is meant to be used (``hook_name``, ``model_name``, ...): attributes and keys at once, a missing
    one reading None, as SAELens's ``SAEMetadata``.

    Example:
        >>> meta = SAEMetadata(hook_name="blocks.0.hook_resid_pre")
        >>> meta.hook_name, meta["hook_name"], meta.model_name, "model_name" in meta
        ('blocks.0.hook_resid_pre', 'blocks.0.hook_resid_pre', None, False)
    """

    def __init__(self, **values: Any):
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only called for names never set
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, key: str) -> Any:
        return self.__dict__.get(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self.__dict__[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dict__)

    def __len__(self) -> int:
        return len(self.__dict__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SAEMetadata) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"SAEMetadata({self.__dict__})"

    def __deepcopy__(self, memo: dict) -> "SAEMetadata":
        return SAEMetadata(**copy.deepcopy(self.__dict__, memo))

    def to_dict(self) -> dict[str, Any]:
        """The metadata as a plain dict (what ``cfg.json`` stores).

        Example:
            >>> SAEMetadata(hook_name="hook_embed").to_dict()
            {'hook_name': 'hook_embed'}
        """
        return dict(self.__dict__)


@dataclass
class SAEConfig:
    """An SAE's configuration, SAELens's fields and layout (``cfg.metadata.hook_name``, ``cfg.architecture()``),
    with flat conveniences (``cfg.hook_name``, ``cfg.hook_name_out``, ``cfg.is_transcoder``).

    ``architecture_name``: one of ``workbench.sae.architectures.ARCHITECTURES``; ``k`` and
    ``rescale_acts_by_decoder_norm`` mean something for ``topk`` only, ``d_out`` for transcoders (their
    output width; ``d_in`` otherwise), and each architecture's own fields (its ``Encoding.config_fields``:
    temporal's ``n_heads`` ... ``activation_normalization_factor``, matching pursuit's ``residual_threshold``,
    ``max_iterations``, ``stop_on_duplicate_support``) for it only.

    Example:
        >>> cfg = SAEConfig("standard", d_in=16, d_sae=32, metadata=SAEMetadata(hook_name="blocks.0.hook_resid_pre"))
        >>> cfg.architecture(), cfg.hook_name, cfg.hook_name_out, cfg.d_out
        ('standard', 'blocks.0.hook_resid_pre', 'blocks.0.hook_resid_pre', 16)
    """

    architecture_name: str
    d_in: int
    d_sae: int
    dtype: str = "float32"
    device: str = "cpu"
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    metadata: SAEMetadata = field(default_factory=SAEMetadata)
    k: Optional[int] = None
    rescale_acts_by_decoder_norm: bool = False
    d_out: Optional[int] = None
    # temporal's own fields (SAELens's TemporalSAEConfig, its defaults): workbench.sae.architectures.temporal
    n_heads: int = 8
    n_attn_layers: int = 1
    bottleneck_factor: int = 64
    sae_diff_type: str = "topk"
    kval_topk: Optional[int] = None
    tied_weights: bool = True
    activation_normalization_factor: float = 1.0
    # matching pursuit's own fields (SAELens's MatchingPursuitSAEConfig, its defaults): ...architectures.matching_pursuit
    residual_threshold: float = 1e-2
    max_iterations: Optional[int] = None
    stop_on_duplicate_support: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, SAEMetadata):  # a plain dict is accepted
            self.metadata = SAEMetadata(**dict(self.metadata or {}))
        spec = architecture_spec(self.architecture_name)  # ConfigError naming the architecture
        for name in ("d_in", "d_sae") + (("d_out",) if spec.transcoder else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"SAEConfig.{name} must be a positive integer, got {value!r}")
        if not spec.transcoder:
            if self.d_out not in (None, self.d_in):
                raise ConfigError(f"SAEConfig.d_out is for transcoders; a {self.architecture_name} SAE writes d_in="
                                  f"{self.d_in}, got d_out={self.d_out!r}")
            self.d_out = self.d_in
        for name in ("hook_name", "hook_name_out"):
            if not isinstance(self.metadata[name], (str, type(None))):
                raise ConfigError(f"SAEConfig.metadata.{name} must be a hook point name, got {self.metadata[name]!r}")
        for name in ("hook_head_index", "hook_head_index_out"):
            head = self.metadata[name]
            if head is not None and (isinstance(head, bool) or not isinstance(head, int) or head < 0):
                raise ConfigError(f"SAEConfig.metadata.{name} must be a head number (an integer from 0) or null, "
                                  f"got {head!r}")
        if not isinstance(self.dtype, str) or self.dtype.removeprefix("torch.") not in DTYPES:
            raise ConfigError(f"SAEConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        self.dtype = self.dtype.removeprefix("torch.")
        if self.normalize_activations not in NORMALIZATIONS + spec.encoding.normalizations:
            extra = (" (its whitening statistics are not part of the saved SAE: fold them into the weights, as "
                     "SAELens's fold_activation_whitening does)") if self.normalize_activations == "covariance_whitening" else ""
            raise ConfigError(f"SAEConfig.normalize_activations must be one of "
                              f"{NORMALIZATIONS + spec.encoding.normalizations}, got "
                              f"{self.normalize_activations!r}{extra}")
        if self.reshape_activations not in RESHAPES:
            raise ConfigError(f"SAEConfig.reshape_activations must be one of {RESHAPES}, got {self.reshape_activations!r}")
        if self.reshape_activations == "hook_z" and self.hook_name is not None and not self.hook_name.endswith("_z"):
            raise ConfigError(f"SAEConfig.reshape_activations='hook_z' needs a hook_z hook, got metadata.hook_name="
                              f"{self.hook_name!r}")
        if spec.transcoder and self.reshape_activations != "none":
            raise ConfigError(f"SAEConfig.reshape_activations must be 'none' for a transcoder (SAELens's transcoders "
                              f"never reshape), got {self.reshape_activations!r}")
        if not isinstance(self.apply_b_dec_to_input, bool):
            raise ConfigError(f"SAEConfig.apply_b_dec_to_input must be true or false, got {self.apply_b_dec_to_input!r}")
        if spec.transcoder and self.apply_b_dec_to_input:
            raise ConfigError("SAEConfig.apply_b_dec_to_input must be false for a transcoder (its b_dec is an "
                              "output bias, as SAELens requires)")
        if spec.top_k:
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise ConfigError(f"SAEConfig.k must be an integer from 1 to d_sae={self.d_sae}, got {self.k!r}")
        spec.encoding.check_config(self)

    def architecture(self) -> str:
        """The architecture's name, as SAELens's ``cfg.architecture()``.

        Example:
            >>> SAEConfig("jumprelu", d_in=4, d_sae=8).architecture()
            'jumprelu'
        """
        return self.architecture_name

    @property
    def hook_name(self) -> Optional[str]:
        """The hook point the SAE reads (``metadata.hook_name``)."""
        return self.metadata.hook_name

    @property
    def hook_name_out(self) -> Optional[str]:
        """The hook point the SAE writes: ``metadata.hook_name_out`` for a transcoder, else ``hook_name``."""
        return self.metadata.hook_name_out or self.metadata.hook_name

    @property
    def is_transcoder(self) -> bool:
        """Whether the SAE reads one hook and writes another (a transcoder of any kind)."""
        return architecture_spec(self.architecture_name).transcoder

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """The ``cfg.json`` SAELens 6 writes for this architecture (its own fields only, plus ``architecture``).

        Example:
            >>> sorted(SAEConfig("topk", d_in=4, d_sae=8, k=2).to_dict())   # doctest: +NORMALIZE_WHITESPACE
            ['apply_b_dec_to_input', 'architecture', 'd_in', 'd_sae', 'device', 'dtype', 'k', 'metadata',
             'normalize_activations', 'rescale_acts_by_decoder_norm', 'reshape_activations']
        """
        own = _own_fields(self.architecture_name)
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "architecture_name" and (f.name not in _ARCHITECTURE_FIELDS or f.name in own)}
        out["metadata"] = self.metadata.to_dict()
        out["architecture"] = self.architecture_name
        return out


def config_from_dict(raw: Mapping[str, Any], dtype: Optional[str] = None, device: Optional[str] = None) -> SAEConfig:
    """An ``SAEConfig`` from a parsed ``cfg.json`` of SAELens 6 or earlier; ``dtype`` / ``device`` override it.

    Example:
        >>> cfg = config_from_dict({"d_in": 4, "d_sae": 8, "hook_point": "blocks.1.hook_resid_pre",
        ...                         "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}})   # SAELens 5
        >>> cfg.architecture(), cfg.k, cfg.hook_name
        ('topk', 3, 'blocks.1.hook_resid_pre')
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"an SAE config is a JSON object, got {type(raw).__name__}")
    _check_depth(raw)
    values = dict(raw)
    if not isinstance(values.get("metadata") or {}, Mapping):
        raise ConfigError(f"SAE config field 'metadata' must be an object, got {values['metadata']!r}")
    if _is_pre_6(values):
        values = _pre_6_to_6(values)
    for name in ("architecture", "d_in", "d_sae"):
        if name not in values:
            raise ConfigError(f"SAE config has no {name!r} field")
    spec = architecture_spec(values["architecture"])
    metadata = values.get("metadata") or {}
    known = {f.name for f in fields(SAEConfig)} - {"architecture_name", "metadata"}
    kwargs = {name: values[name] for name in known if name in values and values[name] is not None}
    if dtype is not None:
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    if device is not None:
        kwargs["device"] = str(device)
    for name in _ARCHITECTURE_FIELDS - _own_fields(values["architecture"]):  # SAELens drops what the
        kwargs.pop(name, None)                                  # architecture's config class does not have
    if "normalize_activations" in kwargs and isinstance(kwargs["normalize_activations"], bool):
        kwargs["normalize_activations"] = "expected_average_only_in" if kwargs["normalize_activations"] else "none"
    return SAEConfig(values["architecture"], metadata=SAEMetadata(**dict(metadata)), **kwargs)


def _own_fields(architecture: str) -> frozenset[str]:
    """The architecture-specific fields ``architecture``'s config has (its encoding's; ``d_out`` for a transcoder)."""
    spec = architecture_spec(architecture)
    return frozenset(spec.encoding.config_fields) | ({"d_out"} if spec.transcoder else set())


# Every field that belongs to some architecture only (written and read for that architecture alone).
_ARCHITECTURE_FIELDS = frozenset({"d_out"}).union(*(spec.encoding.config_fields for spec in ARCHITECTURES.values()))


def _check_depth(raw: Any) -> None:
    """A ``ConfigError`` naming the field that nests deeper than ``MAX_CONFIG_DEPTH`` (walked without recursion, so
    a hostile config cannot raise ``RecursionError`` here or in the deep copies made later)."""
    pending = [(raw, "", 1)]
    while pending:
        value, where, depth = pending.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"SAE config field {where.lstrip('.')!r} nests deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(value, Mapping):
            pending.extend((item, f"{where}.{key}", depth + 1) for key, item in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value))


def _is_pre_6(values: Mapping[str, Any]) -> bool:
    """SAELens's test: no ``sae_lens_version`` (top level or metadata) or one before 6.0.0-rc.0."""
    version = values.get("sae_lens_version")
    if not version and isinstance(values.get("metadata"), Mapping):
        version = values["metadata"].get("sae_lens_version")
    if not version:
        return True
    try:
        return Version(str(version)) < Version("6.0.0-rc.0")
    except InvalidVersion:
        raise ConfigError(f"SAE config field 'sae_lens_version' is not a version: {version!r}") from None


def _pre_6_to_6(values: dict[str, Any]) -> dict[str, Any]:
    """SAELens's ``handle_pre_6_0_config``: renamed keys, defaults, top-k from ``activation_fn``, metadata
    gathered from the top level. An activation it would silently replace by ReLU is an error here."""
    new = {_PRE_6_RENAMES.get(key, key): value for key, value in values.items()}
    if not isinstance(new.get("hook_name") or "", str):
        raise ConfigError(f"SAE config field 'hook_point' (hook_name) must be a hook point name, got {new['hook_name']!r}")
    if not isinstance(new.get("activation_fn_kwargs") or {}, Mapping):
        raise ConfigError(f"SAE config field 'activation_fn_kwargs' must be an object, got {new['activation_fn_kwargs']!r}")
    new.setdefault("prepend_bos", True)
    new.setdefault("apply_b_dec_to_input", True)
    new.setdefault("architecture", "standard")
    new.setdefault("reshape_activations", "hook_z" if "hook_z" in (new.get("hook_name") or "") else "none")
    activation = new.get("activation_fn") or "relu"
    if activation == "topk":
        k = (new.get("activation_fn_kwargs") or {}).get("k")
        if k is None:
            raise ConfigError("SAE config field 'activation_fn' is 'topk' but 'activation_fn_kwargs' has no 'k'")
        new["architecture"], new["k"] = "topk", k
    elif activation != "relu":
        raise ConfigError(f"SAE config field 'activation_fn' must be 'relu' or 'topk', got {activation!r}")
    # SAELens rebuilds the metadata from the top level only; one already nested is kept here (its hook name too).
    nested = new.get("metadata") if isinstance(new.get("metadata"), Mapping) else {}
    new["metadata"] = {**nested, **{key: new[key] for key in METADATA_KEYS if key in new}}
    return new

