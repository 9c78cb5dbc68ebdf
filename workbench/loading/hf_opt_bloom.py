"""OPT and BLOOM in HF format.

Being written: the architectures below load once this module maps their config and tensors.
"""

from __future__ import annotations

import re

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.hf_checkpoint import SafetensorsCheckpoint
from workbench.loading.hf_common import HFConfig

# The architectures this module loads: {architecture: (model_type, models)}.
ARCHITECTURES: dict[str, tuple[str, str]] = {}

# Tensors in such checkpoints that are not parameters (buffers), never reported as unexpected.
IGNORED_TENSORS = re.compile(r"$^")


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    raise NotImplementedError(architecture)


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    raise NotImplementedError(architecture)
