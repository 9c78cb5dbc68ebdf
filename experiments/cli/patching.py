"""``python -m experiments.patching``: activation patching (residual, attention/MLP, heads) and attribution patching
of one clean/corrupted pair."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments.patching import PairedPrompts, compare_attribution_to_exact, patch_attn_mlp, patch_residual
from experiments.plots.patching import patching_heatmap


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = _cli.make_parser("Activation patching (residual, attention/MLP, heads) and attribution patching.", "patching")
    parser.add_argument("--clean", default="When Mary and John went to the store, John gave a drink to")
    parser.add_argument("--corrupt", default="When Mary and John went to the store, Mary gave a drink to")
    parser.add_argument("--answer", default=" Mary")
    parser.add_argument("--wrong", default=" John")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if model.tokenizer is None:
        raise SystemExit("patching from text needs a model with a tokenizer")
    pairs = PairedPrompts.from_prompts(model, model.to_tokens(args.clean), model.to_tokens(args.corrupt),
                                       model.to_single_token(args.answer), model.to_single_token(args.wrong))
    progress = not args.no_progress
    summary = {"model": args.model, "clean": args.clean, "corrupt": args.corrupt, "answer": args.answer, "wrong": args.wrong}
    resid = patch_residual(model, pairs, progress)
    _cli.write_outputs(args.out, "patch_residual", resid, patching_heatmap(resid, "Residual stream patching"),
                       {"experiment": "patch_residual", **summary, **resid.attrs})
    layers = patch_attn_mlp(model, pairs, progress)
    _cli.write_outputs(args.out, "patch_attn_mlp", layers, patching_heatmap(layers, "Attention / MLP output patching"),
                       {"experiment": "patch_attn_mlp", **summary, **layers.attrs})
    heads, r = compare_attribution_to_exact(model, pairs, progress)
    _cli.write_outputs(args.out, "patch_heads", heads, patching_heatmap(heads, "Head patching (exact)"),
                       {"experiment": "patch_heads", **summary, **heads.attrs,
                        "attribution_vs_exact_pearson_r": r,
                        "note": "attribution column: first-order linear approximation of delta"})



if __name__ == "__main__":
    _cli.run_main(main)
