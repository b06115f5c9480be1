import pytest

from sglang_hs.server.capture_spec import (
    CaptureConfigError,
    CaptureSpec,
    check_architecture,
    default_layer_ids,
    final_states,
    last_choice,
    parse_last,
    parse_layer_ids,
    validate_layer_ids,
)


def test_default_is_eagle3_choice():
    assert default_layer_ids(61) == [2, 30, 58]  # DeepSeek-V3 / Kimi-K2
    assert default_layer_ids(8) == [2, 4, 5]  # the embedded tiny model
    with pytest.raises(CaptureConfigError, match="at least 8 layers"):
        default_layer_ids(7)


def test_ids_are_taken_verbatim_no_shift_when_first_is_one():
    # SGLang's set_eagle3_layers_to_capture would turn [1, 30, 57] into [2, 31, 58].
    assert CaptureSpec.resolve([1, 30, 57], False, 61, 7168).layers == (1, 30, 57)
    assert CaptureSpec.resolve([0], True, 61, 7168).describe()["hf_output_hidden_states_index"] == [0, 61]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("  ", "empty"),
        ("2,x,5", "'x' is not an integer"),
        ("2,,5", "'' is not an integer"),
        ("2.5", "'2.5' is not an integer"),
    ],
)
def test_parse_rejects_malformed(text, message):
    with pytest.raises(CaptureConfigError, match=message) as e:
        parse_layer_ids(text)
    assert str(e.value).startswith("--hs-layers:") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "empty"),
        ([-1, 2], "negative id -1"),
        ([2, 8], "id 8 is out of range .* is --hs-last"),
        ([2, 2, 5], r"duplicate id\(s\) \[2\]; did you mean --hs-layers 2,5\?"),
        ([5, 2, 4], "strictly increasing, got 5,2,4; did you mean --hs-layers 2,4,5\\?"),
    ],
)
def test_validate_rejects(ids, message):
    with pytest.raises(CaptureConfigError, match=message) as e:
        validate_layer_ids(ids, 8)
    assert "\n" not in str(e.value)


def test_architectures():
    assert check_architecture(["DeepseekV3ForCausalLM"]) == "DeepseekV3ForCausalLM"
    assert check_architecture(["DeepseekV2ForCausalLM"]) == "DeepseekV2ForCausalLM"
    assert check_architecture(["DeepseekV32ForCausalLM"]) == "DeepseekV32ForCausalLM"  # DSA: patches/dsa_torch_native
    for bad in (["LlamaForCausalLM"], [], None):
        with pytest.raises(CaptureConfigError, match="unsupported architecture"):
            check_architecture(bad)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "MistralLarge3ForCausalLM", "DeepseekV2ForCausalLM",
                                  "KimiK25ForConditionalGeneration"])
def test_sparse_attention_is_refused_by_config_under_any_class_name(arch):
    """SGLang 0.5.23 turns DeepSeek Sparse Attention on by config (configs/model_config.py is_deepseek_dsa:
    DeepseekV3ForCausalLM or MistralLarge3ForCausalLM with index_topk): a config carrying index_topk is
    refused whatever its class, as a dict (the launcher) or an object (the server), at the top level or
    in a wrapper's text_config; one line naming the reason. Without index_topk (or None) it passes."""
    import types

    is_deepseek_dsa = pytest.importorskip("sglang.srt.configs.model_config").is_deepseek_dsa

    top = {"architectures": [arch], "index_topk": 2048}
    if arch in ("DeepseekV3ForCausalLM", "MistralLarge3ForCausalLM"):
        assert is_deepseek_dsa(top)  # SGLang's own predicate: these would run DSA
    for config in (top, types.SimpleNamespace(**top), {"architectures": [arch], "text_config": {"index_topk": 64}},
                   types.SimpleNamespace(architectures=[arch], text_config=types.SimpleNamespace(index_topk=64))):
        with pytest.raises(CaptureConfigError, match=r"index_topk = (2048|64) .*DeepSeek Sparse Attention \(DSA") as e:
            check_architecture([arch], where="cfg", config=config)
        assert "\n" not in str(e.value)
    for config in ({"architectures": [arch]}, {"architectures": [arch], "index_topk": None}, None,
                   types.SimpleNamespace(architectures=[arch], text_config=None)):
        assert check_architecture([arch], config=config) == arch


def test_sparse_attention_config_is_served_as_deepseek_v32():
    """DeepseekV32ForCausalLM's own config carries index_topk: served (patches/dsa_torch_native.py), while
    the same config under the V3 class name is refused (test above)."""
    config = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}
    assert check_architecture(config["architectures"], config=config) == "DeepseekV32ForCausalLM"


@pytest.mark.parametrize("value, finals", [(None, ()), (False, ()), ("", ()), (True, ("post-norm",)), ("1", ("post-norm",)),
                                           ("post-norm", ("post-norm",)), ("pre-norm", ("pre-norm",)),
                                           ("both", ("post-norm", "pre-norm"))])
