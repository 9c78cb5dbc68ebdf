"""Trains the shipped per-layer skip transcoders of SmolLM2-135M (all 30 MLPs, one forward pass per batch).

    nice -n 19 python tools/train_smollm2_transcoders.py --work /work/train/tc-smollm2 --training-tokens 30720

``experiments.sae.multi.train_transcoders`` on the English training windows the registry assigns to SmolLM2
(``workbench.loading.registry.model_corpus`` -> ``experiments.cli.sae.data_windows``); one thread (the machine is
shared), checkpoints under ``--work/checkpoints/step-N`` and a rerun resumes from the latest. ``--ship-checkpoint``
saves the transcoders of the latest checkpoint (a run stopped early) instead of training on. The set is written to
``--out`` in float16 (``TranscoderSet.save``: ``transcoders.json`` + ``transcoders.safetensors``, what
``wb.load_transcoders`` reads), with each layer's ``training_log_{l}.csv``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, not an installed copy
OUT = ROOT / "workbench" / "zoo" / "smollm2-135m" / "transcoders" / "smollm2-135m-skip-transcoders"


def latest_checkpoint(folder: Path):
    """The ``step-N`` folder with the largest N under ``folder`` that holds a finished state, else None."""
    steps = [(int(m.group(1)), p) for p in folder.glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "training_state.pt").exists()]
    return max(steps)[1] if steps else None


def export_circuit_tracer(tc, folder: Path, logs: Path | None = None) -> Path:
    """Writes ``tc`` (per-layer transcoders) in circuit-tracer's per-layer format into ``folder``: ``config.yaml``
    (``model_kind: transcoder_set``, the hooks, one ``layer_{i}.safetensors`` per layer) and each layer's ``W_enc
    [F, D]``, ``W_dec [F, D]``, ``b_enc``, ``b_dec``, ``activation_function.threshold`` and ``W_skip [D, D]`` in
    float16; ``logs``: a folder whose ``training_log_{i}.csv`` files are copied beside them."""
    import shutil

    import yaml
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for layer in range(tc.n_layers):
        tensors = {"W_enc": tc.W_enc[layer], "W_dec": tc.W_dec[layer][:, 0], "b_enc": tc.b_enc[layer],
                   "b_dec": tc.b_dec[layer]}
        if tc.threshold[layer] is not None:
            tensors["activation_function.threshold"] = tc.threshold[layer]
        if tc.W_skip is not None:
            tensors["W_skip"] = tc.W_skip[layer]
        names.append(f"layer_{layer}.safetensors")
        save_file({k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}, str(folder / names[-1]))
        if logs is not None and (logs / f"training_log_{layer}.csv").is_file():
            shutil.copy(logs / f"training_log_{layer}.csv", folder / f"training_log_{layer}.csv")
    config = {"model_name": "smollm2-135m", "model_kind": "transcoder_set", "feature_input_hook": tc.feature_input_hook,
              "feature_output_hook": tc.feature_output_hook, "scan": "workbench/smollm2-135m-skip-transcoders",
              "transcoders": names}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/work/train/tc-smollm2", help="checkpoints go to WORK/checkpoints")
    parser.add_argument("--out", default=str(OUT), help="where the trained set goes (TranscoderSet.save)")
    parser.add_argument("--d-transcoder", type=int, default=768)
    parser.add_argument("--k", type=float, default=32)
    parser.add_argument("--training-tokens", type=int, default=30720)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--buffer-tokens", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=256, help="128-token training windows read (in order)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-decay-steps", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--export", metavar="TRAINED",
                        help="only write the set saved at TRAINED (TranscoderSet.save) to --out in circuit-tracer's format")
    parser.add_argument("--ship-checkpoint", action="store_true",
                        help="save the latest checkpoint's transcoders (training stops at that step)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import workbench as wb

    if args.export:
        trained = wb.load_transcoders(args.export, dtype=torch.float32)
        print(export_circuit_tracer(trained, Path(args.out), logs=Path(args.export)))
        return
    from experiments.cli.sae import data_windows
    from experiments.sae.multi import train_transcoders
    from workbench.loading.registry import model_corpus

    model = wb.load_model("smollm2-135m")
    corpus = model_corpus("smollm2-135m")  # "english": the training split of experiments.datasets.english
    tokens = data_windows(model, corpus, n_windows=args.windows)
    checkpoints = Path(args.work) / "checkpoints"
    resume = latest_checkpoint(checkpoints)
    training_tokens = args.training_tokens
    if args.ship_checkpoint:
        if resume is None:
            raise SystemExit(f"no checkpoint under {checkpoints}")
        training_tokens = int(resume.name.split("-")[1]) * args.batch_tokens  # the resumed loop ends at once
        print(f"shipping {resume}")
    print(f"{tokens.shape[0]} windows of {tokens.shape[1]} tokens; resume from {resume}", flush=True)
    start = time.time()
    tc = train_transcoders(model, tokens, d_transcoder=args.d_transcoder, architecture="batchtopk", k=args.k,
                           skip=True, out=args.out, checkpoint_dir=checkpoints, resume_from=resume,
                           save_dtype="float16", progress=True, training_tokens=training_tokens,
                           train_batch_size_tokens=args.batch_tokens, buffer_tokens=args.buffer_tokens,
                           lr=args.lr, lr_decay_steps=args.lr_decay_steps, dead_feature_window=100,
                           outlier_norm_ratio=10.0, checkpoint_every=args.checkpoint_every, log_every=5)
    print(f"{tc!r} saved to {args.out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
