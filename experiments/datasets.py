"""Datasets the experiments run on: IOI prompts, repeated random tokens, corpus windows, and the
references that mean and resample ablation replace activations with.

Legend: B batch, P position.

- ``ioi_dataset``: indirect-object-identification prompts in the style of Wang et al. 2022
  ("When Mary and John went to the store, John gave a drink to" -> " Mary"), each with a
  corrupted twin of the same token length, padded into one batch with its attention mask.
- ``repeated_random_tokens``: a prefix token then ``seq_len`` random tokens twice (induction).
- ``corpus_windows``: fixed-length token windows cut from text files or a list of texts.
- ``mean_activations``: the mean activation at each position over a batch of prompts, computed
  one batch at a time so the whole dataset's cache is never held.
- ``resample_reference``: a seeded draw of rows of a batch, for resample ablation.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.metrics import PromptBatch
from workbench.errors import InputError

__all__ = ["IOIDataset", "ioi_dataset", "IOI_TEMPLATES", "DEFAULT_NAMES", "IOI_ORDERS", "IOI_CORRUPTIONS",
           "repeated_random_tokens", "prefix_token", "corpus_windows", "mean_activations", "resample_reference"]

# ---- IOI ------------------------------------------------------------------------------------------
# A template holds {A} and {B}, the two names of the first clause in order, and {S}, the subject's
# repeat. It ends right before the indirect object, so the next token is " " + IO. ABBA fills
# A = IO, B = S; BABA fills A = S, B = IO. Lengths differ on purpose: a batch of them pads.
IOI_TEMPLATES: tuple[str, ...] = (
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
    "After {A} and {B} went to the market, {S} handed a basket to",
    "While {A} and {B} were working at the office, {S} gave a report to",
    "Then, {A} and {B} had a lot of fun at the school. {S} gave a book to",
    "When {A} and {B} got a snack at the cafe, {S} decided to give it to",
    "Friends {A} and {B} found a necklace at the beach. {S} gave it to",
    "After the lunch, {A} and {B} went to the garden. {S} gave a flower to",
    "Afterwards, {A} and {B} went to the restaurant. {S} gave a ring to",
    "When {A} and {B} arrived at the house, {S} threw the keys to",
    "Since {A} and {B} were cooking dinner together, {S} passed the salt to",
    "On Monday, {A} and {B} visited the museum, and {S} showed a painting to",
)

# Common English first names; ``ioi_dataset`` keeps those that are one token after a space in the
# model's tokenizer (a few, e.g. Chloe and Leah, split in some tokenizers and are dropped there).
DEFAULT_NAMES: tuple[str, ...] = (
    "Mary", "John", "Alice", "Bob", "James", "Michael", "David", "Sarah", "Emma", "Olivia",
    "Daniel", "Thomas", "Paul", "Mark", "Peter", "Laura", "Anna", "Kate", "Jack", "Tom",
    "Sam", "Max", "Ben", "Lucy", "Grace", "Rose", "Emily", "Jessica", "Jennifer", "Robert",
    "William", "Richard", "Charles", "Joseph", "Andrew", "George", "Henry", "Edward", "Frank", "Kevin",
    "Brian", "Jason", "Eric", "Adam", "Ryan", "Rachel", "Amy", "Lisa", "Helen", "Susan",
    "Sophie", "Hannah", "Chloe", "Leah",
)

IOI_ORDERS: tuple[str, ...] = ("ABBA", "BABA")
IOI_CORRUPTIONS: tuple[str, ...] = ("swap_subject", "abc")
_SLOTS = frozenset({"A", "B", "S"})
_MIN_NAMES = {"swap_subject": 3, "abc": 5}  # abc needs three names besides IO and S


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field by field has no single truth value
class IOIDataset:
    """IOI prompts, their corrupted twins and the answers, one row per prompt.

    ``clean_tokens``/``corrupt_tokens`` [batch, pos] are padded on the side the dataset was built
    with; the masks say which positions are real (1) or pads (0). A corrupted prompt has the same
    token length as its clean prompt, so a row's positions line up for patching.
    ``answer_tokens`` are the indirect objects' ids (" " + IO), ``wrong_tokens`` the subjects'.

    Example:
        >>> data = ioi_dataset(model, 4)                                # doctest: +SKIP
        >>> data.clean_prompts[0]                                       # doctest: +SKIP
        'When Mary and John went to the store, John gave a drink to'
        >>> logits = model(data.clean_tokens, attention_mask=data.clean_mask)   # doctest: +SKIP
        >>> last = logits[torch.arange(len(data)), data.answer_positions]      # doctest: +SKIP
    """

    clean_prompts: list[str]
    corrupt_prompts: list[str]
    clean_tokens: Int[Tensor, "batch pos"]
    clean_mask: Int[Tensor, "batch pos"]
    corrupt_tokens: Int[Tensor, "batch pos"]
    corrupt_mask: Int[Tensor, "batch pos"]
    answer_tokens: Int[Tensor, "batch"]
    wrong_tokens: Int[Tensor, "batch"]
    orders: list[str]
    io_names: list[str]
    s_names: list[str]
    templates: list[str]
    corruption: str

    def __len__(self) -> int:
        return len(self.clean_prompts)

    @property
    def answer_positions(self) -> Int[Tensor, "batch"]:
        """Each row's last real token, where the model predicts the answer (right padding: its
        length - 1; left padding: pos - 1).

        Example:
            >>> data.answer_positions                                   # doctest: +SKIP
            tensor([14, 13, 16, 16])
        """
        return PromptBatch(self.clean_tokens, self.clean_mask.bool()).last_positions

    def select(self, indices: Union[slice, Sequence[int], Tensor]) -> "IOIDataset":
        """The rows ``indices`` (a slice, or row numbers in the order wanted) as a dataset of their own.

        Token tensors keep the whole dataset's width and padding side, so row i of the result is
        row ``indices[i]`` unchanged (``experiments.distributed`` shards a dataset this way).

        Example:
            >>> ioi_dataset(model, 8).select(slice(2, 4)).clean_prompts == ioi_dataset(model, 8).clean_prompts[2:4]   # doctest: +SKIP
            True
        """
        n = len(self)
        rows = list(range(n))[indices] if isinstance(indices, slice) else [int(i) for i in indices]
        if not rows or not all(-n <= i < n for i in rows):
            raise InputError(f"select needs row numbers in 0..{n - 1} (at least one), got {indices!r}")
        rows = [i % n for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.clean_tokens.device)
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        return IOIDataset(
            clean_prompts=pick(self.clean_prompts), corrupt_prompts=pick(self.corrupt_prompts),
            clean_tokens=self.clean_tokens[index], clean_mask=self.clean_mask[index],
            corrupt_tokens=self.corrupt_tokens[index], corrupt_mask=self.corrupt_mask[index],
            answer_tokens=self.answer_tokens[index], wrong_tokens=self.wrong_tokens[index],
            orders=pick(self.orders), io_names=pick(self.io_names), s_names=pick(self.s_names),
            templates=pick(self.templates), corruption=self.corruption)

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt: text, corrupt, io, s, order, template (for display).

        Example:
            >>> ioi_dataset(model, 2).to_frame().columns.tolist()      # doctest: +SKIP
            ['text', 'corrupt', 'io', 's', 'order', 'template']
        """
        return pd.DataFrame({"text": self.clean_prompts, "corrupt": self.corrupt_prompts, "io": self.io_names,
                             "s": self.s_names, "order": self.orders, "template": self.templates})


