"""The ``gift`` block: every documented example is accepted, every bad key/value is
rejected with the key path, the value and what is allowed."""

import pytest

from deepspeed_gift.config import GiftConfig, get_gift_config

DOCUMENTED_EXAMPLES = [
    {},
    {"enabled": False},
    {"enabled": True, "format": "fp8_e4m3", "block_size": 128, "rounding": "nearest", "backend": "torch",
     "geometry": {"kind": "kfac_input", "rank": 32, "damping": 1e-3, "refresh_interval": 50,
                  "stats_decay": 0.95, "factor_decay": 0.95, "solver": "structured"},
     "layers": "measured", "others": "euclidean", "error_feedback": False, "start_step": 0,
     "telemetry": {"every": 50, "fidelity": True}},
    {"format": "fp8_e5m2", "block_size": 0, "geometry": {"kind": "identity"}, "layers": "all"},
    {"format": "fp8_e4m3", "scale": "e8m0", "block_size": 32},
    {"format": "fp8_e4m3", "scale": "e8m0"},
    {"format": "nvfp4", "error_feedback": True, "geometry": {"kind": "kfac_input", "rank": 16}},
    {"format": "nvfp4", "block_size": 16},
    {"format": "int8", "block_size": 64}, {"format": "int4", "rounding": "stochastic"},
    {"format": "bf16"}, {"format": "bf16", "rounding": "stochastic"}, {"format": "fp32", "geometry": {"kind": "identity"}},
    {"geometry": {"kind": "hadamard"}, "layers": ["*.mlp.*", "*.self_attn.o_proj"]},
    {"backend": "mpi"}, {"others": "bf16", "selection": {"min_gain": 0.1, "max_layers": 4}},
    {"geometry": {"solver": "cholesky", "method": "eigh", "collect_interval": 5}},
    {"telemetry": {"every": 0, "jsonl": "gift.jsonl", "monitor": False}, "seed": 3, "start_step": 10},
    {"selection": {"metric": "whitened"}, "geometry": {"damping_mode": "relative"}},
    {"selection": {"metric": "l2"}}, {"selection": {"metric": "optimizer"}},
]


@pytest.mark.parametrize("block", DOCUMENTED_EXAMPLES)
def test_documented_examples_are_accepted(block):
    cfg = get_gift_config({"gift": block})
    assert isinstance(cfg, GiftConfig)
    assert cfg.enabled == block.get("enabled", True)


def test_missing_block_means_disabled():
    assert get_gift_config({"zero_optimization": {"stage": 2}}).enabled is False


def test_defaults_resolve():
    cfg = get_gift_config({"gift": {}})
    assert (cfg.format, cfg.effective_block_size, cfg.geometry.rank, cfg.layers) == ("fp8_e4m3", 128, 32, "measured")
    assert get_gift_config({"gift": {"format": "nvfp4"}}).effective_block_size == 16
    assert get_gift_config({"gift": {"scale": "e8m0"}}).effective_block_size == 32
    assert get_gift_config({"gift": {"format": "bf16"}}).effective_block_size == 0
    # the relay's second hop: int8 per 32 under a quantized format, the main format when exact
    assert cfg.relay_codec_options() == {"name": "int8", "block_size": 32, "rounding": "nearest", "seed": 0,
                                         "kernels": "by_device"}
    assert get_gift_config({"gift": {"format": "nvfp4"}}).relay_codec_options()["name"] == "int8"
    assert get_gift_config({"gift": {"format": "fp32"}}).relay_codec_options()["name"] == "fp32"
    assert get_gift_config({"gift": {"relay_format": "fp8_e4m3"}}).relay_codec_options()["block_size"] == 128
    assert get_gift_config({"gift": {"layers": "measured"}}).layers == "measured"


