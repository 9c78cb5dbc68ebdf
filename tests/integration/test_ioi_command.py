"""``python -m experiments.ioi`` on the real SmolLM2-135M: the dataset-level IOI numbers it writes equal
each prompt run alone, and the pretrained model does the task (the IO name beats the subject).

The expected per-prompt logit differences come from running each prompt's text by itself
(``model(text)``, no padding, no mask) and reading logits[IO] - logits[S] at its last token.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

import workbench as wb
from experiments.cli import ioi
from experiments.datasets import ioi_dataset

pytestmark = pytest.mark.slow  # the real SmolLM2
N, SEED = 2, 1  # two prompts of different lengths (16 and 17 tokens): the batch is padded


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2


def test_ioi_command_writes_the_dataset_numbers_each_prompt_gives_alone(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("experiments._cli.load", lambda args: model)
    ioi.main(["--n", str(N), "--seed", str(SEED), "--out", str(tmp_path), "--no-progress", "--top-k", "3"])
    for stem in ("ioi_prompts", "ioi_logit_diff", "ioi_head_patching"):
        for kind in ("csv", "json", "html"):
            assert (tmp_path / f"{stem}.{kind}").stat().st_size > 0
    data = ioi_dataset(model, N, seed=SEED)
    assert len(set(data.clean_mask.sum(1).tolist())) > 1  # the prompts differ in length: the batch is padded
    per_prompt = pd.read_csv(tmp_path / "ioi_logit_diff.csv")
    with torch.no_grad():
        for row, text in enumerate(data.clean_prompts):
            last = model(text)[0, -1]
            alone = float(last[data.answer_tokens[row]] - last[data.wrong_tokens[row]])
            assert per_prompt.clean[row] == pytest.approx(alone, abs=1e-4)
    summary = json.loads((tmp_path / "ioi_head_patching.json").read_text())
    assert summary["mean_logit_diff_clean"] == pytest.approx(per_prompt.clean.mean(), abs=1e-5)
    assert summary["mean_logit_diff_clean"] > 0 > summary["mean_logit_diff_corrupt"]  # the model does IOI
    heads = pd.read_csv(tmp_path / "ioi_head_patching.csv")
    assert len(heads) == model.cfg.n_layers * model.cfg.n_heads
    assert len(summary["top_heads"]) == 3
    assert summary["top_heads"][0]["normalized"] == pytest.approx(heads.normalized.max(), abs=1e-6)
    assert "top heads" in capsys.readouterr().out
