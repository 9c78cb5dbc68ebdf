"""Each unclear error is an InputError / CheckpointError naming the argument, tensor or file;
NaN in a query propagates under every attention kernel as it does under eager."""

import pytest
import torch

from tests.unit.helpers import make_model
from workbench.errors import InputError

HOOK = "blocks.0.hook_resid_pre"


@pytest.fixture(scope="module")
def model():
    return make_model("gqa_rotary_rms_swiglu")


def tokens_BP():
    return torch.randint(0, 61, (2, 5))


@pytest.mark.parametrize("result", [lambda x: (x,), lambda x: (x, x), lambda x: [x]])
def test_forward_hook_returning_a_tuple_is_refused_naming_the_hook_point(model, result):
    with pytest.raises(InputError, match=f"'{HOOK}' returned a (tuple|list)"):
        model.run_with_hooks(tokens_BP(), fwd_hooks=[(HOOK, lambda x, hook: result(x))])
    assert model.attached_hooks() == {}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_integer_token_dtypes_run_exactly_as_int64(model, dtype):
    tokens = tokens_BP()
    assert torch.equal(model(tokens.to(dtype)), model(tokens))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_bool_and_float_tokens_are_refused_naming_tokens_and_the_dtype(model, dtype):
    with pytest.raises(InputError, match=rf"tokens: .*integer.*{dtype}"):
        model(tokens_BP().to(dtype))


@pytest.mark.parametrize("argument, value", [("stop_at_layer", 2.5), ("start_at_layer", "1"),
                                             ("stop_at_layer", True), ("start_at_layer", 1.0)])
def test_non_integer_layer_index_is_refused_naming_the_argument(model, argument, value):
    resid_BPD = torch.randn(2, 5, model.cfg.d_model)
    with pytest.raises(InputError, match=f"{argument} must be an integer"):
        model(resid_BPD if argument == "start_at_layer" else tokens_BP(), **{argument: value})


def test_start_at_layer_with_token_ids_says_it_takes_the_residual_stream(model):
    with pytest.raises(InputError, match=r"start_at_layer takes the residual stream \[batch, pos, d_model=32\]"):
        model(tokens_BP(), start_at_layer=1)
    with pytest.raises(InputError, match="start_at_layer takes the residual stream"):
        model("w1 w2", start_at_layer=0)
    # The residual stream itself still runs: from layer 1 it equals the full run.
    tokens = tokens_BP()
    resid_BPD = model(tokens, stop_at_layer=1)
    torch.testing.assert_close(model(resid_BPD, start_at_layer=1), model(tokens))


@pytest.mark.parametrize("argument, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                             ("temperature", -1.0), ("top_k", 0), ("top_k", 2.5),
                                             ("top_p", -1), ("top_p", 1.5), ("top_p", float("nan"))])
def test_bad_sampling_argument_is_refused_naming_it(model, argument, value):
    kwargs = {"temperature": 1.0, argument: value}
    with pytest.raises(InputError, match=f"^{argument} must be"):
        model.generate(tokens_BP(), max_new_tokens=2, verbose=False, **kwargs)


def test_saved_config_with_an_unknown_dtype_names_the_file_and_the_field(model, tmp_path):
    import json

    import workbench as wb
    from workbench.errors import CheckpointError

    directory = tmp_path / "saved"
    model.save(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "float7"}))
    with pytest.raises(CheckpointError, match=r"config\.json: dtype must be a floating-point .*'float7'"):
        wb.load_model(str(directory))


@pytest.mark.parametrize("pick, dtype", [(lambda names: next(n for n in names if "embed" in n), torch.int64),
                                         (lambda names: next(n for n in names if n.endswith(".w")), torch.bool)])
def test_weights_that_cannot_be_a_float_parameter_are_refused_naming_the_tensor(model, tmp_path, pick, dtype):
    from safetensors.torch import load_file, save_file

    import workbench as wb
    from workbench.errors import CheckpointError

    directory = tmp_path / "saved"
    model.save(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    name = pick(sorted(tensors))
    tensors[name] = tensors[name].round().to(dtype)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*tensor '{name}' has dtype {dtype}"):
        wb.load_model(str(directory))


MASKS = {"causal": dict(), "window": dict(sliding_window=2), "alibi": dict(alibi_slopes_H=torch.rand(4)),
         "padding": dict(key_mask_BS=torch.tensor([[True] * 5, [False] + [True] * 4])), "sinks": dict(sinks_H=torch.rand(4)),
         "decode": dict(q_offset=4)}


@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_query_gives_nan_where_eager_does(kernel, mask_name, bad):
    from workbench.components.attention_kernels import FAST_KERNELS, MaskSpec, eager_attention

    q_BHPK, k_BGSK, v_BGSK = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    q_BHPK[0, 1, 2, 3] = bad  # one element of head 1's query at position 2
    if mask_name == "decode":
        q_BHPK = q_BHPK[:, :, 2:3].contiguous()
    mask = MaskSpec(scale=0.3, **MASKS[mask_name])
    eager_BPHJ = eager_attention(q_BHPK, k_BGSK, v_BGSK, mask)
    fast_BPHJ = FAST_KERNELS[kernel](q_BHPK, k_BGSK, v_BGSK, mask)
    # Eager: that head's whole row is NaN (its softmax has NaN or inf - inf in it), nothing else.
    expected_nan = torch.zeros_like(eager_BPHJ, dtype=torch.bool)
    expected_nan[0, 0 if mask_name == "decode" else 2, 1] = True
    assert torch.equal(eager_BPHJ.isnan(), expected_nan)
    assert torch.equal(fast_BPHJ.isnan(), expected_nan)
    torch.testing.assert_close(fast_BPHJ.nan_to_num(0.0), eager_BPHJ.nan_to_num(0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_impl", ["sdpa", "flash"])
def test_nan_in_one_heads_query_propagates_through_the_model_as_under_eager(attn_impl):
    from tests.unit.helpers import same_weights

    eager = make_model("gqa_rotary_rms_swiglu", attn_impl="eager")
    fast = same_weights(eager, attn_impl=attn_impl)

    def poison(q_BPHK, hook):
        q_BPHK = q_BPHK.clone()
        q_BPHK[0, 2, 1, 0] = float("nan")
        return q_BPHK

    tokens = tokens_BP()
    hook = [("blocks.1.attn.hook_q", poison)]
    z = {}
    for name, m in (("eager", eager), ("fast", fast)):
        grab = [("blocks.1.attn.hook_z", lambda t, hook, name=name: z.setdefault(name, t.clone()))]
        m.run_with_hooks(tokens, fwd_hooks=hook + grab)
    assert z["eager"][0, 2, 1].isnan().all()
    assert torch.equal(z["fast"].isnan(), z["eager"].isnan())
