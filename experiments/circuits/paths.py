"""Path patching (Wang et al. 2022, the IOI paper's name-mover and S-inhibition analysis) on the edge graph.

Legend: B batch, P position, O circuit writers, I circuit readers.

The effect of a sender through the receivers' ``receiver_input`` only: the corrupted run in which the receivers'
query (key, value, MLP input) reads the sender's clean output and every other path carries the corrupted run's
values. Path patching from sender s to receivers R is patching the edges {s -> r<input> : r in R} together; each
sender is one variant of a stacked pass. Wang et al. run the other direction (the clean run with the sender's
corrupted output along the path); this is TransformerLens's denoising convention, as the rest of this package.
"""

from __future__ import annotations

from typing import Literal, Sequence, Union

import pandas as pd
import torch

from experiments._progress import ProgressArg
from experiments.circuits.exact import patched_values, patching_table
from experiments.circuits.graph import CircuitGraph, circuit_graph
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError

ReceiverInput = Literal["q", "k", "v", "mlp"]
NodeLike = Union[str, tuple[int, int]]


def _node(name: NodeLike) -> str:
    return f"a{name[0]}.h{name[1]}" if isinstance(name, tuple) else name


def path_readers(graph: CircuitGraph, receivers: Sequence[NodeLike], receiver_input: ReceiverInput) -> list[str]:
    """The reader of each receiver: a head's ``<q>``/``<k>``/``<v>``, an MLP's input, or ``logits`` as it is.

    Example:
        >>> path_readers(circuit_graph(model), [(1, 1), "logits"], "k")
        ['a1.h1<k>', 'logits']
    """
    if receiver_input not in ("q", "k", "v", "mlp"):
        raise InputError(f"receiver_input must be 'q', 'k', 'v' or 'mlp', got {receiver_input!r}")
    readers = []
    for receiver in map(_node, receivers):
        if receiver == "logits":
            readers.append(receiver)
        elif receiver.startswith("a"):
            if receiver_input == "mlp":
                raise InputError(f"receiver {receiver} is a head: receiver_input must be 'q', 'k' or 'v'")
            readers.append(f"{receiver}<{receiver_input}>")
        else:
            if receiver_input != "mlp":
                raise InputError(f"receiver {receiver} is an MLP: receiver_input must be 'mlp'")
            readers.append(receiver)
        graph.reader_index(readers[-1])
    return readers


@takes_pairs("circuits")
def path_patching(model, pairs: PairedPrompts, senders: Sequence[NodeLike] = (),
                  receivers: Sequence[NodeLike] = ("logits",), receiver_input: ReceiverInput = "q", *,
                  batch_size: int = 16, per_prompt: bool = False, progress: ProgressArg = False) -> pd.DataFrame:
    """Each sender's effect through the receivers' ``receiver_input`` alone: DataFrame[sender, metric, delta, normalized]
    (strongest |delta| first; attrs: the clean and corrupted metric).

    ``senders``: writers (``"a3.h0"`` or (3, 0), ``"m2"``, ``"input"``); every head when empty. ``receivers``: heads,
    MLPs or ``"logits"``; a sender only reaches receivers after it. ``pairs`` (or the older form) and the rest as
    ``edge_patching``.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, metric=logit_diff(model, " s", " and", 1))
        >>> table = path_patching(model, pairs, [(0, 0), (0, 1)], receivers=[(1, 1)], receiver_input="v")
        >>> sorted(table["sender"]), table.columns.tolist()
        (['a0.h0', 'a0.h1'], ['sender', 'metric', 'delta', 'normalized'])
    """
    graph = circuit_graph(model)
    readers = path_readers(graph, receivers, receiver_input)
    names = [_node(s) for s in senders] or [w for w in graph.writers if w.startswith("a")]
    masks = torch.zeros(len(names), 1, *graph.edge_mask.shape, dtype=torch.bool)
    for i, sender in enumerate(names):
        w = graph.writer_index(sender)
        for reader in readers:
            r = graph.reader_index(reader)
            masks[i, 0, w, r] = bool(graph.edge_mask[w, r])
    values, clean_R, corrupt_R = patched_values(model, graph, pairs, masks, batch_size, progress)
    table = patching_table(pd.DataFrame({"sender": names}), values, clean_R, corrupt_R, per_prompt)
    table.attrs.update(receivers=readers, receiver_input=receiver_input)
    return table
