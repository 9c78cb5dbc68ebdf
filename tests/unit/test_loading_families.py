"""The family contract (``workbench.loading.family``): every family module declares a ``Family``, and
registration refuses a module that breaks the contract, naming the module and what is wrong."""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from workbench.loading.hf import gpt2 as hf_gpt2, llama as hf_llama, loader as hf_loader
from workbench.loading.family import Family, FamilyError, check_family, register


def family_module(name: str, *families) -> ModuleType:
    """A stand-in family module: ``FAMILIES = families`` (none at all when no family is given)."""
    module = ModuleType(name)
    if families:
        module.FAMILIES = families
    return module


def model_config(hf_config, architecture):
    raise AssertionError("never called: registration only checks the contract")


def convert_tensors(ckpt, cfg, architecture):
    raise AssertionError("never called: registration only checks the contract")


def good(**changes) -> Family:
    fields = dict(architectures={"ToyForCausalLM": ("toy", "Toy")}, model_config=model_config,
                  convert_tensors=convert_tensors, ignored_tensors=re.compile(r".*inv_freq$"))
    return Family(**{**fields, **changes})


def test_every_family_module_declares_its_families():
    assert set(hf_loader.ARCHITECTURES) == {arch for module in hf_loader.FAMILY_MODULES
                                     for family in module.FAMILIES for arch in family.architectures}
    for module in hf_loader.FAMILY_MODULES:
        for family in module.FAMILIES:
            assert check_family(family, module.__name__) is family
    assert hf_loader.ARCHITECTURES["MixtralForCausalLM"] is hf_llama.FAMILIES[0]
    assert hf_loader.MODEL_TYPES["gpt2"] == "GPT2LMHeadModel"


def test_a_family_is_frozen_all_the_way_down():
    family = hf_gpt2.FAMILIES[0]
    with pytest.raises(AttributeError):
        family.model_config = None
    with pytest.raises(TypeError):
        family.architectures["NewForCausalLM"] = ("new", "New")


def test_a_good_stand_in_registers():
    family = good()
    assert register([family_module("workbench.loading.hf_toy", family)]) == {"ToyForCausalLM": family}


@pytest.mark.parametrize("field", ["model_config", "convert_tensors", "architectures", "ignored_tensors"])
def test_a_planted_family_with_a_missing_field_is_refused_by_name(field):
    planted = family_module("workbench.loading.hf_planted", good(**{field: None}))
    with pytest.raises(FamilyError, match=rf"^workbench\.loading\.hf_planted: family field '{field}' is missing"):
        register([planted])


def test_a_family_without_a_required_field_cannot_be_declared():
    with pytest.raises(TypeError, match="convert_tensors"):
        Family(architectures={"ToyForCausalLM": ("toy", "Toy")}, model_config=model_config)


@pytest.mark.parametrize("changes, message", [
    (dict(model_config=lambda hf_config: None), r"'model_config' cannot be called as model_config\(hf, architecture\)"),
    (dict(convert_tensors="convert"), r"'convert_tensors' is 'convert'; expected a callable \(ckpt, cfg, architecture\)"),
    (dict(ignored_tensors=r".*inv_freq$"), r"'ignored_tensors' is '\.\*inv_freq\$'; expected a compiled"),
    (dict(architectures={}), r"'architectures' is .*expected a non-empty"),
    (dict(architectures={"ToyForCausalLM": "toy"}), r"'architectures' has entry 'ToyForCausalLM': 'toy'"),
    (dict(architectures={"ToyForCausalLM": ("toy", "")}), r"'architectures' has entry 'ToyForCausalLM'"),
])
def test_a_wrong_field_is_refused_naming_module_and_field(changes, message):
    with pytest.raises(FamilyError, match=rf"^workbench\.loading\.hf_planted: family field {message}"):
        register([family_module("workbench.loading.hf_planted", good(**changes))])


def test_a_module_without_families_is_refused():
    with pytest.raises(FamilyError, match=r"^workbench\.loading\.hf_empty: no FAMILIES"):
        register([family_module("workbench.loading.hf_empty")])
    not_a_family = family_module("workbench.loading.hf_odd", {"ToyForCausalLM": ("toy", "Toy")})
    with pytest.raises(FamilyError, match=r"^workbench\.loading\.hf_odd: FAMILIES holds .* not a .*Family"):
        register([not_a_family])


def test_two_families_claiming_one_architecture_are_refused():
    clash = family_module("workbench.loading.hf.clash", good(architectures={"LlamaForCausalLM": ("toy", "Toy")}))
    with pytest.raises(FamilyError, match=r"^workbench\.loading\.hf\.clash: LlamaForCausalLM is already loaded by "
                                          r"workbench\.loading\.hf\.llama"):
        register([*hf_loader.FAMILY_MODULES, clash])


def test_two_architectures_claiming_one_model_type_are_refused():
    clash = family_module("workbench.loading.hf.clash", good(architectures={"ToyForCausalLM": ("llama", "Toy")}))
    with pytest.raises(FamilyError, match=r"hf\.clash: model_type 'llama' is already loaded by workbench\.loading\.hf\.llama"):
        register([hf_llama, clash])
