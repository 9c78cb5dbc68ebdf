"""``python -m experiments.ablation``: every head zero-ablated in turn, the change in loss (mean over the prompts)."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments.ablation import head_sweep, head_sweep_per_prompt
from experiments.plots.ablation import head_sweep_heatmap


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = _cli.make_parser("Ablate every head in turn and record the change in loss (mean over the prompts).",
                              "ablation", per_prompt=True)
    parser.add_argument("--prompt", action="append", default=None,
                        help="text to run; repeat it for several prompts (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    prompts = args.prompt or [None]
    if len(prompts) == 1:
        tokens, mask = _cli.prompt_tokens(model, prompts[0]), None
    elif model.tokenizer is None:
        raise SystemExit("this model has no tokenizer, so --prompt cannot be tokenized")
    else:
        tokens, mask = model.to_tokens_and_mask(prompts)
    # Zero ablation: mean and resample over these prompts would replace each by the others (or itself).
    if _cli.sharded(args):
        from experiments import distributed

        with _cli.worker_pool(args) as pool:
            rows = pool.run(head_sweep_per_prompt, tokens, attention_mask=mask,
                            progress=not args.no_progress)
        table = distributed.mean_over_prompts(rows.drop(columns="clean"), ["layer", "head"])
    else:
        table = head_sweep(model, tokens, "loss", "zero", progress=not args.no_progress, attention_mask=mask)
    _cli.write_outputs(args.out, "head_sweep", table, head_sweep_heatmap(table),
                       {"experiment": "head_sweep", "model": args.model, "method": "zero",
                        "n_prompts": len(prompts), "n_tokens": int(tokens.numel() if mask is None else mask.sum())})


if __name__ == "__main__":
    _cli.run_main(main)
