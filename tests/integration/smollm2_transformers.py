"""`transformers`' own load of SmolLM2-135M from its GGUF (tokenizer and model), made once per test run.

The test files that compare against it (test_smollm2.py, test_tl_demos_smollm2.py) run on different
xdist workers. `transformers` converting the GGUF took 30-50 s of a loaded `make test` per file; the first
file to ask converts it and saves the result in the run's shared temporary folder, and the other reads
that folder back (3 s). What is saved is exactly what `transformers` made from the file, so every expected
value still comes from `transformers`.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock

from workbench.loading.registry import REGISTRY

GGUF = REGISTRY["smollm2-135m"].locate()


def _shared_folder(tmp_path_factory) -> Path:
    """The run's temporary folder all xdist workers share (one worker's own under plain pytest)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def smollm2_from_transformers(tmp_path_factory):
    """(tokenizer, model): `transformers` loading the shipped GGUF, float32, eval mode.

    `save_pretrained` refuses a model loaded from a GGUF, so the weights go to a safetensors file of their own
    and the config without its `quantization_config`; the reloaded model gives the same logits bit for bit.

    Example:
        >>> tokenizer, model = smollm2_from_transformers(tmp_path_factory)      # doctest: +SKIP
        >>> model.config.num_hidden_layers                                        # doctest: +SKIP
        30
    """
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    saved = _shared_folder(tmp_path_factory) / "smollm2-135m-transformers"
    with FileLock(f"{saved}.lock"):
        if not saved.exists():
            tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
            model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
            partial = saved.with_name(saved.name + ".partial")  # renamed when whole: a crash leaves no half folder
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            tokenizer.save_pretrained(partial)
            config = copy.deepcopy(model.config)
            del config.quantization_config
            config.save_pretrained(partial)
            save_model(model, str(partial / "model.safetensors"))  # tied embeddings stored once
            partial.rename(saved)
            return tokenizer, model.eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved), dtype=torch.float32)
    load_model(model, str(saved / "model.safetensors"))
    return AutoTokenizer.from_pretrained(saved), model.eval()
