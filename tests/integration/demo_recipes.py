"""The computations of TransformerLens's two demo notebooks (``demos/Main_Demo.ipynb`` and
``demos/Exploratory_Analysis_Demo.ipynb``), cell by cell, as functions of a model.

The same code runs on our model and on a TransformerLens ``TransformerBridge`` of the same weights (the tests in
test_tl_demos.py compare what they return). Only what the notebooks cannot know about a tiny model changes:
prompts are words of the test tokenizer ("t5 t6 ..."), and GPT-2's layer/head numbers become this model's.
Every TransformerLens API the notebooks call on a model or a cache appears here; plotting and circuitsvis do not.
"""

from __future__ import annotations

from functools import partial

import einops
import torch
import transformer_lens.utilities as utils
from transformer_lens import FactoredMatrix

# Main_Demo cell 15 / Exploratory cell 6's IOI prompts, in the test tokenizer's words (its word-level
# vocabulary splits "t21" into "t2" and an unknown "1": the answers are one-digit words).
CLEAN = ["t3 t4 t5 t6 t3 t7 t8", "t5 t6 t7 t8 t5 t9 t4"]
CORRUPTED = ["t3 t4 t5 t6 t4 t7 t8", "t5 t6 t7 t8 t6 t9 t4"]
ANSWERS = [("t4", "t3"), ("t6", "t5")]


def main_demo(model, ablated_head: int) -> dict:
    """Main_Demo's cells 9-52 on ``model`` (the head numbers mapped): what each cell computes."""
    out = {}
    text = "t5 t6 t7 t8 t9 t10 t11 t5 t6 t7 t8"
    out["loss"] = model(text, return_type="loss")  # cell 9
    tokens = model.to_tokens(text)  # cell 10
    _, cache = model.run_with_cache(tokens, remove_batch_dim=True)
    out["pattern_0"] = cache["pattern", 0, "attn"]  # cell 11
    out["str_tokens"] = model.to_str_tokens(text)
    _, attn_cache = model.run_with_cache(tokens, remove_batch_dim=True, stop_at_layer=1,  # cell 13
                                         names_filter=["blocks.0.attn.hook_pattern"])
    out["pattern_0_stopped"] = attn_cache["blocks.0.attn.hook_pattern"]

    def head_ablation_hook(value, hook):  # cell 14
        value[:, :, ablated_head, :] = 0.0
        return value

    out["ablated_loss"] = model.run_with_hooks(tokens, return_type="loss",
                                               fwd_hooks=[(utils.get_act_name("v", 0), head_ablation_hook)])
    out["resid_patching"] = _residual_stream_patching(model)  # cells 15-16, through get_act_name("in", layer)

    random_tokens = torch.randint(3, 101, (3, 6), generator=torch.Generator().manual_seed(0))  # cell 18
    repeated = einops.repeat(random_tokens, "batch seq_len -> batch (2 seq_len)")
    out["loss_by_position"] = model.loss_fn(model(repeated), repeated, per_token=True).mean(0)
    scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)  # cell 19

    def induction_score_hook(pattern, hook):
        stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - random_tokens.shape[1])
        scores[hook.layer(), :] = einops.reduce(stripe, "batch head_index position -> head_index", "mean")

    model.run_with_hooks(repeated, return_type=None,
                         fwd_hooks=[(lambda name: name.endswith("pattern"), induction_score_hook)])
    out["induction_scores"] = scores
    out["tl_named_parameters"] = {name: param.detach().clone() for name, param in model.tl_named_parameters()}  # 23-24
    fired = {}  # cell 25
    model.run_with_hooks("t5 t6 t7", return_type=None, fwd_hooks=[(
        lambda name: name.startswith("blocks.0.") or not name.startswith("blocks"),
        lambda activation, hook: fired.__setitem__(hook.name, tuple(activation.shape)))])
    out["fired"] = fired
    bias_values, bias_indices = model.unembed.b_U.sort(descending=True)  # cells 26-28
    out["b_U_sorted"] = bias_values
    out["b_U_t7"] = model.unembed.b_U[model.to_single_token(" t7")]
    out["str_tokens_of_tokens"] = model.to_str_tokens(tokens)  # cells 29-33
    out["multi_tokens"] = model.to_tokens(["t5 t6 t7", "t5 t6 t7 t8 t9"])
    out["probs"] = model("t5 t6 t7").softmax(dim=-1)
    out["to_string"] = model.to_string(tokens[0, 1:])
    out["token_positions"] = [model.get_token_position(" t6", "t5 t6 t7 t8"),  # cells 34-35
                              model.get_token_position(" t6", "t5 t6 t7 t8", prepend_bos=False),
                              model.get_token_position(" t6", "t5 t6 t7 t6 t8", mode="first"),
                              model.get_token_position(" t6", "t5 t6 t7 t6 t8", mode="last")]
    out["no_bos_shape"] = tuple(model("t5 t6", prepend_bos=False).shape)  # cells 37-38
    OV = model.OV  # cells 44-51
    assert isinstance(OV, FactoredMatrix)
    eigenvalues = OV.eigenvalues
    out["OV_copying_score"] = eigenvalues.sum(dim=-1).real / eigenvalues.abs().sum(dim=-1)
    full_OV = model.embed.W_E @ OV @ model.unembed.W_U
    full_eigenvalues = full_OV.eigenvalues
    out["full_OV_copying_score"] = full_eigenvalues.sum(dim=-1).real / full_eigenvalues.abs().sum(dim=-1)
    return out


