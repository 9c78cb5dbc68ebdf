"""MLP neurons: one neuron's activation on a prompt, its top-activating windows over the bundled corpus
(computed once per MLP for all its neurons, cached on disk) and its direct effect on the logits.

Legend: B batch, P position, D d_model, M d_mlp, V d_vocab, N flattened tokens.

Where a neuron lives (an ``MLPUnit``) and where its activation is read:
  dense MLP      blocks.{l}.mlp.hook_post [B, P, M] (the input to W_out)
  routed expert  no hook has it: computed here from the MLP's input and expert e's weights (W_gate / W_in
                 [E, D, M], b_gate / b_in, the activation; gpt-oss's clamped SwiGLU with ``swiglu_limit``).
                 Only the tokens the router sent to e (``hook_expert_indices``) count: elsewhere the
                 activation is NaN (the expert never ran there).
  shared expert  blocks.{l}.mlp.shared.hook_post [B, P, M]
The MLP's input is ``blocks.{l}.ln2.hook_normalized`` where a norm precedes the MLP, and
``hook_resid_mid`` in post-norm and sublayer-output blocks (their MLP reads the raw residual).

Direct logit effect: ``W_out[neuron] @ W_U``, by default through the final norm's gain (its linear part
at unit scale: RMSNorm multiplies by w, LayerNorm centres then multiplies by w). The norm's per-token
divisor is left out (a positive factor: rankings are exact), and so are an expert's router weight and
a shared expert's gate: the effect is per unit of the neuron's activation.

Top windows (``corpus_maxima``): ``window``-token windows of the Python standard library
(``workbench.corpus``, the text the zoo trains on) through ``experiments.datasets.corpus_windows``; for
every neuron of the MLP, the max over each window's positions (BOS excluded: it is an outlier for most
neurons) and where it is. Stored as safetensors under ``cache_directory()/neurons``, keyed by the
weights' digest, the MLP and the window token ids, written to a temporary file then renamed.

The HTML of the top windows is ``experiments.plots.neurons``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments._tokens import TokensLike, str_tokens
from experiments.datasets import corpus_windows
from experiments.lens import promoted_and_suppressed
from workbench.corpus import stdlib_root, stdlib_source_paths
from workbench.errors import InputError
from workbench.readouts import mlp_width

CACHE_ENV = "WORKBENCH_CACHE_DIR"
FORMAT = "workbench-neuron-maxima-1"
DOC_CHARS = 2000  # each corpus file contributes its first ~2000 characters, so windows span many modules
CHARS_PER_TOKEN = 4  # a generous guess for code; too few windows and the corpus is doubled


@dataclass(frozen=True)
class MLPUnit:
    """One MLP's neurons: layer ``layer``'s dense MLP, its routed ``expert``, or its ``shared`` expert.

    Example:
        >>> MLPUnit(3).label, MLPUnit(1, expert=2).label, MLPUnit(1, shared=True).label
        ('L3 MLP', 'L1 expert 2', 'L1 shared expert')
    """

    layer: int
    expert: Optional[int] = None
    shared: bool = False

    @property
    def label(self) -> str:
        if self.shared:
            return f"L{self.layer} shared expert"
        return f"L{self.layer} MLP" if self.expert is None else f"L{self.layer} expert {self.expert}"

    def width(self, cfg) -> int:
        """The number of neurons; ``InputError`` when the model has no such MLP.

        Example:
            >>> MLPUnit(1, expert=2).width(wb.load_model("toy-moe-2l", progress=False).cfg)
            256
            >>> MLPUnit(0).width(model.cfg)   # toy-attn-2l
            Traceback (most recent call last):
            workbench.errors.InputError: this model is attention-only: it has no MLP, so no neurons (open a model with MLPs)
        """
        return mlp_width(cfg, self.layer, self.expert, self.shared)


def mlp_units(model) -> list[MLPUnit]:
    """Every MLP whose neurons can be read: dense layers, each routed expert and each shared expert.

    Raises ``InputError`` for an attention-only model.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> [u.label for u in mlp_units(moe_model)][:5]
        ['L0 expert 0', 'L0 expert 1', 'L0 expert 2', 'L0 expert 3', 'L1 expert 0']
    """
    cfg = model.cfg
    if cfg.attn_only:
        MLPUnit(0).width(cfg)  # raises the message
    units = []
    for layer, n_experts in enumerate(cfg.layer_values("num_experts")):
        if not n_experts:
            units.append(MLPUnit(layer))
            continue
        units += [MLPUnit(layer, expert=e) for e in range(n_experts)]
        if cfg.moe.d_shared_expert:
            units.append(MLPUnit(layer, shared=True))
    return units


def _mlp_input_hook(cfg, layer: int) -> str:
    if cfg.parallel_attn_mlp or cfg.norm_placement in ("pre", "sandwich"):
        return f"blocks.{layer}.ln2.hook_normalized"
    return f"blocks.{layer}.hook_resid_mid"


def _hook_names(cfg, unit: MLPUnit) -> list[str]:
    l = unit.layer
    if unit.shared:
        return [f"blocks.{l}.mlp.shared.hook_post"]
    if unit.expert is None:
        return [f"blocks.{l}.mlp.hook_post"]
    return [_mlp_input_hook(cfg, l), f"blocks.{l}.mlp.hook_expert_indices"]


@torch.no_grad()
def unit_activations(model, tokens: TokensLike, unit: MLPUnit
                     ) -> tuple[Float[Tensor, "batch pos d_mlp"], Bool[Tensor, "batch pos"]]:
    """Every neuron of ``unit`` on every token (float32), and which tokens ran it (all, but for a routed
    expert: those the router sent to it; the others' activations are NaN). Runs the blocks up to ``unit.layer``.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> acts_BPM, routed_BP = unit_activations(moe_model, "The cat sat", MLPUnit(1, expert=2))
        >>> acts_BPM.shape, routed_BP.shape
        (torch.Size([1, 6, 256]), torch.Size([1, 6]))
        >>> bool(acts_BPM[~routed_BP].isnan().all()), bool(acts_BPM[routed_BP].isfinite().all())
        (True, True)
    """
    unit.width(model.cfg)
    tokens_BP = model.as_tokens(tokens)
    kept: dict[str, Tensor] = {}

    def keep(activation: Tensor, hook) -> None:
        kept[hook.name] = activation.detach()

    names = _hook_names(model.cfg, unit)
    model.run_with_hooks(tokens_BP, stop_at_layer=unit.layer + 1, fwd_hooks=[(name, keep) for name in names])
    if unit.expert is None:
        acts_BPM = kept[names[0]].float()
        return acts_BPM, torch.ones(acts_BPM.shape[:2], dtype=torch.bool, device=acts_BPM.device)
    x_BPD, indices_BPk = kept[names[0]], kept[names[1]]
    B, P, D = x_BPD.shape
    acts_BPM = model.expert_hidden(unit.layer, unit.expert, x_BPD.reshape(B * P, D)).float().reshape(B, P, -1)
    routed_BP = (indices_BPk == unit.expert).any(-1)
    return acts_BPM.masked_fill(~routed_BP[..., None], math.nan), routed_BP


def neuron_activation(model, tokens: TokensLike, unit: MLPUnit, neuron: int) -> pd.DataFrame:
    """One neuron on each token of the prompt (batch row 0): DataFrame[position, token, activation, routed].

    ``activation`` is NaN where a routed expert did not run (``routed`` False).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> acts = neuron_activation(moe_model, "The cat sat", MLPUnit(1, expert=2), 17)
        >>> list(acts.columns), list(acts.token)
        (['position', 'token', 'activation', 'routed'], ['<|endoftext|>', 'The', ' c', 'at', ' s', 'at'])
        >>> bool(acts.activation.isna().eq(~acts.routed).all())   # NaN exactly where the expert did not run
        True
    """
    _check_neuron(model, unit, neuron)
    tokens_1P = model.as_tokens(tokens)[:1]
    acts_BPM, routed_BP = unit_activations(model, tokens_1P, unit)
    return pd.DataFrame({"position": range(tokens_1P.shape[1]), "token": str_tokens(model, tokens_1P[0].cpu()),
                         "activation": acts_BPM[0, :, neuron].cpu().numpy(), "routed": routed_BP[0].cpu().numpy()})


def _check_neuron(model, unit: MLPUnit, neuron: int) -> None:
    width = unit.width(model.cfg)
    if not 0 <= neuron < width:
        raise InputError(f"{unit.label} has neurons 0..{width - 1}, got {neuron}")


def output_weights(model, unit: MLPUnit) -> Float[Tensor, "d_mlp d_model"]:
    """``unit``'s W_out [M, D]: the direction each neuron writes to the residual stream.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> output_weights(moe_model, MLPUnit(1, expert=3)).shape
        torch.Size([256, 128])
    """
    return model.layer_W_out(unit.layer, unit.expert, unit.shared)


@torch.no_grad()
def direct_logit_effect(model, unit: MLPUnit, neuron: int, k: int = 10, through_final_norm: bool = True) -> pd.DataFrame:
    """The ``k`` tokens one unit of the neuron's activation promotes most and suppresses most, directly.

    effect = W_out[neuron] @ W_U, through the final norm's gain when ``through_final_norm`` (see the
    module docstring). DataFrame[direction ("promoted" / "suppressed"), rank, token, token_id, effect].

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> effect = direct_logit_effect(moe_model, MLPUnit(1, expert=0), 100, k=3)
        >>> effect[["direction", "rank"]].values.tolist()
        [['promoted', 1], ['promoted', 2], ['promoted', 3], ['suppressed', 1], ['suppressed', 2], ['suppressed', 3]]
        >>> bool(effect.effect.iloc[0] >= effect.effect.iloc[1] > 0 > effect.effect.iloc[-1])
        True
    """
    _check_neuron(model, unit, neuron)
    out_D = output_weights(model, unit)[neuron]
    if through_final_norm:
        unit_scale = torch.ones(1, 1, dtype=out_D.dtype, device=out_D.device)
        out_D = model.apply_final_norm(out_D[None], frozen_scale=unit_scale)[0]
    return promoted_and_suppressed(model, out_D.float() @ model.W_U.float(), k)


# ---- top-activating windows over the corpus ---------------------------------------------------------
def cache_directory() -> Path:
    """Where the workbench caches results on disk: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``.

    Example:
        >>> cache_directory().name in ("workbench",) or bool(os.environ.get("WORKBENCH_CACHE_DIR"))
        True
    """
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "workbench").expanduser()


_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weights_digest(model) -> str:
    """SHA-256 of every tensor of the model's state (names, shapes, dtypes, bytes).

    Remembered per model until a parameter is changed in place or replaced (its version counter or
    storage moves), so a page pays for it once (~0.5 s for SmolLM2's 135M parameters).

    Example:
        >>> len(weights_digest(model)), weights_digest(model) == weights_digest(model)
        (64, True)
    """
    state = model.state_dict()
    stamp = tuple((t.data_ptr(), t._version) for t in state.values())
    remembered = _DIGESTS.get(model)
    if remembered is not None and remembered[0] == stamp:
        return remembered[1]
    digest = hashlib.sha256()
    for name, tensor in state.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    _DIGESTS[model] = (stamp, digest.hexdigest())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _corpus_paths() -> tuple[Path, ...]:
    root = stdlib_root()
    return tuple(root / relative for relative in stdlib_source_paths(root))


def _corpus_texts(n_chars: int) -> list[str]:
    """The first ~DOC_CHARS characters (whole lines) of evenly spaced corpus files, ``n_chars`` in all."""
    paths = _corpus_paths()
    n_docs = min(len(paths), max(1, math.ceil(n_chars / DOC_CHARS)))
    texts = []
    for i in range(n_docs):
        text = paths[i * len(paths) // n_docs].read_bytes().decode("utf-8", errors="replace")
        head = text[:DOC_CHARS].rsplit("\n", 1)[0] if len(text) > DOC_CHARS else text
        if head.strip():
            texts.append(head)
    return texts


def neuron_corpus(model, n_windows: int = 256, window: int = 64) -> Int[Tensor, "batch pos"]:
    """The ``n_windows`` corpus windows of ``window`` tokens the top-window search reads (fewer only
    when the whole corpus is shorter).

    Example:
        >>> neuron_corpus(model, n_windows=16, window=64).shape
        torch.Size([16, 64])
    """
    if n_windows < 1:
        raise InputError(f"n_windows must be at least 1, got {n_windows}")
    n_chars = n_windows * window * CHARS_PER_TOKEN
    while True:
        texts = _corpus_texts(n_chars)
        windows_BP = corpus_windows(model, texts, window=window, max_windows=n_windows)
        if windows_BP.shape[0] >= n_windows or len(texts) >= len(_corpus_paths()):
            return windows_BP
        n_chars *= 2


@dataclass(frozen=True)
class CorpusMaxima:
    """Each corpus window's max activation of every neuron of one MLP, and where in the window it is.

    ``max_BM`` is -inf where no token of the window ran the neuron (a routed expert not chosen there).
    """

    windows_BP: Int[Tensor, "batch pos"]
    max_BM: Float[Tensor, "batch d_mlp"]
    argmax_BM: Int[Tensor, "batch d_mlp"]
    path: Optional[Path]
    from_disk: bool


def maxima_path(model, unit: MLPUnit, windows_BP: Tensor) -> Path:
    """The cache file of ``unit``'s maxima over ``windows_BP``: named by the model and MLP, keyed by a
    digest of the weights, the MLP, the window ids and the format.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> path = maxima_path(moe_model, MLPUnit(1, expert=3), neuron_corpus(moe_model, n_windows=16))
        >>> path.parent == cache_directory() / "neurons", path.suffix
        (True, '.safetensors')
    """
    key = json.dumps({"format": FORMAT, "weights": weights_digest(model), "unit": [unit.layer, unit.expert, unit.shared],
                      "windows": hashlib.sha256(windows_BP.cpu().long().numpy().tobytes()).hexdigest(),
                      "shape": list(windows_BP.shape)})
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model.cfg.model_name or 'model'}-{unit.label}")
    return cache_directory() / "neurons" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def _read_maxima(path: Path, windows_BP: Tensor) -> Optional[CorpusMaxima]:
    """The cached maxima, or None when the file is missing, unreadable or for other windows."""
    try:
        stored = load_file(str(path))
    except (OSError, SafetensorError, ValueError):
        return None
    if not torch.equal(stored.get("windows_BP", torch.empty(0)), windows_BP.cpu().long()):
        return None
    return CorpusMaxima(windows_BP.cpu().long(), stored["max_BM"], stored["argmax_BM"].long(), path, True)


def _write_atomically(path: Path, tensors: dict[str, Tensor]) -> None:
    """Writes to a temporary file and renames it: an interrupted write leaves no file under ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(temporary))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@torch.no_grad()