def ioi_dataset(model, n: int, seed: int = 0, names: Optional[Sequence[str]] = None,
                templates: Optional[Sequence[str]] = None, orders: Sequence[str] = IOI_ORDERS,
                corruption: str = "swap_subject", padding_side: str = "right") -> IOIDataset:
    """``n`` IOI prompts with corrupted twins, tokenized and padded into one batch.

    Row i has order ``orders[i % len(orders)]`` (so ABBA and BABA alternate), a template drawn
    from ``templates`` (default ``IOI_TEMPLATES``) and two different names drawn from ``names``
    (default: the ``DEFAULT_NAMES`` that are one token after a space), all from
    ``random.Random(seed)``: the same seed gives the same dataset.

    Corruptions: "swap_subject" replaces the subject's repeat by the IO name (the corrupted answer
    flips to S, TransformerLens's patching demo); "abc" fills all three name slots with three
    other names, distinct from IO and S.

    Raises ``InputError`` for a model without a tokenizer, a name that is not one token after a
    space (its pieces are shown), fewer names than the corruption needs (3, or 5 for "abc"),
    an unknown order or corruption, a template without exactly one {A}, {B} and {S} each after a
    space, or n < 1.

    Example:
        >>> data = ioi_dataset(model, 20, seed=0)                     # doctest: +SKIP
        >>> data.to_frame().head(2)                                     # doctest: +SKIP
        >>> data.answer_tokens[0] == model.to_single_token(" " + data.io_names[0])   # doctest: +SKIP
        tensor(True)
    """
    if model.tokenizer is None:
        raise InputError("ioi_dataset needs a model with a tokenizer: the prompts are text")
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive number of prompts, got {n!r}")
    if corruption not in IOI_CORRUPTIONS:
        raise InputError(f"unknown corruption {corruption!r}; choose one of {list(IOI_CORRUPTIONS)}")
    if padding_side not in ("right", "left"):
        raise InputError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    orders = _checked_orders(orders)
    templates = _checked_templates(IOI_TEMPLATES if templates is None else templates)
    names = _single_token_names(model, names)
    if len(names) < _MIN_NAMES[corruption]:
        raise InputError(f"the {corruption!r} corruption needs at least {_MIN_NAMES[corruption]} single-token names, "
                         f"got {len(names)}: {names}")

    rng = random.Random(seed)
    rows = [_draw_row(rng, orders[i % len(orders)], templates, names, corruption) for i in range(n)]
    clean = [row["clean"] for row in rows]
    corrupt = [row["corrupt"] for row in rows]
    clean_tokens, clean_mask = model.to_tokens_and_mask(clean, padding_side=padding_side)
    corrupt_tokens, corrupt_mask = model.to_tokens_and_mask(corrupt, padding_side=padding_side)
    _check_equal_lengths(clean, corrupt, clean_mask, corrupt_mask)
    device = clean_tokens.device
    return IOIDataset(
        clean_prompts=clean, corrupt_prompts=corrupt,
        clean_tokens=clean_tokens, clean_mask=clean_mask, corrupt_tokens=corrupt_tokens, corrupt_mask=corrupt_mask,
        answer_tokens=torch.tensor([model.to_single_token(" " + r["io"]) for r in rows], device=device),
        wrong_tokens=torch.tensor([model.to_single_token(" " + r["s"]) for r in rows], device=device),
        orders=[r["order"] for r in rows], io_names=[r["io"] for r in rows], s_names=[r["s"] for r in rows],
        templates=[r["template"] for r in rows], corruption=corruption)


