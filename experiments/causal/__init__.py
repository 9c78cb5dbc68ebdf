"""Causal variables: interchange interventions on subspaces and distributed alignment search (DAS).

Built on TransformerLens 4.3's ``transformer_lens.tools.analysis.interchange`` (which runs unchanged
on our models): ``tasks`` (base/source pairs with a known causal model: induction on the zoo's
toy-attn-2l, IOI's name position), ``alignment`` (``align_variable``: DAS plus its controls, scored by
interchange accuracy), ``controls`` (``reinitialized``, the random-init copy for our models), and
TransformerLens's tools that need a bridge's surface, names and signatures kept: ``edges``
(edge-granularity ``attribution_patch``, ``faithfulness``) and ``subspaces``
(``attention_head_subspace_affinity``).

Example:
    >>> from experiments.causal import align_variable, induction_task
    >>> report = align_variable(model, induction_task(model, 24), "blocks.0.hook_resid_post", epochs=2,
    ...                         controls=("no_intervention",))
    >>> report.accuracy("no_intervention")
    0.0
"""

from experiments.causal.alignment import (AlignmentReport, align_variable, interchange_accuracy, packed_inputs,
                                          task_logits)
from experiments.causal.controls import reinitialized
from experiments.causal.edges import attribution_patch, faithfulness
from experiments.causal.subspaces import attention_head_subspace_affinity
from experiments.causal.tasks import InterchangeTask, induction_task, ioi_name_position_task

__all__ = ["AlignmentReport", "InterchangeTask", "align_variable", "attention_head_subspace_affinity",
           "attribution_patch", "faithfulness", "induction_task", "interchange_accuracy", "ioi_name_position_task",
           "packed_inputs", "reinitialized", "task_logits"]