def corpus_maxima(model, unit: MLPUnit, n_windows: int = 256, window: int = 64, batch_size: int = 16,
                  progress: ProgressArg = False, use_disk: bool = True) -> CorpusMaxima:
    """Every neuron of ``unit``: its max activation in each corpus window and the position of that max,
    read from the disk cache when there (no forward pass), else computed ``batch_size`` windows at a
    time (``progress`` counts the windows) and saved.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> maxima.max_BM.shape, maxima.from_disk
        (torch.Size([16, 256]), False)
    """
    unit.width(model.cfg)
    windows_BP = neuron_corpus(model, n_windows, window).cpu().long()
    path = maxima_path(model, unit, windows_BP) if use_disk else None
    cached = _read_maxima(path, windows_BP) if path is not None and path.is_file() else None
    if cached is not None:
        return cached
    skip = 1 if model.bos_first() else 0  # BOS's activations are outliers, not evidence
    maxima, argmaxima = [], []
    with Progress(progress, total=windows_BP.shape[0], desc=f"{unit.label} over the corpus") as bar:
        for start in range(0, windows_BP.shape[0], batch_size):
            chunk_BP = windows_BP[start:start + batch_size].to(model.cfg.device)
            acts_BPM, _ = unit_activations(model, chunk_BP, unit)
            values_BM, where_BM = acts_BPM[:, skip:].nan_to_num(nan=-math.inf).max(dim=1)
            maxima.append(values_BM.cpu())
            argmaxima.append((where_BM + skip).cpu())
            bar.advance(chunk_BP.shape[0])
    result = CorpusMaxima(windows_BP, torch.cat(maxima), torch.cat(argmaxima), path, False)
    if path is None:
        return result
    try:
        _write_atomically(path, {"windows_BP": windows_BP, "max_BM": result.max_BM, "argmax_BM": result.argmax_BM.int()})
    except OSError:  # a read-only or full cache directory: the result stands, it is just not kept
        return dataclasses.replace(result, path=None)
    return result