def _checked_orders(orders: Sequence[str]) -> list[str]:
    """``orders`` as a list (a lone string is one order), each "ABBA" or "BABA"."""
    orders = [orders] if isinstance(orders, str) else list(orders)
    unknown = [order for order in orders if order not in IOI_ORDERS]
    if not orders or unknown:
        raise InputError(f"unknown IOI order(s) {unknown or orders}; orders must be drawn from {list(IOI_ORDERS)}")
    return orders


def _checked_templates(templates: Sequence[str]) -> list[str]:
    """Templates with exactly one {A}, {B} and {S}, each after a space, not ending in whitespace.

    The space matters: names are checked as " " + name, so a slot elsewhere (at the start, after
    a bracket) could tokenize differently and break the equal-length promise.
    """
    templates = [templates] if isinstance(templates, str) else list(templates)
    if not templates:
        raise InputError("templates is empty: give at least one IOI template")
    for template in templates:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
        if sorted(fields) != sorted(_SLOTS):
            raise InputError(f"IOI template {template!r} must hold {{A}}, {{B}} and {{S}} exactly once each "
                             f"and no other field; it has {fields}")
        if any(f" {{{slot}}}" not in template for slot in _SLOTS):
            raise InputError(f"IOI template {template!r}: each of {{A}}, {{B}}, {{S}} must follow a space "
                             "(names are single tokens only as ' ' + name)")
        if template != template.rstrip():
            raise InputError(f"IOI template {template!r} ends in whitespace; it must end right before "
                             "the indirect object, whose token carries the space")
    return templates


