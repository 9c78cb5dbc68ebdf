"""Training loop, corpus, BPE and CLI: schedule and aux-loss values by hand, a short real run, exact reload."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import cli
from workbench.bpe import BOUNDARY_TOKEN, train_bpe
from workbench.corpus import HELD_OUT_EVERY, is_corpus_file, stdlib_corpus, stdlib_source_paths
from workbench.errors import InputError
from workbench.loading.native import load_native
from workbench.train import (TrainConfig, fixed_windows, learning_rate, load_balancing_loss, mean_loss,
                             random_windows, repeated_random_windows, tokenize_documents, train)


# ---- schedule, batches, aux loss: expected values worked out by hand ------------------------------
def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    cfg = TrainConfig(steps=1010, warmup_steps=10, lr=2.0, min_lr_ratio=0.25)
    assert learning_rate(0, cfg) == pytest.approx(0.2)  # (0 + 1) / 10 of the peak
    assert learning_rate(9, cfg) == pytest.approx(2.0)
    assert learning_rate(10, cfg) == pytest.approx(2.0)  # cosine starts at the peak
    # halfway through the decay: floor + (peak - floor) / 2 = 0.5 + 0.75
    assert learning_rate(510, cfg) == pytest.approx(1.25)
    # a quarter of the way: floor + (peak - floor) * (1 + cos(pi/4)) / 2
    assert learning_rate(260, cfg) == pytest.approx(0.5 + 1.5 * (1 + math.cos(math.pi / 4)) / 2)
    assert learning_rate(1010, cfg) == pytest.approx(0.5)


def test_train_config_rejects_values_it_cannot_honour():
    with pytest.raises(InputError, match="seq_len"):
        TrainConfig(seq_len=1)
    with pytest.raises(InputError, match="repeat_fraction"):
        TrainConfig(repeat_fraction=1.5)
    with pytest.raises(InputError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(InputError, match="induction_every"):
        TrainConfig(induction_every=-1)
    with pytest.raises(InputError, match="induction_warmup_steps"):
        TrainConfig(steps=10, induction_warmup_steps=11)


def test_induction_curriculum_schedule_and_token_count_by_hand():
    cfg = TrainConfig(steps=10, batch_size=2, seq_len=16, induction_warmup_steps=3, induction_every=4,
                      induction_batch=3, induction_len=10)
    assert [step for step in range(10) if cfg.is_induction_step(step)] == [0, 1, 2, 4, 8]
    # 5 corpus steps x 2 x 16 + 5 induction steps x 3 rows x (BOS + 2 x mean copy length (8 + 10) / 2)
    assert cfg.tokens_seen == 5 * 2 * 16 + 5 * 3 * 19


def test_induction_task_rows_are_bos_then_random_tokens_twice_and_never_bos():
    rows = repeated_random_windows(d_vocab=7, batch=50, copy_len=6, bos=2, generator=torch.Generator().manual_seed(0))
    assert rows.shape == (50, 13)
    assert (rows[:, 0] == 2).all()
    assert torch.equal(rows[:, 1:7], rows[:, 7:])
    assert set(rows[:, 1:].flatten().tolist()) == {0, 1, 3, 4, 5, 6}  # every id but BOS turns up


def test_random_windows_start_with_bos_and_hold_consecutive_stream_tokens():
    stream = torch.arange(1000) + 10
    rows = random_windows(stream, batch=5, seq_len=9, bos=3, generator=torch.Generator().manual_seed(1))
    assert rows.shape == (5, 9)
    assert (rows[:, 0] == 3).all()
    assert (rows[:, 2:] - rows[:, 1:-1] == 1).all()  # consecutive ids of the arange stream


def test_repeated_rows_write_a_stretch_twice_then_carry_on_and_other_rows_stay_plain():
    stream = torch.arange(1000)
    rows = random_windows(stream, batch=20, seq_len=41, bos=999, generator=torch.Generator().manual_seed(0),
                          repeated_rows=10)
    periods = set()
    for row in rows[:10, 1:]:
        # the first place the text jumps back gives the period h: then x[0:h] x[0:h] x[h:]
        period = int((row.diff() != 1).nonzero()[0]) + 1
        periods.add(period)
        assert 8 <= period <= 20
        assert torch.equal(row[:period], row[period:2 * period])
        assert torch.equal(row[2 * period:], torch.arange(row[0] + period, row[0] + 40 - period))
    assert len(periods) > 3  # the period varies, so no fixed look-back distance predicts the copy
    assert (rows[10:, 2:] - rows[10:, 1:-1] == 1).all()


def test_fixed_windows_are_non_overlapping_and_evenly_spread():
    windows = fixed_windows(torch.arange(100), seq_len=11, max_windows=4, bos=-1)
    # 100 // 10 = 10 windows available; linspace(0, 9, 4) rounds to 0, 3, 6, 9
    assert windows[:, 1].tolist() == [0, 30, 60, 90]
    assert windows[0].tolist() == [-1] + list(range(10))
    with pytest.raises(InputError, match="shorter than one window"):
        fixed_windows(torch.arange(5), seq_len=11, max_windows=1, bos=0)


def test_load_balancing_loss_matches_a_hand_calculation():
    # Uniform router: f_e = 1/4 and p_e = 1/4, so 4 * sum(1/16) = 1.
    assert load_balancing_loss([torch.zeros(2, 3, 4)], k=2).item() == pytest.approx(1.0)
    # Two tokens, 2 experts, k=1. Probs (0.8, 0.2) and (0.6, 0.4): both pick expert 0.
    # f = (1, 0), p = (0.7, 0.3): loss = 2 * (1 * 0.7 + 0 * 0.3) = 1.4.
    logits = torch.log(torch.tensor([[[0.8, 0.2], [0.6, 0.4]]]))
    assert load_balancing_loss([logits], k=1).item() == pytest.approx(1.4, abs=1e-6)
    # The loss is averaged over layers.
    assert load_balancing_loss([logits, torch.zeros(1, 2, 2)], k=1).item() == pytest.approx((1.4 + 1.0) / 2, abs=1e-6)


# ---- corpus and tokenizer ------------------------------------------------------------------------
def test_corpus_file_rule_excludes_tests_encodings_and_build_files():
    assert is_corpus_file(Path("json/decoder.py"))
    assert not is_corpus_file(Path("unittest/test/test_case.py"))
    assert not is_corpus_file(Path("lib2to3/tests/data/bom.py"))
    assert not is_corpus_file(Path("idlelib/idle_test/test_run.py"))
    assert not is_corpus_file(Path("encodings/cp1252.py"))
    assert not is_corpus_file(Path("config-3.11-x86_64-linux-gnu/python-config.py"))
    assert not is_corpus_file(Path("_sysconfigdata__linux_x86_64-linux-gnu.py"))
    assert not is_corpus_file(Path("README.txt"))


def test_corpus_is_sorted_and_every_twentieth_file_is_held_out():
    paths = stdlib_source_paths()
    assert paths == sorted(paths) and "argparse.py" in paths and "os.py" in paths
    assert not any(p.startswith("site-packages/") or "/test/" in f"/{p}" for p in paths)
    corpus = stdlib_corpus(max_files=45)
    assert [s.relative_path for s in corpus.held_out] == [paths[19], paths[39]]
    assert len(corpus.train) == 45 - 45 // HELD_OUT_EVERY
    assert corpus.sha256 == stdlib_corpus(max_files=45).sha256  # deterministic


@pytest.fixture(scope="module")
def small_corpus():
    return stdlib_corpus(max_files=24)


@pytest.fixture(scope="module")
def small_tokenizer(small_corpus):
    return train_bpe([s.text for s in small_corpus.train], vocab_size=400)


def test_bpe_round_trips_code_and_marks_bos_and_eos(small_tokenizer, small_corpus):
    text = small_corpus.held_out[0].text[:500]
    assert small_tokenizer.decode(small_tokenizer.encode(text, prepend_bos=False)) == text
    assert small_tokenizer.vocab_size == 400
    assert small_tokenizer.bos_token_id == small_tokenizer.eos_token_id == 0
    assert small_tokenizer.backend.id_to_token(0) == BOUNDARY_TOKEN
    assert small_tokenizer.encode("x")[0] == 0  # BOS is prepended by default
    again = train_bpe([s.text for s in small_corpus.train], vocab_size=400)
    assert again.backend.to_str() == small_tokenizer.backend.to_str()  # training is deterministic


def test_tokenize_documents_joins_documents_with_the_boundary_token(small_tokenizer):
    stream = tokenize_documents(small_tokenizer, ["x = 1", "y = 2"])
    first = small_tokenizer.encode("x = 1", prepend_bos=False)
    second = small_tokenizer.encode("y = 2", prepend_bos=False)
    assert stream.tolist() == first + [0] + second + [0]


# ---- a short real run ----------------------------------------------------------------------------
def _tiny_config(tokenizer, **changes):
    base = dict(n_layers=1, d_model=32, n_heads=2, d_head=16, d_vocab=tokenizer.vocab_size, n_ctx=32,
                positional="rotary")
    return wb.ModelConfig(**{**base, **changes})


def test_short_run_lowers_the_loss_and_writes_a_checkpoint_that_reloads_exactly(tmp_path, small_corpus,
                                                                                small_tokenizer):
    train_stream = tokenize_documents(small_tokenizer, [s.text for s in small_corpus.train])
    held_out_stream = tokenize_documents(small_tokenizer, [s.text for s in small_corpus.held_out])
    torch.manual_seed(0)
    model = wb.Decoder(_tiny_config(small_tokenizer, d_mlp=64), tokenizer=small_tokenizer)
    probe = fixed_windows(held_out_stream, 32, 16, bos=0)
    before = mean_loss(model, probe)
    assert before == pytest.approx(math.log(400), abs=0.1)  # untrained: close to uniform over the vocabulary
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=5, eval_every=20,
                      eval_windows=16, checkpoint_every=20)
    result = train(model, train_stream, held_out_stream, cfg, out=tmp_path / "ckpt", progress=False)
    assert [e["step"] for e in result.evals] == [20, 40]
    assert result.final["held_out_loss"] < before - 0.5
    assert result.final["held_out_loss"] == pytest.approx(mean_loss(model, probe), abs=1e-5)
    assert len(result.train_loss) == 40 and result.wall_seconds > 0

    loaded = wb.load_model(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    for (name, param), (loaded_name, loaded_param) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == loaded_name and torch.equal(param, loaded_param), name
    tokens = probe[:2]
    assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.to_tokens("def f():").tolist() == model.to_tokens("def f():").tolist()


def test_moe_training_uses_the_router_hooks_and_leaves_none_behind(tmp_path, small_corpus, small_tokenizer):
    train_stream = tokenize_documents(small_tokenizer, [s.text for s in small_corpus.train])
    torch.manual_seed(0)
    model = wb.Decoder(_tiny_config(small_tokenizer, d_mlp=32, num_experts=4, experts_per_token=2,
                                    normalization="RMS", act_fn="silu", gated_mlp=True))
    cfg = TrainConfig(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_windows=8,
                      aux_loss_coef=0.5)
    router_before = model.blocks[0].mlp.W_router.detach().clone()
    result = train(model, train_stream, train_stream[:2000], cfg, progress=False)
    assert result.evals[-1]["train_loss"] < result.evals[0]["train_loss"] + 1e-3
    assert not torch.equal(router_before, model.blocks[0].mlp.W_router)  # the router is trained
    assert all(not hp._forward_hooks for hp in model.hook_dict.values())  # training hooks removed


def test_seed_fixes_the_run(small_corpus, small_tokenizer):
    train_stream = tokenize_documents(small_tokenizer, [s.text for s in small_corpus.train])
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        model = wb.Decoder(_tiny_config(small_tokenizer, attn_only=True))
        cfg = TrainConfig(steps=5, batch_size=2, seq_len=16, warmup_steps=1, eval_every=5, eval_windows=2)
        losses.append(train(model, train_stream, train_stream, cfg, progress=False).train_loss)
    assert losses[0] == losses[1]


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_dashboard_command_serves_app_home_on_localhost():
    command = cli.dashboard_command(8600)
    assert command[1:3] == ["-m", "app.serve"]  # streamlit run app/Home.py, the default model loading from launch
    from app import serve
    assert Path(serve.streamlit_argv([])[2]) == Path(__file__).resolve().parents[2] / "app" / "Home.py"
    assert command[command.index("--server.port") + 1] == "8600"
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert command[command.index("--server.headless") + 1] == "true"


def test_cli_models_lists_the_zoo(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "toy-attn-2l" in out and "toy-moe-2l" in out


def test_train_cli_rejects_an_unknown_recipe(capsys):
    from experiments.cli import zoo
    with pytest.raises(SystemExit):
        zoo.main(["--recipe", "gpt-5", "--out", "x"])
    assert "invalid choice" in capsys.readouterr().err


def test_workbench_train_runs_the_zoo_command_in_its_own_process():
    # `workbench train ...` hands its arguments to `python -m experiments.zoo` (the library never imports experiments)
    command = cli.train_command(["--recipe", "toy-attn-2l", "--out", "runs/x"])
    assert command == [sys.executable, "-m", "experiments.zoo", "--recipe", "toy-attn-2l", "--out", "runs/x"]
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "train", "--recipe", "gpt-5", "--out", "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'gpt-5'" in done.stderr
