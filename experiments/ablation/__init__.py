"""Zero, mean and resample ablation of heads, attention/MLP layers, neurons and experts.

Legend: B batch, P position, H n_heads, K d_head, D d_model, M d_mlp, k experts_per_token.

Where each kind is ablated (TransformerLens hook names):
  head        blocks.{l}.attn.hook_z [B, P, H, K], head ``index``
  attn_layer  blocks.{l}.hook_attn_out [B, P, D] (the attention output bias included)
  mlp_layer   blocks.{l}.hook_mlp_out [B, P, D]
  neuron      blocks.{l}.mlp.hook_post [B, P, M], neuron ``index`` (dense MLPs)
  expert      blocks.{l}.mlp.hook_expert_weights: expert ``index``'s router weight set to zero
              wherever it was chosen (the other chosen experts keep theirs; zero ablation only)
Methods: "zero" writes zeros; "mean" writes the mean over the reference prompts at each position
(pads excluded); "resample" writes the activation of another prompt (reference row b % n_ref, or,
when the reference is the input batch itself, row (b + 1) % B).

A mean reference is computed batch by batch (``mean_reference``, through
``experiments.datasets.mean_activations``), so a big corpus never needs one giant cache; a
precomputed one passes as ``reference_means`` ({hook name: [1, P, ...]}).

Padded batches: prompts of different lengths take ``attention_mask`` [B, P] (1 real, 0 pad; a
list of texts builds its own), and so does a padded reference (``reference_mask``). A reference is
read at each prompt's own positions: the p-th real token of an input row takes the reference's
p-th real token, whichever side either batch is padded on, so a padded row is ablated exactly as
that prompt would be alone. ``ablation_effect`` scores a metric (``experiments.metrics``: each
row read at its own last real token by default) clean and ablated, as the mean over prompts or
per prompt.

Modules: ``targets`` (``AblationTarget``, ``METHODS``), ``references`` (what mean and resample
write; ``mean_reference``), ``hooks`` (``ablation_hooks``, ``run_ablated``), ``effects``
(``ablation_effect``, ``per_token_loss_change``, ``top_predictions_change``, both of them from one pair of forwards:
``loss_and_top_predictions_change``; ``top_predictions``, the clean model's alone) and ``sweeps``
(``head_sweep``, ``head_sweep_per_prompt``); every public name is importable from here.

``python -m experiments.ablation --model NAME --out DIR [--prompt TEXT ...]`` runs a zero-ablation
``head_sweep`` and writes the per-head loss change (``experiments.cli.ablation``).
"""


from experiments.ablation.effects import (ablation_effect, loss_and_top_predictions_change, per_token_loss_change,
                                         top_predictions, top_predictions_change)
from experiments.ablation.hooks import ablation_hooks, run_ablated
from experiments.ablation.references import mean_reference
from experiments.ablation.sweeps import head_sweep, head_sweep_per_prompt
from experiments.ablation.targets import KINDS, METHODS, AblationTarget, Kind, Method

__all__ = ["AblationTarget", "ablation_hooks", "run_ablated", "head_sweep", "head_sweep_per_prompt", "ablation_effect",
           "mean_reference", "per_token_loss_change", "top_predictions", "top_predictions_change",
           "loss_and_top_predictions_change", "KINDS", "METHODS", "Kind", "Method"]
