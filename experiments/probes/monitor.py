"""A probe as a monitor: its score at every token the model reads, during a forward pass or ``generate``.

Legend: B batch, P position, i d_in.

``probe_monitor`` attaches one read-only hook for the length of a ``with`` block (removed on exit, also after an
error) and records the probe's score of each position each forward call feeds; under ``generate``'s KV cache
the first call feeds the prompt and each later call the newest token, so the recorded scores line up with the
tokens of the whole sequence.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from experiments.probes.fit import LinearProbe
from workbench.errors import InputError


@dataclass
class MonitorLog:
    """The scores a monitor recorded: one [B, P] tensor per forward call, in order, and the flag threshold."""

    threshold: float
    calls: list[Tensor] = field(default_factory=list)

    def scores(self) -> Float[Tensor, "B P"]:
        """Every recorded position's score, the calls joined along positions.

        >>> MonitorLog(0.0, [torch.ones(1, 2), torch.zeros(1, 1)]).scores().tolist()
        [[1.0, 1.0, 0.0]]
        """
        if not self.calls:
            raise InputError("the monitor recorded nothing: run the model inside its `with` block")
        return torch.cat(self.calls, dim=1)

    def flagged(self) -> Bool[Tensor, "B P"]:
        """The positions whose score is above the threshold.

        >>> MonitorLog(0.5, [torch.tensor([[0.2, 0.9]])]).flagged().tolist()
        [[False, True]]
        """
        return self.scores() > self.threshold


@contextmanager
def probe_monitor(model, probe: LinearProbe, hook_name: str, threshold: float = 0.0) -> Iterator[MonitorLog]:
    """Record a two-class probe's score (log-odds) at ``hook_name`` for every token read inside the block.

    >>> import experiments.probes as probes
    >>> acts = probes.probe_activations(model, ["import os", "the cat"] * 2, ["blocks.0.hook_resid_post"],
    ...                                 progress=False)["blocks.0.hook_resid_post"]
    >>> probe = probes.fit_mass_mean(acts, torch.tensor([0, 1, 0, 1]))
    >>> with probe_monitor(model, probe, "blocks.0.hook_resid_post") as log:
    ...     _ = model.generate("import os", 3, verbose=False)
    >>> log.scores().shape[1] == len(model.to_tokens("import os")[0]) + 2   # the prompt, then one per new token
    True
    """
    if not isinstance(probe, LinearProbe) or len(probe.classes) != 2:
        raise InputError("probe_monitor needs a two-class LinearProbe (its score is the log-odds of the second class)")
    model.check_hook_names([hook_name])
    log = MonitorLog(float(threshold))

    def record(activation: Tensor, hook: object) -> None:
        B, P = activation.shape[:2]
        rows_Ni = activation.detach().reshape(B * P, -1).float()
        log.calls.append(probe.score(rows_Ni).reshape(B, P))

    with model.hooks(fwd_hooks=[(hook_name, record)]):
        yield log
