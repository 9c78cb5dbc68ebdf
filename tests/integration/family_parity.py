"""The parity checks every HF family must pass, as pytest tests a family's test module takes over.

A family test module lists its config variants and takes the tests:

    CASES = {"pythia": Case(lambda: GPTNeoXConfig(**tiny, use_parallel_residual=True)), ...}
    globals().update(family_parity_tests(CASES))

For every case, transformers builds a random tiny model from the config (``from_config``), its
weights are re-drawn so no norm gain is 1 and no bias 0 (``hf_tiny.randomize``), and
``save_pretrained`` writes it. We load the directory and compare with transformers' own eager run
(expected values come from transformers only):

- logits within 1e-4 in float32 under every attention kernel (eager, sdpa, flash);
- ``blocks.{l}.hook_resid_pre`` against transformers' hidden state entering layer l, every
  ``hook_resid_post`` against the one leaving it (the last through the final norm, as
  transformers reports it), within 1e-4;
- ``hook_pattern`` of every layer against transformers' attention weights under every kernel,
  and editable there: a hook that rescales the patterns gives the eager kernel's edited logits;
- greedy generation with the KV cache equals generation re-running the whole prefix;
- a bfloat16 checkpoint loads straight into bfloat16 and agrees with transformers' bfloat16 run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import workbench as wb
from tests.integration.hf_tiny import randomize, word_tokenizer
from workbench.generation import generate_tokens

KERNELS = ["eager", "sdpa", "flash"]
TOLERANCE = 1e-4
SEQ_LEN = 24  # longer than the tests' sliding windows, so windows mask real keys
BATCH = 2


@dataclass(frozen=True)
class Case:
    """One config variant of a family.

    ``config`` builds the transformers config (tiny: a few layers, d_model <= 64, vocab 101).
    ``compare_last_hidden=False`` where transformers' last hidden state is not the final residual
    stream through the final norm (OPT-350m projects it down to ``word_embed_proj_dim`` first).
    ``edit_config`` rewrites the saved config.json (a dict in, a dict out) into a spelling
    transformers still reads the same way, e.g. transformers 4's ``rope_scaling`` + ``rope_theta``.
    """

    config: Callable[[], PretrainedConfig]
    compare_last_hidden: bool = True
    seq_len: int = SEQ_LEN
    edit_config: Optional[Callable[[dict], dict]] = None


@dataclass
class Saved:
    """A case built, saved and run by transformers once per test module."""

    name: str
    case: Case
    directory: Path
    hf_model: Any
    tokens: torch.Tensor
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    attentions: tuple[torch.Tensor, ...]


def build_and_save(config: PretrainedConfig, directory: Path, seed: int = 1, dtype: torch.dtype = torch.float32,
                   edit_config: Optional[Callable[[dict], dict]] = None):
    """A randomised eager transformers model of ``config``, saved with a word tokenizer to ``directory``
    (its config.json then rewritten by ``edit_config`` when given)."""
    torch.manual_seed(seed)
    # experts_implementation="eager": the reference loop over experts (the grouped GEMM needs 16-byte strides).
    extra = {"experts_implementation": "eager"} if _has_experts(config) else {}
    model = randomize(AutoModelForCausalLM.from_config(config, attn_implementation="eager", **extra), seed=seed).eval()
    model = model.to(dtype)
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    if edit_config is not None:
        path = directory / "config.json"
        path.write_text(json.dumps(edit_config(json.loads(path.read_text())), indent=2))
    return model


def _has_experts(config: PretrainedConfig) -> bool:
    return any(getattr(config, field, None) for field in ("num_experts", "num_local_experts", "n_routed_experts"))


def save_case(name: str, case: Case, directory: Path) -> Saved:
    hf_model = build_and_save(case.config(), directory, edit_config=case.edit_config)
    vocab = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab, (BATCH, case.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf_model(tokens, output_hidden_states=True, output_attentions=True)
    assert out.logits.abs().max() > 1.0, f"{name}: the reference logits are too flat to discriminate"
    return Saved(name, case, directory, hf_model, tokens, out.logits, out.hidden_states, out.attentions)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def logit_differences(saved: Saved) -> dict[str, float]:
    """Max |our logits - transformers'| under each kernel (for the closing note's table)."""
    out = {}
    for kernel in KERNELS:
        model = wb.load_model(saved.directory, attn_impl=kernel)
        with torch.no_grad():
            out[kernel] = max_diff(model(saved.tokens), saved.logits)
    return out


def _rescale_patterns(pattern: torch.Tensor, hook) -> torch.Tensor:
    """A visible edit: head 0's pattern halved (rows no longer sum to one)."""
    pattern = pattern.clone()
    pattern[:, 0] *= 0.5
    return pattern


def saved_on_demand(cases: dict[str, Case]):
    """A module-scoped ``saved`` fixture: ``saved(name)`` builds and saves that case once, for a family
    module's own tests beyond the shared ones."""

    @pytest.fixture(scope="module")
    def saved(tmp_path_factory):
        built = {}

        def get(name: str) -> Saved:
            if name not in built:
                built[name] = save_case(name, cases[name], tmp_path_factory.mktemp(f"extra_{name}"))
            return built[name]

        return get

    return saved


