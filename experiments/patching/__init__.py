"""Activation patching from a clean run into a corrupted one, exact and by attribution.

Legend: B batch, P position, L n_layers, H n_heads, K d_head, D d_model, V d_vocab.

The metric is the logit difference logit[answer] - logit[wrong] at each prompt's last real
token, or any ``experiments.metrics`` metric or callable; values are means over the prompts
(``per_prompt=True`` keeps each prompt's). Clean and corrupted prompts of different lengths pad
to one width, each run under its own attention mask. Exact patching replaces one activation of the corrupted run by the clean run's
and reruns the rest; every site is scored in batched passes that reuse the corrupted run up to
the site's layer (``experiments._batched``). ``normalized`` is (patched - corrupt) / (clean -
corrupt): 1 where the patch restores the clean behaviour, 0 where it does nothing.

Attribution patching is the gradient-based LINEAR APPROXIMATION of the same quantity (Nanda,
"Attribution Patching"): (clean - corrupt) . d metric / d activation at the corrupted run,
for every site at once from one clean forward, one corrupted forward and one backward pass.

Every entry point takes a ``PairedPrompts`` (``PairedPrompts.from_prompts(model, clean, corrupt, answers, wrong)``)
as its first data argument; the older forms (tokens, answer and wrong tokens, masks and metric as separate
arguments) are still taken (``takes_pairs``).

Modules: ``pairs`` (``PairedPrompts``, ``patch_pair``, ``logit_diff_metric``, ``patched_run``, ``takes_pairs``),
``exact`` (``patch_residual``, ``patch_attn_mlp``, ``patch_heads``), ``gradient_estimate`` (attribution patching,
TransformerLens's name kept: ``attribution_patching``) and ``agreement`` (``attribution_agreement``,
``compare_attribution_to_exact``); every public name is importable from here. Figures: ``experiments.plots.patching``.

``python -m experiments.patching --model NAME --out DIR [--clean TEXT --corrupt TEXT --answer TEXT --wrong TEXT]``
(``experiments.cli.patching``).
"""


from experiments.patching.agreement import SIGN_FLOOR, attribution_agreement, compare_attribution_to_exact
from experiments.patching.exact import patch_attn_mlp, patch_heads, patch_residual
from experiments.patching.gradient_estimate import SITES, attribution_patching
from experiments.patching.pairs import PairedPrompts, PatchingRun, logit_diff_metric, patch_pair, patched_run, takes_pairs

__all__ = ["SITES", "SIGN_FLOOR", "PairedPrompts", "PatchingRun", "takes_pairs", "logit_diff_metric", "patch_pair",
           "patched_run", "patch_residual",
           "patch_attn_mlp", "patch_heads", "attribution_patching", "attribution_agreement",
           "compare_attribution_to_exact"]
