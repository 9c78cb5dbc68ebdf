"""Data-parallel SAE training (``experiments.sae.parallel``): two gloo processes launched by ``torchrun`` train
the same SAEs as one process, within float tolerance (the gradients are summed in another order); a resume of
the two-process run from its checkpoint ends at the uninterrupted result; only rank 0 writes; a form whose
activation couples a batch's rows is refused with more than one process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.sae import train_saes
from experiments.sae.modules import TrainingSAE
from experiments.sae.parallel import World, check_parallel_forms
from workbench.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(progress=False, training_tokens=1536, train_batch_size_tokens=128, buffer_tokens=512, log_every=3,
            store_batch_size_prompts=4, seed=3, dead_feature_window=2)
SPECS = [{"hook_name": "blocks.0.hook_resid_post", "architecture": "topk", "d_sae": 48, "k": 4, "name": "topk"},
         {"hook_name": "blocks.1.hook_resid_post", "architecture": "jumprelu", "d_sae": 32, "name": "jumprelu",
          "config": {"lr": 1e-3}}]


def _model_and_tokens():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()
    return model, torch.randint(1, 64, (24, 16), generator=torch.Generator().manual_seed(1))


SCRIPT = textwrap.dedent(f"""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {str(ROOT)!r})
    from experiments.sae import train_saes
    from experiments.sae.parallel import world_from_environment
    from tests.unit.test_sae_parallel import FAST, SPECS, _model_and_tokens
    world = world_from_environment("gloo")
    out, resume = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    model, tokens = _model_and_tokens()
    extra = dict(resume_from=resume) if resume else dict(checkpoint_dir=out + "/ckpt", checkpoint_every=6)
    saes = train_saes(model, SPECS, tokens, out=out + "/saes", **FAST, **extra)
    torch.save({{s.cfg.hook_name: {{k: v.clone() for k, v in s.state_dict().items()}} for s in saes}},
               out + f"/rank{{world.rank}}.pt")
""")


def _torchrun(tmp_path: Path, *args: str) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])


def test_two_gloo_processes_equal_one_and_resume(tmp_path):
    model, tokens = _model_and_tokens()
    alone = {s.cfg.hook_name: s for s in train_saes(model, SPECS, tokens, **FAST)}
    (tmp_path / "whole").mkdir()
    _torchrun(tmp_path, str(tmp_path / "whole"))
    ranks = [torch.load(tmp_path / "whole" / f"rank{r}.pt") for r in range(2)]
    for hook, sae in alone.items():
        for name, tensor in sae.state_dict().items():
            assert torch.equal(ranks[0][hook][name], ranks[1][hook][name]), (hook, name)  # the processes agree
            torch.testing.assert_close(ranks[0][hook][name], tensor, rtol=1e-4, atol=1e-5, msg=f"{hook} {name}")
    saved = {p.name for p in (tmp_path / "whole" / "saes").iterdir()}
    assert saved == {"topk", "jumprelu"} and (tmp_path / "whole" / "ckpt" / "step-6").is_dir()
    assert wb.load_sae(tmp_path / "whole" / "saes" / "topk").cfg.d_sae == 48
    (tmp_path / "resumed").mkdir()
    _torchrun(tmp_path, str(tmp_path / "resumed"), str(tmp_path / "whole" / "ckpt" / "step-6"))
    resumed = torch.load(tmp_path / "resumed" / "rank0.pt")
    for hook in alone:
        for name, tensor in ranks[0][hook].items():
            torch.testing.assert_close(resumed[hook][name], tensor, rtol=1e-5, atol=1e-6, msg=f"{hook} {name}")


def test_a_form_coupling_the_batch_rows_is_refused_over_processes():
    sae = TrainingSAE("batchtopk", 8, 16, options={"k": 2})
    check_parallel_forms(World(), [sae])  # one process: fine
    with pytest.raises(InputError, match="'batchtopk' chooses its active features over the whole batch"):
        check_parallel_forms(World(0, 2), [sae])


def test_each_process_takes_every_other_row_weighted_by_its_share():
    rows = torch.arange(5)[:, None]
    assert World(0, 2).rows(rows).flatten().tolist() == [0, 2, 4] and World(1, 2).rows(rows).flatten().tolist() == [1, 3]
    assert World(0, 2).share(5) == pytest.approx(3 / 5) and World(1, 2).share(5) == pytest.approx(2 / 5)