def family_parity_tests(cases: dict[str, Case]) -> dict[str, Any]:
    """The module-scoped fixture and the tests, for a family module's ``globals().update(...)``."""

    @pytest.fixture(scope="module", params=sorted(cases))
    def family(request, tmp_path_factory) -> Saved:
        return save_case(request.param, cases[request.param], tmp_path_factory.mktemp(request.param))

    @pytest.mark.parametrize("attn_impl", KERNELS)
    def test_logits_and_hidden_states_match_transformers(family: Saved, attn_impl: str):
        model = wb.load_model(family.directory, attn_impl=attn_impl)
        assert model.cfg.dtype == torch.float32 and model.cfg.attn_impl == attn_impl
        L = model.cfg.n_layers
        names = [f"blocks.{l}.hook_resid_{kind}" for l in range(L) for kind in ("pre", "post")]
        with torch.no_grad():
            logits, cache = model.run_with_cache(family.tokens, names_filter=lambda n: n in names)
        assert max_diff(logits, family.logits) < TOLERANCE, family.name
        hidden = family.hidden_states
        assert len(hidden) == L + 1
        for layer in range(L):
            assert max_diff(cache[f"blocks.{layer}.hook_resid_pre"], hidden[layer]) < TOLERANCE, (family.name, layer)
            leaving = cache[f"blocks.{layer}.hook_resid_post"]
            if layer == L - 1:  # transformers reports the last hidden state after the final norm
                if not family.case.compare_last_hidden:
                    continue
                leaving = model.apply_final_norm(leaving)
            assert max_diff(leaving, hidden[layer + 1]) < TOLERANCE, (family.name, layer)

    @pytest.mark.parametrize("attn_impl", KERNELS)
    def test_patterns_match_transformers_and_are_editable(family: Saved, attn_impl: str):
        model = wb.load_model(family.directory, attn_impl=attn_impl)
        L = model.cfg.n_layers
        with torch.no_grad():
            _, cache = model.run_with_cache(family.tokens, names_filter=lambda n: n.endswith("hook_pattern"))
            for layer in range(L):
                assert max_diff(cache[f"blocks.{layer}.attn.hook_pattern"], family.attentions[layer]) < TOLERANCE
            hooks = [(f"blocks.{layer}.attn.hook_pattern", _rescale_patterns) for layer in range(L)]
            edited = model.run_with_hooks(family.tokens, fwd_hooks=hooks)
            eager = wb.load_model(family.directory, attn_impl="eager")
            expected = eager.run_with_hooks(family.tokens, fwd_hooks=hooks)
        assert max_diff(edited, expected) < TOLERANCE
        assert max_diff(edited, family.logits) > 100 * TOLERANCE, "the pattern edit should change the logits"
        assert all(not block.attn.hook_pattern._forward_hooks for block in model.blocks), "hooks left attached"

    def test_kv_cached_generation_equals_uncached(family: Saved):
        model = wb.load_model(family.directory, attn_impl="sdpa")
        new = 8
        prompt = family.tokens[:, : min(family.case.seq_len // 2, model.cfg.n_ctx - new)]
        cached, cached_logits = generate_tokens(model, prompt, new, use_kv_cache=True, stop_at_eos=False)
        uncached, uncached_logits = generate_tokens(model, prompt, new, use_kv_cache=False, stop_at_eos=False)
        assert torch.equal(cached, uncached)
        assert max_diff(cached_logits, uncached_logits) < TOLERANCE

    def test_bf16_checkpoint_loads_in_bf16_and_agrees_with_transformers(family: Saved, tmp_path):
        hf_bf16 = build_and_save(family.case.config(), tmp_path, dtype=torch.bfloat16,
                                 edit_config=family.case.edit_config)
        model = wb.load_model(tmp_path, attn_impl="eager")  # no dtype: the checkpoint's own
        assert model.cfg.dtype == torch.bfloat16
        # DeepSeek-V3's correction bias stays float32, as transformers keeps it (it decides close routes).
        kept_in_float32 = {n for n, p in model.named_parameters() if n.endswith("router_score_correction")}
        assert {p.dtype for n, p in model.named_parameters() if n not in kept_in_float32} == {torch.bfloat16}
        assert all(dict(model.named_parameters())[n].dtype == torch.float32 for n in kept_in_float32)
        with torch.no_grad():
            reference = hf_bf16(family.tokens).logits.float()
            logits = model(family.tokens).float()
        # Both round every op to bf16's 8 mantissa bits, in slightly different orders.
        if max_diff(logits, reference) < 0.06 * reference.abs().max().item():
            return
        # Where that noise is itself larger (Gemma: four norms a layer, whose 1 + w gains we store
        # rounded to bf16), ours must be about as accurate as transformers' own bf16 run: the median
        # over positions of the RMS distance from transformers' float32 run of the same weights at
        # most 1.5x its own. The median, because a router is discontinuous: a last-bit difference
        # can send a token to another expert in either bf16 run, moving that token's logits a lot.
        with torch.no_grad():
            exact = hf_bf16.float()(family.tokens).logits
        median_rms = lambda t: t.pow(2).mean(-1).sqrt().median().item()  # noqa: E731
        assert median_rms(logits - exact) < 1.5 * median_rms(reference - exact)

    return {"family": family,
            "test_logits_and_hidden_states_match_transformers": test_logits_and_hidden_states_match_transformers,
            "test_patterns_match_transformers_and_are_editable": test_patterns_match_transformers_and_are_editable,
            "test_kv_cached_generation_equals_uncached": test_kv_cached_generation_equals_uncached,
            "test_bf16_checkpoint_loads_in_bf16_and_agrees_with_transformers":
                test_bf16_checkpoint_loads_in_bf16_and_agrees_with_transformers}
