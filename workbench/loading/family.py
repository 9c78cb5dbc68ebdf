"""The contract between ``hf/loader.py`` and a family module (``hf.gpt2``, ``hf.llama`` ...), and its registration.

A family module exports ``FAMILIES = (Family(...), ...)``: the architectures it loads, how it maps their
``config.json`` onto ``ModelConfig``, how it reads and renames their tensors, and which checkpoint tensors
are buffers to pass over. ``register`` checks every module against this contract when ``hf/loader.py`` builds
its table (when ``hf/loader.py`` is imported), so a family module that forgets a field, gives one of the wrong
kind or claims an architecture another module already loads is a ``FamilyError`` naming the module and
the field, not an ``AttributeError`` at the first load of that architecture.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, fields
from types import MappingProxyType, ModuleType
from typing import Callable, Iterable, Mapping

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig

# What a family needs to say about each architecture: transformers' model_type and the models it covers.
ArchitectureInfo = tuple[str, str]
# Tensors no checkpoint holds: no family ignores anything unless it says so.
NOTHING = re.compile(r"$^")


class FamilyError(TypeError):
    """A family module does not meet the ``Family`` contract (a bug in the module, not in a checkpoint)."""


@dataclass(frozen=True)
class Family:
    """What ``hf/loader.py`` reads from a family module, declared once.

    Attributes:
        architectures: {architecture as config.json names it: (model_type, the models it covers)}.
        model_config: ``(HFConfig, architecture) -> ModelConfig``; refuses values it cannot honour
            with a ``ConfigError`` naming the field.
        convert_tensors: ``(SafetensorsCheckpoint, ModelConfig, architecture) -> {our name: tensor}``;
            reads (``ckpt.take``) every tensor the model needs, checking each shape.
        ignored_tensors: names of checkpoint tensors that are not parameters (causal masks, RoPE's
            inverse frequencies): left unread without being reported as unexpected.

    Example:
        >>> from workbench.loading.hf import gpt2
        >>> family = gpt2.FAMILIES[0]
        >>> dict(family.architectures), bool(family.ignored_tensors.fullmatch("h.0.attn.bias"))
        ({'GPT2LMHeadModel': ('gpt2', 'GPT-2')}, True)
    """

    architectures: Mapping[str, ArchitectureInfo]
    model_config: Callable[[HFConfig, str], ModelConfig]
    convert_tensors: Callable[[SafetensorsCheckpoint, ModelConfig, str], dict[str, Tensor]]
    ignored_tensors: re.Pattern = NOTHING

    def __post_init__(self) -> None:
        if isinstance(self.architectures, dict):  # frozen all the way down: no one edits the table later
            object.__setattr__(self, "architectures", MappingProxyType(dict(self.architectures)))


# Each callable field and the arguments it is called with (names for the message only).
_CALLED_WITH = {"model_config": ("hf", "architecture"), "convert_tensors": ("ckpt", "cfg", "architecture")}


def check_family(family: object, module: str) -> Family:
    """``family`` if it meets the contract; otherwise a ``FamilyError`` naming ``module`` and the field.

    Example:
        >>> from workbench.loading.hf import gpt2
        >>> check_family(gpt2.FAMILIES[0], "workbench.loading.hf.gpt2") is gpt2.FAMILIES[0]
        True
        >>> check_family(Family({"XForCausalLM": ("x", "X")}, model_config=None, convert_tensors=len), "hf_x")
        Traceback (most recent call last):
        ...
        workbench.loading.family.FamilyError: hf_x: family field 'model_config' is missing (None); expected a callable (hf, architecture)
    """
    if not isinstance(family, Family):
        raise FamilyError(f"{module}: FAMILIES holds {family!r}, not a workbench.loading.family.Family")
    for field in fields(Family):
        if getattr(family, field.name) is None:
            expected = f"a callable ({', '.join(_CALLED_WITH[field.name])})" if field.name in _CALLED_WITH else \
                "a value"
            raise FamilyError(f"{module}: family field '{field.name}' is missing (None); expected {expected}")
    for name, arguments in _CALLED_WITH.items():
        _check_callable(getattr(family, name), module, name, arguments)
    if not isinstance(family.ignored_tensors, re.Pattern):
        raise FamilyError(f"{module}: family field 'ignored_tensors' is {family.ignored_tensors!r}; "
                          "expected a compiled regular expression (re.compile(...))")
    if not isinstance(family.architectures, Mapping) or not family.architectures:
        raise FamilyError(f"{module}: family field 'architectures' is {family.architectures!r}; "
                          "expected a non-empty {architecture: (model_type, models)}")
    for architecture, info in family.architectures.items():
        if not (isinstance(architecture, str) and architecture and isinstance(info, tuple) and len(info) == 2
                and all(isinstance(text, str) and text for text in info)):
            raise FamilyError(f"{module}: family field 'architectures' has entry {architecture!r}: {info!r}; "
                              "expected 'Architecture': ('model_type', 'models it covers')")
    return family


def _check_callable(function: object, module: str, name: str, arguments: tuple[str, ...]) -> None:
    """A ``FamilyError`` unless ``function`` can be called with ``arguments`` (positionally)."""
    if not callable(function):
        raise FamilyError(f"{module}: family field '{name}' is {function!r}; expected a callable "
                          f"({', '.join(arguments)})")
    try:
        inspect.signature(function).bind(*arguments)
    except TypeError as error:
        raise FamilyError(f"{module}: family field '{name}' cannot be called as {name}({', '.join(arguments)}): "
                          f"{error}") from error
    except ValueError:  # a builtin without a signature: trust it
        pass


def register(modules: Iterable[ModuleType]) -> dict[str, Family]:
    """{architecture: family} over every family of ``modules``, each checked against the contract.

    A module without ``FAMILIES``, a family that breaks the contract, or an architecture or
    model_type claimed twice is a ``FamilyError`` naming the module(s) and what is wrong.

    Example:
        >>> from workbench.loading.hf import gpt2, opt_bloom
        >>> sorted(register([gpt2, opt_bloom]))
        ['BloomForCausalLM', 'GPT2LMHeadModel', 'OPTForCausalLM']
    """
    table: dict[str, Family] = {}
    claimed: dict[str, str] = {}  # architecture or "model_type 'x'" -> the module that claimed it
    for module in modules:
        declared = getattr(module, "FAMILIES", None)
        if not isinstance(declared, tuple) or not declared:
            raise FamilyError(f"{module.__name__}: no FAMILIES (expected FAMILIES = (Family(...), ...), "
                              f"found {declared!r})")
        for family in declared:
            check_family(family, module.__name__)
            for architecture, (model_type, _) in family.architectures.items():
                for key in (architecture, f"model_type {model_type!r}"):
                    if key in claimed:
                        raise FamilyError(f"{module.__name__}: {key} is already loaded by {claimed[key]}; "
                                          "one family per architecture")
                    claimed[key] = module.__name__
                table[architecture] = family
    return table
