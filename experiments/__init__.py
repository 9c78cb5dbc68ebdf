"""Scripted interpretability experiments: pure functions over a ``workbench.Decoder``.

Each module takes a model and token ids and returns tensors, pandas DataFrames and plotly
figures; none imports Streamlit. Each also runs as ``python -m experiments.<name> --model NAME
--out DIR``, writing a CSV, a JSON summary and a standalone HTML figure.

Modules: ``attention`` (patterns, per-head statistics), ``induction`` (repeated-random-token
induction scores and loss), ``detectors`` (TransformerLens-style head detectors), ``ablation``
(zero / mean / resample ablation, batched head sweeps), ``patching`` (activation and
attribution patching), ``lens`` (logit lens, direct logit attribution), ``heads`` (every
per-head score in one table, composition scores), ``router`` (mixture-of-experts routing),
``ioi`` (indirect object identification over a dataset), ``flow`` (information flow routes),
``continuations`` (a continuation with and without an ablation), ``token_view`` (what a token view
colours by), ``metrics`` (per-row metrics at each row's answer position), ``sites`` (where an
experiment writes into a run), ``zoo`` (the circuit facts a zoo model's card reports), ``gradients`` (the one
gradient-capturing hook), ``corpus_windows`` (the one corpus-window engine and its disk cache, for neurons
and features).

Packages: ``circuits`` (edge graphs, EAP, exact edge patching), ``attribution`` (attribution graphs
through transcoders), ``sae`` (training and evaluating sparse autoencoders and transcoders),
``features`` (SAE features on a prompt and over a corpus), ``neurons`` (MLP neurons over the corpus),
``datasets`` (IOI prompts, repeated tokens, corpus windows), ``distributed`` (experiments sharded over
Ray workers), ``probes`` (linear probes: per hook, sparse on SAE latents, as monitors), ``steering`` (steering vectors: CAA,
ActAdd, PCA reading vectors, control vectors), ``lenses`` (the tuned lens and the Jacobian lens), ``causal``
(interchange interventions and DAS with their controls; TransformerLens 4.3's tools on our models), ``plots``
(the figures), ``cli`` (the command lines).

Shared plumbing: ``_batched`` (many single-layer edits in few batched passes), ``_cli`` (the commands'
arguments and outputs), ``_progress`` (progress reporting), ``_tokens`` (token ids as labels), ``_flow_parts``
(information flow's forward pass and its split of attention's output into parts), ``_depth`` (how far a forward
must run for some hooks to fire), ``_hook_rows`` (one activation row per prompt at hook points, for probes and
steering), ``_lens_attribution`` (direct logit attribution and the reader of a prompt's run), ``flow_tables``
(information flow's importance tables, filled as a graph reads them).

Example:
    >>> from experiments.induction import induction_scores
    >>> scores_LH = induction_scores(model)          # doctest: +SKIP
"""
