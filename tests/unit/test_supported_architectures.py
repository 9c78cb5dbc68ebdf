"""``wb.supported_architectures()``, ``workbench models --architectures``, the README's table, and the
refusal of checkpoints that are not decoder-only transformers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.cli import main

README = Path(__file__).resolve().parents[2] / "docs" / "guides" / "models-and-hooks.md"


def test_every_family_module_is_listed_once():
    table = wb.supported_architectures()
    assert not table.duplicated(["format", "architecture"]).any()
    hf = set(table[table.format == "HF directory"].architecture)
    assert {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "MixtralForCausalLM"} <= hf
    assert (table.models.str.len() > 0).all()


def test_each_hf_architecture_is_transformers_causal_lm_of_its_model_type():
    """An independent source for the table: transformers' own model_type -> causal-LM class map."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = wb.supported_architectures().query("format == 'HF directory'")
    # 25 families, then 7 older dense ones, 19 modern Llama-like ones, and 9 more MoE families, Llama 4, MiniCPM3,
    # DBRX, DiffLlama
    assert len(hf) == 25 + 7 + 19 + 13
    remote_code = {"InternLM3ForCausalLM"}  # hub configs for remote code transformers does not ship
    for architecture, model_type in zip(hf.architecture, hf.model_type):
        if architecture not in remote_code:
            assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) == architecture, (architecture, model_type)


def test_the_table_is_the_readme_table_row_for_row():
    """Every architecture, model_type and format the README lists, in its order, and nothing else."""
    cells = [[cell.strip().strip("`") for cell in line.strip("|").split("|")]
             for line in README.read_text().splitlines() if line.startswith(("| HF directory | `", "| GGUF | `"))]
    table = wb.supported_architectures()
    assert [tuple(row[:3]) for row in cells] == list(zip(table.format, table.architecture, table.model_type))


def test_cli_prints_the_architectures(capsys):
    assert main(["models", "--architectures"]) == 0
    printed = capsys.readouterr().out
    for architecture in wb.supported_architectures().architecture:
        assert architecture in printed


def test_readme_table_lists_every_architecture():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| HF directory | `")]
    listed = {match for line in rows for match in re.findall(r"`([A-Za-z0-9_]+(?:ForCausalLM|LMHeadModel))`", line)}
    hf = set(wb.supported_architectures().query("format == 'HF directory'").architecture)
    assert hf <= listed, f"README lacks {sorted(hf - listed)}"


@pytest.mark.parametrize("model_type, kind", [("mamba", "state-space"), ("t5", "encoder-decoder")])
def test_non_decoder_checkpoints_are_refused_by_name(tmp_path, model_type, kind):
    """Real checkpoints written by transformers, of models that are not decoder-only transformers."""
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

    small = dict(vocab_size=50, hidden_size=16, d_model=16, d_ff=32, num_layers=1, num_hidden_layers=1,
                 num_heads=2, d_kv=8, state_size=4)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in small.items() if hasattr(
        AutoConfig.for_model(model_type), k)})
    builder = AutoModelForSeq2SeqLM if model_type == "t5" else AutoModel
    model = builder.from_config(config)
    config.architectures = [type(model).__name__.replace("Model", "ForCausalLM") if model_type == "mamba"
                            else type(model).__name__]
    model.save_pretrained(tmp_path)
    with pytest.raises(wb.CheckpointError, match=rf"unknown architecture.*{kind}.*LlamaForCausalLM"):
        wb.load_model(tmp_path)
