"""Indirect-object-identification prompts in the style of Wang et al. 2022 ("When Mary and John went to the
store, John gave a drink to" -> " Mary"), each with a corrupted twin of the same token length, padded into
one batch with its attention mask.

Legend: B batch, P position.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from experiments.metrics import PromptBatch
from workbench.errors import InputError

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
        >>> data = ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"])   # one token each in the toy's tokenizer
        >>> data.clean_prompts[0]
        'When time and man got a snack at the cafe, man decided to give it to'
        >>> data.corrupt_prompts[0]                      # the subject's repeat swapped for the indirect object
        'When time and man got a snack at the cafe, time decided to give it to'
        >>> logits = model(data.clean_tokens, attention_mask=data.clean_mask)
        >>> logits[torch.arange(len(data)), data.answer_positions].shape   # each row's prediction of its answer
        torch.Size([4, 2048])
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
            >>> ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"]).answer_positions
            tensor([25, 23, 25, 27])
        """
        return PromptBatch(self.clean_tokens, self.clean_mask.bool()).last_positions

    def select(self, indices: Union[slice, Sequence[int], Tensor]) -> "IOIDataset":
        """The rows ``indices`` (a slice, or row numbers in the order wanted) as a dataset of their own.

        Token tensors keep the whole dataset's width and padding side, so row i of the result is
        row ``indices[i]`` unchanged (``experiments.distributed`` shards a dataset this way).

        Example:
            >>> data = ioi_dataset(model, 8, names=["man", "one", "two", "time", "they"])
            >>> data.select(slice(2, 4)).clean_prompts == data.clean_prompts[2:4]
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
            >>> ioi_dataset(model, 2, names=["man", "one", "two", "time", "they"]).to_frame().columns.tolist()
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
        >>> data = ioi_dataset(model, 20, seed=0, names=["man", "one", "two", "time", "they"])
        >>> data.to_frame()[["io", "s", "order"]].head(2)
             io     s order
        0  time   man  ABBA
        1  they  time  BABA
        >>> data.answer_tokens[0] == model.to_single_token(" " + data.io_names[0])
        tensor(True)
        >>> ioi_dataset(model, 2)            # the default names are several tokens each in the toy's tokenizer
        Traceback (most recent call last):
        ...
        workbench.errors.InputError: the 'swap_subject' corruption needs at least 3 single-token names, got 0: []
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