def top_windows(model, maxima: CorpusMaxima, neuron: int, k: int = 10) -> pd.DataFrame:
    """The ``k`` windows where ``neuron`` peaks highest: DataFrame[rank, window, position, token,
    max_activation, text] (``position``: where in the window; ``text``: the whole window).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> top = top_windows(moe_model, maxima, neuron=17, k=3)
        >>> list(top.columns), top["rank"].tolist()
        (['rank', 'window', 'position', 'token', 'max_activation', 'text'], [1, 2, 3])
        >>> bool(top.max_activation.is_monotonic_decreasing)
        True
    """
    if not 0 <= neuron < maxima.max_BM.shape[1]:
        raise InputError(f"neuron must be in 0..{maxima.max_BM.shape[1] - 1}, got {neuron}")
    values_B = maxima.max_BM[:, neuron]
    ran = int(torch.isfinite(values_B).sum())
    top_values, top_windows_ = values_B.topk(min(k, ran))
    rows = []
    for rank, (value, w) in enumerate(zip(top_values.tolist(), top_windows_.tolist())):
        position = int(maxima.argmax_BM[w, neuron])
        window_tokens = str_tokens(model, maxima.windows_BP[w])
        rows.append({"rank": rank + 1, "window": w, "position": position, "token": window_tokens[position],
                     "max_activation": value, "text": "".join(window_tokens)})
    return pd.DataFrame(rows, columns=["rank", "window", "position", "token", "max_activation", "text"])


