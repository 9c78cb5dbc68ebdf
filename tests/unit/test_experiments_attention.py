"""Attention patterns, per-head statistics, figures, and every ``python -m experiments.X`` command.

References: the patterns TransformerLens's ``run_with_cache`` records, hand-computed statistics
of hand-written patterns, and the files each command writes.
"""

import json
import math

import pandas as pd
import pytest
import tokenizers
import torch

import workbench as wb
from experiments.attention import attention_patterns, head_summary
from experiments.cli import ablation, attention, detectors, heads, induction, lens, patching, router
from experiments.plots.attention import layer_patterns_figure, pattern_figure, pattern_grid_figure
from experiments.plots.common import scores_heatmap
from tests.unit.helpers import make_model
from workbench.tokenizer import SpecialTokens, Tokenizer

WORDS = ("When Mary and John went to the store , gave a drink . The cat sat on mat").split()


def word_tokenizer() -> Tokenizer:
    vocab = {"<bos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, SpecialTokens(bos_token="<bos>", prepend_bos=True))


def test_patterns_are_the_cached_patterns_of_batch_item_0():
    model = make_model("gqa_rotary_rms_swiglu")  # sdpa: hooked layers run eager
    tokens = torch.randint(0, 61, (2, 7))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    expected = torch.stack([cache["pattern", l][0] for l in range(2)])
    torch.testing.assert_close(attention_patterns(model, tokens), expected)
    torch.testing.assert_close(attention_patterns(model, tokens[0]), expected)  # [pos] works too


def test_head_summary_of_hand_written_patterns():
    Q = 4
    uniform = torch.tril(torch.ones(Q, Q))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    previous = torch.zeros(Q, Q)
    previous[0, 0] = 1
    previous[torch.arange(1, Q), torch.arange(Q - 1)] = 1
    patterns = torch.stack([uniform, previous])[None]  # [1 layer, 2 heads, Q, Q]
    df = head_summary(patterns, tokens=torch.tensor([9, 8, 9, 9]))
    assert list(df.columns) == ["layer", "head", "entropy", "bos_attention", "prev_token_share", "mean_distance",
                                "duplicate_token_share"]
    u, p = df.iloc[0], df.iloc[1]
    assert u.entropy == pytest.approx(sum(math.log(q + 1) for q in range(Q)) / Q)
    assert u.bos_attention == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / Q)
    assert u.prev_token_share == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert u.mean_distance == pytest.approx((0 + 0.5 + 1 + 1.5) / Q)  # mean of q/2
    assert p.entropy == pytest.approx(0) and p.prev_token_share == pytest.approx(1)
    assert p.mean_distance == pytest.approx(3 / 4)
    assert p.duplicate_token_share == pytest.approx(1 / 4)  # only query 3 (token 9) looks at an earlier 9
    assert u.duplicate_token_share == pytest.approx((1 / 3 + 2 / 4) / Q)


def test_figures_have_labels_and_values():
    model = make_model("mha_learned_ln")
    tokens = torch.randint(0, 61, (1, 5))
    patterns = attention_patterns(model, tokens)
    labels = ["a", "b", "a", "c", "d"]  # repeated labels stay separate positions
    fig = pattern_figure(patterns[1, 2], labels, "L1H2")
    assert fig.data[0].z.shape == (5, 5) and len(set(fig.data[0].x)) == 5 and fig.data[0].customdata is None
    grid = pattern_grid_figure(patterns, labels)
    z = grid.data[0].z
    assert z.shape[0] > 2 * 5 and z.shape[1] > 4 * 5
    assert torch.tensor(z[:5, :5]).allclose(patterns[0, 0].double(), atol=1e-6)
    layer = layer_patterns_figure(patterns[0], labels, 0)  # 4 heads: one row of 4 tiles, 1-column gaps
    assert len(layer.data) == 1
    for head in range(4):  # each head's tile shows the model's pattern
        tile = layer.data[0].z[:, head * 6:head * 6 + 5]
        assert torch.tensor(tile).allclose(patterns[0, head], atol=1e-6)
    assert scores_heatmap(torch.rand(2, 4), "t").data[0].z.shape == (2, 4)
    with pytest.raises(wb.InputError):
        pattern_figure(patterns[0, 0], labels[:3])


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    vocab = len(word_tokenizer().backend.get_vocab())
    dense = make_model("gqa_rotary_rms_swiglu", d_vocab=vocab)
    dense.tokenizer = word_tokenizer()
    moe = make_model("moe_gqa", d_vocab=vocab)
    moe.tokenizer = word_tokenizer()
    return {"dense": dense.save(root / "dense"), "moe": moe.save(root / "moe")}


COMMANDS = [
    (attention, ["--prompt", "The cat sat on the mat"], ["attention"]),
    (induction, ["--seq-len", "8", "--batch", "2"], ["induction", "induction_loss"]),
    (detectors, [], ["detectors"]),
    (ablation, [], ["head_sweep"]),
    (patching, [], ["patch_residual", "patch_attn_mlp", "patch_heads"]),
    (lens, ["--target", "mat"], ["logit_lens", "dla"]),
    (heads, [], ["heads"]),
]


@pytest.mark.parametrize("module, extra, stems", COMMANDS, ids=[m.__name__ for m, _, _ in COMMANDS])
def test_commands_write_csv_json_and_html(module, extra, stems, saved_models, tmp_path):
    module.main(["--model", str(saved_models["dense"]), "--out", str(tmp_path), "--no-progress", *extra])
    for stem in stems:
        table = pd.read_csv(tmp_path / f"{stem}.csv")
        summary = json.loads((tmp_path / f"{stem}.json").read_text())
        assert len(table) > 0 and len(summary["rows"]) == len(table)
        assert summary["columns"] == list(table.columns)
        html = (tmp_path / f"{stem}.html").read_text()
        assert html.lstrip().lower().startswith("<!doctype html>") and "Plotly.newPlot" in html


def test_router_command_needs_a_mixture_of_experts(saved_models, tmp_path):
    router.main(["--model", str(saved_models["moe"]), "--out", str(tmp_path), "--no-progress"])
    assert len(pd.read_csv(tmp_path / "router.csv")) == 2 * 4  # layers x experts
    with pytest.raises(SystemExit, match="no mixture of experts"):
        router.main(["--model", str(saved_models["dense"]), "--out", str(tmp_path)])