def _single_token_names(model, names: Optional[Sequence[str]]) -> list[str]:
    """The names that are one token after a space: the defaults filtered, or the user's checked."""
    if names is None:
        return [name for name in DEFAULT_NAMES if len(_pieces(model, name)) == 1]
    names = list(dict.fromkeys([names] if isinstance(names, str) else names))  # drop repeats, keep order
    split = {name: _pieces(model, name) for name in names}
    bad = {name: pieces for name, pieces in split.items() if len(pieces) != 1}
    if bad:
        shown = "; ".join(f"{name!r} -> {pieces}" for name, pieces in bad.items())
        raise InputError(f"IOI names must each be one token after a space; these are not: {shown}")
    return names


def _pieces(model, name: str) -> list[str]:
    """How " " + name tokenizes, as token strings (no BOS)."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"IOI names must be non-empty strings, got {name!r}")
    return model.to_str_tokens(" " + name, prepend_bos=False)


def _draw_row(rng: random.Random, order: str, templates: list[str], names: list[str], corruption: str) -> dict:
    """One prompt and its corruption: a template and names drawn from ``rng``."""
    template = rng.choice(templates)
    io, s = rng.sample(names, 2)
    first, second = (io, s) if order == "ABBA" else (s, io)
    clean = template.format(A=first, B=second, S=s)
    if corruption == "swap_subject":
        corrupt = template.format(A=first, B=second, S=io)
    else:
        a, b, c = rng.sample([name for name in names if name not in (io, s)], 3)
        corrupt = template.format(A=a, B=b, S=c)
    return {"clean": clean, "corrupt": corrupt, "io": io, "s": s, "order": order, "template": template}


def _check_equal_lengths(clean: list[str], corrupt: list[str], clean_mask: Tensor, corrupt_mask: Tensor) -> None:
    """Every corrupted prompt has its clean prompt's token length (positions must line up for patching)."""
    clean_len, corrupt_len = clean_mask.sum(1).tolist(), corrupt_mask.sum(1).tolist()
    for row, (a, b) in enumerate(zip(clean_len, corrupt_len)):
        if a != b:
            raise InputError(f"IOI row {row}: the corrupted prompt has {b} tokens but the clean one {a}; "
                             f"clean {clean[row]!r}, corrupt {corrupt[row]!r} (a name merges with its neighbours)")


# ---- repeated random tokens (induction) -----------------------------------------------------------
def prefix_token(model) -> int:
    """BOS when the model's tokenizer has one, else token 0.

    Example:
        >>> prefix_token(model_without_tokenizer)   # doctest: +SKIP
        0
    """
    bos = model.tokenizer.bos_token_id if model.tokenizer is not None else None
    return int(bos) if bos is not None else 0