def _logit_diff(model, logits) -> torch.Tensor:
    correct, incorrect = model.to_single_token(" t4"), model.to_single_token(" t3")
    return logits[0, -1, correct] - logits[0, -1, incorrect]


def _residual_stream_patching(model) -> torch.Tensor:
    clean_tokens, corrupted_tokens = model.to_tokens(CLEAN[0]), model.to_tokens(CORRUPTED[0])
    _, clean_cache = model.run_with_cache(clean_tokens)

    def residual_stream_patching_hook(resid_pre, hook, position):
        resid_pre[:, position, :] = clean_cache[hook.name][:, position, :]  # the point's own name in the cache
        return resid_pre

    result = torch.zeros(model.cfg.n_layers, clean_tokens.shape[1])
    for layer in range(model.cfg.n_layers):
        for position in range(clean_tokens.shape[1]):
            patched = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(
                utils.get_act_name("in", layer), partial(residual_stream_patching_hook, position=position))])
            result[layer, position] = _logit_diff(model, patched)
    return result


def exploratory_demo(model, heads=None, per_head_kv: bool = True) -> dict:
    """Exploratory_Analysis_Demo's cells 5-44 on ``model`` (after the boot cell): what each cell computes.

    ``heads``: the query heads whose value / key / query the per-head loops patch (all by default);
    ``per_head_kv=False`` leaves out the loops that index ``hook_k``/``hook_v`` by query head (a grouped
    bridge cannot run them; the tests check ours against the equivalent patch of ``hook_z`` there).
    """
    out = {}
    heads = range(model.cfg.n_heads) if heads is None else heads
    utils.test_prompt(CLEAN[0], " t4", model, prepend_bos=True, print_details=False)  # cell 5
    answer_tokens = torch.tensor([[model.to_single_token(" " + a) for a in pair] for pair in ANSWERS])  # cell 6
    tokens = model.to_tokens(CLEAN, prepend_bos=True)
    original_logits, cache = model.run_with_cache(tokens)
    out["logits"] = original_logits
    answer_directions = model.unembed.W_U[:, answer_tokens]  # cells 9-12: direct logit attribution
    logit_diff_directions = answer_directions[..., 0] - answer_directions[..., 1]
    final_token_residual = cache["resid_post", -1][:, -1, :]
    scaled = cache.apply_ln_to_stack(final_token_residual, layer=-1, pos_slice=-1)
    out["dla_logit_diff"] = einops.einsum(scaled, logit_diff_directions, "batch d, d batch -> ") / len(CLEAN)
    accumulated, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    out["accumulated"] = _stack_logit_diff(cache, accumulated, logit_diff_directions)
    out["accumulated_labels"] = labels
    per_layer, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    out["per_layer"] = _stack_logit_diff(cache, per_layer, logit_diff_directions)
    out["per_layer_labels"] = labels
    per_head = cache.stack_head_results(layer=-1, pos_slice=-1)
    per_head = einops.rearrange(per_head, "(layer head) ... -> layer head ...", layer=model.cfg.n_layers)
    out["per_head"] = _stack_logit_diff(cache, per_head, logit_diff_directions)
    out["pattern_of_a_head"] = cache["attn", model.cfg.n_layers - 1][0, 1]

    corrupted_tokens = model.to_tokens(CORRUPTED, prepend_bos=True)  # cells 14-29: activation patching
    corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens, return_type="logits")
    out["corrupted_logits"] = corrupted_logits
    out["corrupted_text"] = model.to_string(corrupted_tokens)
    metric = partial(_ave_logit_diff, answer_tokens=answer_tokens)
    for name in ("resid_pre", "attn_out", "mlp_out"):
        out[f"patched_{name}"] = _patch_positions(model, corrupted_tokens, cache, utils.get_act_name, name, metric)
    out["patched_z"] = _patch_heads(model, corrupted_tokens, cache, utils.get_act_name("z", 0, "attn"), heads, metric)
    out["patched_pattern"] = _patch_heads(model, corrupted_tokens, cache, utils.get_act_name("attn", 1, "attn"),
                                          heads, metric, pattern=True)
    if per_head_kv:
        out["patched_v"] = _patch_heads(model, corrupted_tokens, cache, utils.get_act_name("v", 0, "attn"), heads,
                                        metric)
        for act_type in ("q", "k", "v"):  # cells 32-36: direct path from layer 0's heads into layer 1's
            out[f"direct_path_{act_type}"] = _direct_path(model, corrupted_tokens, cache, corrupted_cache, act_type,
                                                          heads, metric)
    # cells 38-40: previous-token, duplicate and induction scores through a pattern filter
    repeated = model.to_tokens("t3 t4 t5 t6 t7 t3 t4 t5 t6 t7", prepend_bos=True)
    scores = {kind: torch.zeros(model.cfg.n_layers, model.cfg.n_heads) for kind in ("prev", "induction")}

    def score_hook(pattern, hook):
        scores["prev"][hook.layer()] = pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1))
        scores["induction"][hook.layer()] = pattern.diagonal(offset=-4, dim1=-2, dim2=-1).mean((0, -1))

    out["repeated_loss"] = model.run_with_hooks(repeated, return_type="loss", fwd_hooks=[(
        lambda act_name: act_name.endswith("hook_pattern"), score_hook)])
    out["scores"] = scores
    out["corner"] = utils.get_corner(scores["induction"])
    # cells 41-44: ablate one head by a hook added on the component, then read the ablated cache
    layer, head = model.cfg.n_layers - 1, 1

    def ablate_top_head_hook(z, hook):
        z[:, -1, head, :] = 0
        return z

    model.blocks[layer].attn.hook_z.add_hook(ablate_top_head_hook)
    ablated_logits, ablated_cache = model.run_with_cache(tokens)
    model.reset_hooks()
    out["ablated_logit_diff"] = metric(ablated_logits)
    ablated_per_head = ablated_cache.stack_head_results(layer=-1, pos_slice=-1)
    out["ablated_per_head"] = ablated_per_head
    out["ln_final_scale_ratio"] = cache["ln_final.hook_scale"][:, -1] / ablated_cache["ln_final.hook_scale"][:, -1]
    return out