def test_hs_last_values_name_the_final_states_in_row_order(value, finals):
    spec = CaptureSpec.resolve([2, 4, 5], value, 8, 16)
    assert spec.finals == finals and spec.rows_per_token == 3 + len(finals) and spec.last == bool(finals)
    d = spec.describe()
    assert d["last_states"] == list(finals) and d["last"] == bool(finals) and final_states(d) == finals
    # HF output_hidden_states[n] is the post-norm state only; the pre-norm one is no HF index
    assert d["hf_output_hidden_states_index"] == [2, 4, 5] + ([8] if "post-norm" in finals else [])
    if finals:
        assert parse_last(last_choice(finals)) == finals


def test_a_manifest_before_pre_norm_means_post_norm():
    assert final_states({"last": True}) == ("post-norm",) and final_states({"last": False}) == ()


def test_unknown_hs_last_is_one_line_naming_the_flag():
    with pytest.raises(CaptureConfigError, match=r"^--hs-last: 'pre' is not one of post-norm, pre-norm, both") as e:
        parse_last("pre")
    assert "\n" not in str(e.value)


def test_pack_puts_the_final_states_after_the_layers():
    """What the overlay hands the copy: the store row of a token is [layers..., post-norm, pre-norm]."""
    import torch

    T, K, H = 3, 2, 4
    aux, post, pre = torch.randn(T, K * H), torch.randn(T, H), torch.randn(T, H)
    for value, want in [(None, [aux]), ("post-norm", [aux, post]), ("pre-norm", [aux, pre]),
                        ("both", [aux, post, pre])]:
        spec = CaptureSpec.resolve([1, 2], value, 4, H)
        rows, last = spec.pack(aux, post, pre)
        got = torch.cat([rows] + ([last] if last is not None else []), dim=1).view(T, spec.rows_per_token, H)
        assert torch.equal(got, torch.cat(want, dim=1).view(T, -1, H)), value


# DeepSeek-V4 (hyper-connections): hc_mult streams per token; Kimi-K3 refused.
V4_CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "hc_mult": 4, "hidden_size": 4096, "num_hidden_layers": 43,
             "index_topk": 512}


def test_v4_is_captured_and_its_index_topk_is_not_dsa():
    # V4's index_topk is its own compressed sparse attention's indexer, not V3.2's DSA under another name
    assert check_architecture(V4_CONFIG["architectures"], config=V4_CONFIG) == "DeepseekV4ForCausalLM"
    with pytest.raises(CaptureConfigError, match="index_topk"):
        check_architecture(["DeepseekV3ForCausalLM"], config={"index_topk": 512})


def test_v4_default_is_the_stream_mean_one_row_per_layer():
    from sglang_hs.server.capture_spec import hc_mult_of

    hc = hc_mult_of(V4_CONFIG)
    assert hc == 4 and hc_mult_of({"architectures": ["DeepseekV3ForCausalLM"], "hc_mult": 4}) == 1
    spec = CaptureSpec.resolve(None, "both", 43, 4096, hc_mult=hc)
    assert spec.streams == "mean" and spec.rows_per_layer == 1 and spec.num_aux == 3
    assert spec.rows_per_token == 5
    d = spec.describe()
    assert d["hc_mult"] == 4 and d["hc_streams"] == "mean" and d["rows_per_layer"] == 1
    assert "mean(-2)" in d["hc_convention"] and "hc_head" in d["hc_convention"]
    # SGLang's dspark capture of layer j is the output of layer j: id i (entering layer i) is its j = i - 1
    assert d["layer_ids"] == [2, 21, 40] and d["dspark_layer_ids"] == [1, 20, 39]


def test_v4_full_streams_are_hc_mult_rows_per_layer():
    spec = CaptureSpec.resolve([0, 5], "post-norm", 43, 4096, hc_mult=4, streams="full")
    assert spec.rows_per_layer == 4 and spec.num_aux == 8 and spec.rows_per_token == 9
    d = spec.describe()
    assert d["rows_per_layer"] == 4 and "[..., s, :]" in d["hc_convention"]
    assert d["dspark_layer_ids"] is None  # id 0 (the embedding) is no layer's output in SGLang's capture


def test_hc_streams_bad_input_is_one_line():
    with pytest.raises(CaptureConfigError, match="--hs-hc-streams: 'sum' is not one of mean, full"):
        CaptureSpec.resolve(None, None, 43, 4096, hc_mult=4, streams="sum")
    with pytest.raises(CaptureConfigError, match="--hs-hc-streams: only for models with hyper-connections") as e:
        CaptureSpec.resolve(None, None, 61, 7168, hc_mult=1, streams="full")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM"])
def test_kimi_k3_is_refused_in_one_line_with_the_reason(arch):
    with pytest.raises(CaptureConfigError, match=f"unsupported architecture '{arch}'.*Attention Residuals") as e:
        check_architecture([arch], config={"architectures": [arch]})
    assert "\n" not in str(e.value)
