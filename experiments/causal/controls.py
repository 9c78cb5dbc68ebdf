"""The random-init control for our models: TransformerLens's ``reinitialized``, name and signature kept.

``transformer_lens.tools.analysis.reinitialized`` resets every module with ``reset_parameters`` and
refuses any parameter none covers; our ``Decoder`` keeps its weights as plain parameters (``W_E``,
``_W_Q_lin``, norm gains), so it refuses ours, as it refuses a ``TransformerBridge``. This one builds
the same architecture untrained with our own initialisation (``Decoder.init_weights``: GPT-2's).
"""

from __future__ import annotations

import torch

from workbench import Decoder
from workbench.errors import InputError


def reinitialized(model, seed: int):
    """A copy of ``model``'s architecture with freshly initialised weights, in eval mode, on its device.

    ``model`` is not modified; options (attention kernel, dtype) and the tokenizer carry over.

    Example:
        >>> fresh = reinitialized(model, seed=0)
        >>> fresh.cfg.n_layers == model.cfg.n_layers, torch.equal(fresh.W_E, model.W_E)
        (True, False)
    """
    if not isinstance(model, Decoder):
        raise InputError(f"reinitialized needs a workbench Decoder; got {type(model).__name__} (for a "
                         "TransformerBridge use transformer_lens.tools.analysis.random_init_bridge)")
    parameter = next(model.parameters())
    with torch.random.fork_rng(devices=[]):  # seed only the CPU generator, restoring it afterwards
        torch.manual_seed(seed)
        fresh = Decoder(model.cfg, tokenizer=model.tokenizer)
    return fresh.to(device=parameter.device, dtype=parameter.dtype).eval()