def _ave_logit_diff(logits, answer_tokens) -> torch.Tensor:
    final_logits = logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    return (answer_logits[:, 0] - answer_logits[:, 1]).mean()


def _stack_logit_diff(cache, stack, directions) -> torch.Tensor:
    scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    return einops.einsum(scaled, directions, "... batch d_model, d_model batch -> ...") / directions.shape[-1]


def _patch_positions(model, corrupted_tokens, clean_cache, act_name, name, metric) -> torch.Tensor:
    def patch_residual_component(corrupted_component, hook, pos, clean_cache):
        corrupted_component[:, pos, :] = clean_cache[hook.name][:, pos, :]
        return corrupted_component

    positions = (1, 5, corrupted_tokens.shape[1] - 1)  # the first name, its swapped repeat, the last token (for time)
    result = torch.zeros(model.cfg.n_layers, len(positions))
    for layer in range(model.cfg.n_layers):
        for i, position in enumerate(positions):
            hook_fn = partial(patch_residual_component, pos=position, clean_cache=clean_cache)
            patched = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(act_name(name, layer), hook_fn)],
                                           return_type="logits")
            result[layer, i] = metric(patched)
    return result


def _patch_heads(model, corrupted_tokens, clean_cache, hook_name, heads, metric, pattern=False) -> torch.Tensor:
    def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):
        corrupted_head_vector[:, :, head_index, :] = clean_cache[hook.name][:, :, head_index, :]
        return corrupted_head_vector

    def patch_head_pattern(corrupted_head_pattern, hook, head_index, clean_cache):
        corrupted_head_pattern[:, head_index, :, :] = clean_cache[hook.name][:, head_index, :, :]
        return corrupted_head_pattern

    patch = patch_head_pattern if pattern else patch_head_vector
    result = torch.zeros(len(heads))
    for i, head_index in enumerate(heads):
        hook_fn = partial(patch, head_index=head_index, clean_cache=clean_cache)
        result[i] = metric(model.run_with_hooks(corrupted_tokens, fwd_hooks=[(hook_name, hook_fn)],
                                                return_type="logits"))
    return result


