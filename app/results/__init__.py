"""The dashboard's one cache layer: the loaded models and every experiment result a page shows.
Pages call these named functions (``results.head_summary(loaded, prompt.ids)``) and cache nothing
themselves; they hand the model to nothing else and never pass a function in.

Models are kept by ``st.cache_resource`` (``models``): one copy per process, shared by every
page and tab. Results are kept by ``st.cache_data`` on the model's key string (``hash_funcs``
hashes a ``LoadedModel`` by its key, so Streamlit never hashes half a gigabyte of weights), the
token ids as a tuple and the call's other arguments. Every computation that hooks the model
holds its lock while the hooks are on.

Long runs (head scores, head sweep, induction scan, exact patching, corpus maxima, information
flow) report progress to a bar the caller hands in (``app.widgets.progress_callback``) and are
kept in a small process-wide LRU store (``long_runs``), keyed on the model's key, the run's text
and its arguments. This layer draws nothing of its own and imports no widget or page.

One module per page or pair of pages, each caching what ``experiments.<same name>`` computes:
``attention`` (Attention, Heads), ``induction``, ``ablation`` (Ablation, Token view, Generate),
``lens``, ``router``, ``patching``, ``flow`` (Information flow), ``neurons`` (Neurons, Token view),
``features`` (Features: SAEs), ``attribution`` (Attribution graph: transcoders), ``circuits`` (Circuits),
``sae_compare`` (SAE compare), ``steering`` (Steering), ``probes`` (Probes);
``artifacts``, the one holder of the dictionaries a page opens (what is shipped for the model, each loaded once
per process), which ``app.artifact_picker`` offers.
A new page's computation goes in its page's module as a named function, cached like its neighbours.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from app.results.ablation import Reference, Targets, ablation_effects, continuation, has_head_sweep, head_sweep
from app.results.artifacts import LoadedArtifact, artifact_choices, load_artifact
from app.results.attention import attention_patterns, head_scores, head_summary
from app.results.attribution import (GraphNodes, LoadedTranscoders, attribution_graph, fit_transcoders_error,
                                      graph_drawing, graph_nodes, heads_of_edge, intervention_logits, layer_sae,
                                      load_transcoders, pruned_graph, transcoder_choices)
from app.results.circuits import (CircuitTask, circuit, circuit_drawing, circuit_faithfulness, circuit_table,
                                   edge_effect, has_circuit_faithfulness, has_faithfulness_curve,
                                   edge_scores, faithfulness_curve, first_clean_ids, has_edge_scores, task_pairs)
from app.results.features import (LoadedSAE, active_features, feature_continuation, feature_corpus_stats,
                                   feature_density,
                                   feature_logit_effect, feature_on_prompt, feature_top_windows, fit_error, load_sae,
                                   sae_choices)
from app.results.flow import flow_contributions, flow_vocab_projection
from app.results.induction import induction_loss, induction_scores
from app.results.lens import direct_logit_attribution, lens_kl, logit_lens, tuned_lens_table
from app.results.long_runs import ProgressBar
from app.results.models import load_model
from app.results.neurons import (model_corpus, neuron_activation, neuron_corpus_maxima, neuron_logit_effect,
                                 neuron_top_windows)
from app.results.patching import PatchPrompts, attribution_patching, exact_patching, has_exact_patching, ioi_prompts
from app.results.router import expert_ablation_effect, routing

__all__ = ["load_model", "ProgressBar", "LoadedArtifact", "artifact_choices", "load_artifact",
           "attention_patterns", "head_summary", "head_scores",
           "induction_scores", "induction_loss",
           "Targets", "Reference", "ablation_effects", "head_sweep", "has_head_sweep", "continuation",
           "logit_lens", "direct_logit_attribution",
           "routing", "expert_ablation_effect",
           "PatchPrompts", "ioi_prompts", "attribution_patching", "exact_patching", "has_exact_patching",
           "flow_contributions", "flow_vocab_projection",
           "neuron_activation", "neuron_logit_effect", "neuron_corpus_maxima", "neuron_top_windows",
           "LoadedSAE", "sae_choices", "load_sae", "fit_error", "active_features", "feature_on_prompt",
           "feature_logit_effect", "feature_corpus_stats", "feature_top_windows", "feature_density", "feature_continuation",
           "LoadedTranscoders", "GraphNodes", "transcoder_choices", "load_transcoders", "fit_transcoders_error",
           "attribution_graph", "pruned_graph", "graph_nodes", "graph_drawing", "layer_sae", "heads_of_edge",
           "intervention_logits",
           "CircuitTask", "task_pairs", "edge_scores", "has_edge_scores", "circuit", "circuit_table", "circuit_drawing",
           "faithfulness_curve", "has_faithfulness_curve", "circuit_faithfulness", "has_circuit_faithfulness", "edge_effect", "first_clean_ids"]