# (block, key path that must be named, text that says what is allowed)
BAD = [
    ({"format": "fp9"}, "gift.format", "fp8_e4m3"),
    ({"selection": {"metric": "adam"}}, "gift.selection.metric", "'optimizer', 'l2' or 'whitened'"),
    ({"geometry": {"damping_mode": "scaled"}}, "gift.geometry.damping_mode", "'absolute' or 'relative'"),
    ({"format": 8}, "gift.format", "fp8_e4m3"),
    ({"block_size": -1}, "gift.block_size", "greater than or equal to 0"),
    ({"block_size": "128"}, "gift.block_size", "integer"),
    ({"block_size": 12.0}, "gift.block_size", "integer"),
    ({"format": "nvfp4", "block_size": 32}, "gift.block_size", "needs block_size 16"),
    ({"format": "bf16", "block_size": 128}, "gift.block_size", "no scales"),
    ({"relay_format": "int9"}, "gift.relay_format", "'int8'"),
    ({"relay_format": "nvfp4", "relay_block_size": 32}, "gift.relay_block_size", "needs block_size 16"),
    ({"format": "fp32", "relay_block_size": 32}, "gift.relay_block_size", "no scales"),
    ({"relay_format": "fp32", "rounding": "stochastic"}, "gift.relay_format", "exact"),
    ({"scale": "e8m0", "format": "int8"}, "gift.scale", "fp8"),
    ({"scale": "e8m0", "block_size": 128}, "gift.block_size", "needs block_size 32"),
    ({"scale": "fp16"}, "gift.scale", "e8m0"),
    ({"rounding": "up"}, "gift.rounding", "stochastic"),
    ({"format": "fp32", "rounding": "stochastic"}, "gift.rounding", "rounding must be 'nearest'"),
    ({"backend": "nccl"}, "gift.backend", "mpi"),
    ({"enabled": "yes"}, "gift.enabled", "boolean"),
    ({"enabled": 1}, "gift.enabled", "boolean"),
    ({"geometry": {"kind": "kfac"}}, "gift.geometry.kind", "kfac_input"),
    ({"geometry": {"kind": "adam"}}, "gift.geometry.kind: got 'adam'", "'adam_factored', 'identity' or 'hadamard', "
                                                                        "or a list of them"),
    ({"geometry": {"kind": ["kfac_input", "adam"]}}, "gift.geometry.kind.1: got 'adam'", "'adam_factored'"),
    ({"geometry": {"kind": ["identity", "kfac_input"]}}, "gift.geometry.kind", "'identity' is not listed"),
    ({"geometry": {"kind": ["kfac_input", "kfac_input"]}}, "gift.geometry.kind", "distinct kinds"),
    ({"geometry": {"kind": []}}, "gift.geometry.kind", "distinct kinds"),
    ({"geometry": {"kind": ["kfac_input", "adam_factored"]}, "layers": "all"}, "gift.geometry.kind",
     "needs gift.layers 'measured'"),
    ({"geometry": {"rank": 0}}, "gift.geometry.rank", "greater than or equal to 1"),
    ({"geometry": {"rank": 3.5}}, "gift.geometry.rank", "integer"),
    ({"geometry": {"damping": 0}}, "gift.geometry.damping", "greater than 0"),
    ({"geometry": {"damping": -1e-3}}, "gift.geometry.damping", "greater than 0"),
    ({"geometry": {"refresh_interval": 0}}, "gift.geometry.refresh_interval", "greater than or equal to 1"),
    ({"geometry": {"stats_decay": 1.0}}, "gift.geometry.stats_decay", "less than 1"),
    ({"geometry": {"factor_decay": -0.1}}, "gift.geometry.factor_decay", "greater than or equal to 0"),
    ({"geometry": {"solver": "qr"}}, "gift.geometry.solver", "structured"),
    ({"geometry": {"method": "lanczos"}}, "gift.geometry.method", "randomized"),
    ({"geometry": {"rnak": 32}}, "gift.geometry.rnak", "allowed keys here"),
    ({"geometry": 32}, "gift.geometry", "GeometryConfig"),
    ({"layers": "some"}, "gift.layers", "measured"),
    ({"layers": []}, "gift.layers", "non-empty list"),
    ({"layers": [""]}, "gift.layers", "non-empty"),
    ({"others": "fp8"}, "gift.others", "euclidean"),
    ({"error_feedback": "no"}, "gift.error_feedback", "boolean"),
    ({"start_step": -5}, "gift.start_step", "greater than or equal to 0"),
    ({"seed": -1}, "gift.seed", "greater than or equal to 0"),
    ({"telemetry": {"every": -1}}, "gift.telemetry.every", "greater than or equal to 0"),
    ({"telemetry": {"fidelity": "on"}}, "gift.telemetry.fidelity", "boolean"),
    ({"telemetry": {"evry": 5}}, "gift.telemetry.evry", "allowed keys here"),
    ({"selection": {"min_gain": 1.5}}, "gift.selection.min_gain", "less than 1"),
    ({"selection": {"max_layers": 0}}, "gift.selection.max_layers", "greater than or equal to 1"),
    ({"formt": "fp8_e4m3"}, "gift.formt", "allowed keys here"),
    ({"layers": "auto"}, "gift.layers: got 'auto'", "now 'measured'"),
    ({"geometry": {"method": "auto"}}, "gift.geometry.method: got 'auto'", "now 'by_width'"),
    ({"format": "auto"}, "gift.format: got 'auto'", "HF Transformers and Accelerate"),
    ({"layers": ["auto"]}, "gift.layers: got ['auto']", "no gift value is \"auto\""),
]


@pytest.mark.parametrize("block,path,allowed", BAD, ids=[b[1] + ":" + repr(b[0])[:40] for b in BAD])
def test_bad_values_name_the_key_value_and_allowed(block, path, allowed):
    with pytest.raises(ValueError) as info:
        get_gift_config({"gift": block})
    message = str(info.value)
    assert path in message
    assert allowed in message
    bad_value = list(block.values())[0]
    if not isinstance(bad_value, (dict, list)):
        assert repr(bad_value) in message or str(bad_value) in message


def test_block_must_be_an_object():
    with pytest.raises(ValueError, match="gift: got True"):
        get_gift_config({"gift": True})


def test_fingerprint_differs_when_a_key_differs():
    a = get_gift_config({"gift": {"geometry": {"rank": 16}}})
    b = get_gift_config({"gift": {"geometry": {"rank": 8}}})
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == get_gift_config({"gift": {"geometry": {"rank": 16}}}).fingerprint()