def _direct_path(model, corrupted_tokens, cache, corrupted_cache, act_type, heads, metric) -> torch.Tensor:
    """Cell 32: head A of layer 0's output difference, through W_{Q,K,V} of head B in layer 1, into hook_{q,k,v}."""
    weights = {"q": lambda attn: attn.W_Q, "k": lambda attn: attn.W_K, "v": lambda attn: attn.W_V}[act_type]

    def patch_direct_path(corrupted_attn_act, hook, A_head_index, B_head_index):
        A_output_act_name = utils.get_act_name("result", 0, "attn")
        clean_A_output = cache[A_output_act_name][:, :, A_head_index, :]
        corrupted_A_output = corrupted_cache[A_output_act_name][:, :, A_head_index, :]
        corrupted_B_act = corrupted_attn_act[:, :, B_head_index, :]
        W_B = weights(model.blocks[1].attn)[B_head_index]
        corrupted_ln1_scale = corrupted_cache[utils.get_act_name("scale", 1, "ln1")]
        patched_B_act = corrupted_B_act + (clean_A_output - corrupted_A_output) @ W_B / corrupted_ln1_scale
        patched = corrupted_attn_act.clone()
        patched[:, :, B_head_index, :] = patched_B_act
        return patched

    result = torch.zeros(len(heads), len(heads))
    for i, A in enumerate(heads):
        for j, B in enumerate(heads):
            hook = (utils.get_act_name(act_type, 1, "attn"), partial(patch_direct_path, A_head_index=A, B_head_index=B))
            result[i, j] = metric(model.run_with_hooks(corrupted_tokens, fwd_hooks=[hook], return_type="logits"))
    return result