def repeated_random_tokens(model, seq_len: int = 50, batch: int = 10, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """[batch, 1 + 2*seq_len] ids: a prefix token, then seq_len random tokens twice.

    Tokens are drawn without replacement within a copy (and never equal the prefix), from a
    generator seeded with ``seed``, so the result depends only on (d_vocab, prefix, seq_len, batch, seed).

    Example:
        >>> tokens = repeated_random_tokens(model, seq_len=5, batch=2)   # doctest: +SKIP
        >>> torch.equal(tokens[:, 1:6], tokens[:, 6:])                   # doctest: +SKIP
        True
    """
    d_vocab, prefix = model.cfg.d_vocab, prefix_token(model)
    if seq_len < 1 or batch < 1:
        raise InputError(f"seq_len and batch must be positive, got seq_len={seq_len}, batch={batch}")
    if seq_len > d_vocab - 1:
        raise InputError(f"seq_len={seq_len} distinct tokens do not fit a vocabulary of {d_vocab} (prefix excluded)")
    if 1 + 2 * seq_len > model.cfg.n_ctx:
        raise InputError(f"1 + 2*seq_len = {1 + 2 * seq_len} positions exceed the model's context (n_ctx={model.cfg.n_ctx})")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        draw = torch.randperm(d_vocab - 1, generator=generator)[:seq_len]
        rows.append(draw + (draw >= prefix).long())  # skip the prefix id
    copy_BC = torch.stack(rows)
    tokens = torch.cat([torch.full((batch, 1), prefix, dtype=torch.long), copy_BC, copy_BC], dim=1)
    return tokens.to(model.cfg.device)


# ---- corpus windows -------------------------------------------------------------------------------
def corpus_windows(model, source: Union[str, Path, Sequence[str]], window: int = 128, stride: Optional[int] = None,
                   max_windows: Optional[int] = None, pattern: str = "*.txt") -> Int[Tensor, "n_windows window"]:
    """Fixed-length windows of token ids cut from a corpus.

    ``source``: a text file, a directory (every file matching ``pattern`` below it, recursively,
    in sorted path order, read as UTF-8), or a list of texts (a lone string is a path, never text).

    The rule: each document is tokenized without BOS; documents are joined into one stream with
    the EOS token between them (when the tokenizer has one). When the model prepends BOS
    (``model.bos_first()``), every window is BOS followed by ``window - 1`` stream tokens;
    otherwise ``window`` stream tokens. Windows start every ``stride`` stream tokens (default:
    the window's stream length, so windows neither overlap nor skip); a tail shorter than a
    window is dropped; ``max_windows`` keeps the first ones.

    Raises ``InputError`` for a missing path, a directory with no file matching ``pattern``, an
    empty text, a corpus shorter than one window, a window longer than the model's context,
    and non-positive window, stride or max_windows.

    Example:
        >>> windows = corpus_windows(model, "notes/", window=64, pattern="*.md")   # doctest: +SKIP
        >>> windows.shape                                                           # doctest: +SKIP
        torch.Size([210, 64])
    """
    if model.tokenizer is None:
        raise InputError("corpus_windows needs a model with a tokenizer: the corpus is text")
    bos = model.bos_first()
    stream_len = window - 1 if bos else window  # stream tokens per window
    _check_window(model, window, stream_len, bos)
    stride = stream_len if stride is None else stride
    if stride < 1:
        raise InputError(f"stride must be at least 1, got {stride}")
    if max_windows is not None and max_windows < 1:
        raise InputError(f"max_windows must be at least 1 (or None for all), got {max_windows}")

    stream = _token_stream(model, _documents(source, pattern))
    if stream.numel() < stream_len:
        raise InputError(f"the corpus has {stream.numel()} tokens, fewer than one window of {window} "
                         f"({stream_len} text tokens{' after BOS' if bos else ''})")
    windows = stream.unfold(0, stream_len, stride)[:max_windows]
    if bos:
        first = torch.full((windows.shape[0], 1), model.tokenizer.bos_token_id, dtype=windows.dtype)
        windows = torch.cat([first, windows], dim=1)
    return windows.contiguous().to(model.cfg.device)


def _check_window(model, window: int, stream_len: int, bos: bool) -> None:
    """A window holds at least one text token and fits the model's context (when it has a limit)."""
    if stream_len < 1:
        raise InputError(f"window must hold at least one text token: got window={window}"
                         f"{' (one position is BOS)' if bos else ''}")
    limit = model.cfg.context_limit
    if limit is not None and window > limit:
        raise InputError(f"window={window} is longer than the model's context (n_ctx={limit})")


def _documents(source: Union[str, Path, Sequence[str]], pattern: str) -> list[tuple[str, str]]:
    """(name, text) of each document: a file, the files of a directory, or a list of texts."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not files:
                raise InputError(f"no file matching {pattern!r} under the directory {path}")
        else:
            raise InputError(f"no such file or directory: {path} (to pass text itself, give a list of texts)")
        documents = [(str(p), _read_utf8(p)) for p in files]
    else:
        documents = [(f"text {i}", text) for i, text in enumerate(source)]
        if not documents:
            raise InputError("the list of texts is empty")
    for name, text in documents:
        if not isinstance(text, str):
            raise InputError(f"{name} is a {type(text).__name__}, not a string")
        if not text.strip():
            raise InputError(f"{name} is empty (no text to tokenize)")
    return documents


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text: {error}") from None


def _token_stream(model, documents: list[tuple[str, str]]) -> Int[Tensor, "stream"]:
    """The documents' tokens (no BOS) on the CPU, joined with EOS when the tokenizer has one."""
    eos = model.tokenizer.eos_token_id
    pieces = []
    for index, (_, text) in enumerate(documents):
        if index and eos is not None:
            pieces.append(torch.tensor([eos], dtype=torch.long))
        pieces.append(model.to_tokens(text, prepend_bos=False)[0].cpu())
    return torch.cat(pieces)


# ---- references for ablation ----------------------------------------------------------------------
@torch.no_grad()
def mean_activations(model, tokens_BP: Int[Tensor, "batch pos"], hook_names: Union[str, Sequence[str]],
                     batch_size: int = 8, progress: ProgressArg = False,
                     attention_mask: Optional[Int[Tensor, "batch pos"]] = None) -> dict[str, Tensor]:
    """The mean over rows of each hook point's activation at each position, [1, pos, ...].

    The shape a mean ablation writes: a batch of one that broadcasts over any batch
    (``blocks.{l}.attn.hook_pattern`` gives [1, n_heads, pos, key_pos]). Computed streaming: the
    model runs ``batch_size`` rows at a time and hooks add each batch's sum into a float64
    running sum, so memory holds one batch's activations and the sums, never the whole cache.
    With ``attention_mask`` (1 real, 0 pad) a row counts at a position only where that position
    is real in it; a position no row has real is zeros. Results come back on the model's device
    in the dtype the hook point carries (the model's dtype). ``progress`` counts batches.

    Example:
        >>> means = mean_activations(model, corpus_windows(model, texts, 64), ["blocks.3.attn.hook_z"])   # doctest: +SKIP
        >>> means["blocks.3.attn.hook_z"].shape                                                          # doctest: +SKIP
        torch.Size([1, 64, 9, 64])
    """
    names = [hook_names] if isinstance(hook_names, str) else list(hook_names)
    if not names:
        raise InputError("hook_names is empty: name at least one hook point")
    model.check_hook_names(names)
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    tokens_BP, given_mask_BP = model.as_tokens_and_mask(tokens_BP, attention_mask=attention_mask)
    B, P = tokens_BP.shape
    # Without a mask every row counts everywhere; the model then runs unmasked (its fastest path).
    mask_BP = given_mask_BP if given_mask_BP is not None else torch.ones(B, P, dtype=torch.bool,
                                                                         device=tokens_BP.device)

    sums: dict[str, Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    current: dict[str, Tensor] = {}  # the running batch's mask, read by the hooks

    def accumulate(activation: Tensor, hook) -> None:
        if not activation.is_floating_point():
            raise InputError(f"{hook.name} carries {activation.dtype} values (ids, not activations); it has no mean")
        keep = _broadcast_over(current["mask"], hook.name, activation.ndim)
        # where, not multiply: attention scores hold -inf, and -inf * 0 would be nan.
        batch_sum = torch.where(keep, activation, 0).sum(0, keepdim=True, dtype=_sum_dtype(activation))
        sums[hook.name] = batch_sum if hook.name not in sums else sums[hook.name] + batch_sum
        dtypes[hook.name] = activation.dtype

    with Progress(progress, total=-(-B // batch_size), desc="mean activations") as bar, \
            model.hooks(fwd_hooks=[(name, accumulate) for name in names]):
        for start in range(0, B, batch_size):
            rows = slice(start, start + batch_size)
            current["mask"] = mask_BP[rows]
            model(tokens_BP[rows], return_type=None,
                  attention_mask=None if given_mask_BP is None else given_mask_BP[rows])
            bar.advance()

    silent = [name for name in names if name not in sums]
    if silent:
        raise InputError(f"hook point(s) {silent} did not fire in a forward pass (a hook point the model "
                         "computes only when switched on, e.g. hook_q_input needs set_use_split_qkv_input(True))")
    count_P = mask_BP.sum(0)  # real rows at each position
    means = {}
    for name in names:
        count = _broadcast_over(count_P[None], name, sums[name].ndim).to(sums[name].dtype)
        mean = torch.where(count > 0, sums[name] / count.clamp(min=1), 0)
        means[name] = mean.to(device=model.cfg.device, dtype=dtypes[name])
    return means


def _position_axis(hook_name: str) -> int:
    """Where the (query) position axis is: attention scores and patterns are [batch, n_heads, pos, key_pos]."""
    return 2 if hook_name.endswith(("hook_pattern", "hook_attn_scores")) else 1


def _broadcast_over(values_BP: Tensor, hook_name: str, ndim: int) -> Tensor:
    """A [batch, pos] tensor shaped to broadcast against an activation of ``ndim`` axes at ``hook_name``."""
    axis = _position_axis(hook_name)
    shape = [values_BP.shape[0]] + [1] * (ndim - 1)
    shape[axis] = values_BP.shape[1]
    return values_BP.reshape(shape)


def _sum_dtype(activation: Tensor) -> torch.dtype:
    """float64 for the running sums (exact enough over any dataset), float32 where the device has no float64."""
    return torch.float32 if activation.device.type == "mps" else torch.float64


def resample_reference(tokens_BP: Int[Tensor, "batch pos"], n: int, seed: int = 0) -> Int[Tensor, "n_rows pos"]:
    """``n`` rows drawn from ``tokens_BP`` (without replacement when n <= rows, with it otherwise),
    the same rows for the same seed: the reference batch of a resample ablation.

    Example:
        >>> resample_reference(torch.arange(12).reshape(4, 3), 2, seed=0).shape
        torch.Size([2, 3])
    """
    if not isinstance(tokens_BP, Tensor) or tokens_BP.ndim != 2 or tokens_BP.shape[0] < 1:
        shape = tuple(tokens_BP.shape) if isinstance(tokens_BP, Tensor) else type(tokens_BP).__name__
        raise InputError(f"resample_reference takes token ids [batch, pos] with at least one row, got {shape}")
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive number of rows, got {n!r}")
    rows = tokens_BP.shape[0]
    generator = torch.Generator().manual_seed(seed)
    if n <= rows:
        index = torch.randperm(rows, generator=generator)[:n]
    else:
        index = torch.randint(rows, (n,), generator=generator)
    return tokens_BP[index.to(tokens_BP.device)]
