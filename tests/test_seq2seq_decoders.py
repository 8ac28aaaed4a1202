"""Issue 22: the decoders of BART and its copies (mBART, PLBart, Pegasus, Blenderbot, Blenderbot-Small, Marian) run
alone as causal LMs (``*ForCausalLM``; memplan/presets/hf_encoders.py ``_BART_LIKE``).

Their parameters equal transformers' count of the model on the meta device (the config classes' full-size defaults,
bart-large's by hand below, and the switches the reader reads); their traces equal a real CPU run's saved bytes.  The
decoders make an all-ones padding mask (``torch.ones(b, s)``) that transformers drops only by reading its values;
while tracing, validation/trace_saves.py ``_all_ones_masks`` reads it as a real run does, and without it the trace
keeps a b x s x s mask in every layer that a real run does not (checked here, so the test fails if the fix goes)."""

from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation import hf as _hf  # noqa: E402
from validation import trace_saves  # noqa: E402
from validation.registry import architectures, meta_params, tiny_config  # noqa: E402

import torch  # noqa: E402

FAMILIES = ["bart", "mbart", "plbart", "pegasus", "blenderbot", "blenderbot-small", "marian"]


def _defaults(model_type: str) -> dict:
    """The config class's own full-size defaults as a config.json (not shrunk)."""
    data = json.loads(json.dumps(_hf._transformers().CONFIG_MAPPING[model_type]().to_dict(), default=str))
    return {**data, "architectures": [architectures()[model_type]], "model_type": model_type}


def test_bart_large_decoder_by_hand():
    """BartConfig's defaults are bart-large's (v 50265, d 1024, 12 decoder layers of 16 heads, f 4096, 1024
    positions). BartForCausalLM by hand: a layer's self-attention 4 (1024^2 + 1024) = 4,198,400, its cross-attention
    (encoder_attn, built though not run alone) the same, fc1 1024 x 4096 + 4096 = 4,198,400, fc2 4096 x 1024 + 1024 =
    4,195,328, three LayerNorms 3 x 2 x 1024 = 6,144: 16,796,672, twelve of them 201,560,064; the word embeddings
    50265 x 1024 = 51,471,360, the learned positions (1024 + 2) x 1024 = 1,050,624 (BartLearnedPositionalEmbedding's
    offset 2), layernorm_embedding 2 x 1024 = 2,048; no final LayerNorm (post-LN layers); the head tied, no bias, and
    no final_logits_bias (a buffer of BartForConditionalGeneration only): 254,084,096."""
    assert registry.memplan_params(_defaults("bart")) == 254_084_096 == meta_params(_defaults("bart"))


@pytest.mark.parametrize("model_type", ["mbart", "plbart", "pegasus", "blenderbot", "blenderbot-small", "marian"])
def test_the_full_size_defaults_count_exactly(model_type):
    assert registry.memplan_params(_defaults(model_type)) == meta_params(_defaults(model_type))


@pytest.mark.parametrize("model_type, switches", [
    ("pegasus", dict(max_position_embeddings=64)),  # the frozen sinusoidal table, 64 x d_model (requires_grad false)
    ("marian", dict(max_position_embeddings=64)),
    ("mbart", dict(max_position_embeddings=64)),  # learned, 64 + 2 rows
    ("blenderbot", dict(max_position_embeddings=64)),  # learned, 64 rows (no offset)
    ("bart", dict(tie_word_embeddings=False)),  # lm_head v x d without bias
    ("marian", dict(tie_word_embeddings=False, decoder_vocab_size=512)),
    ("plbart", dict(decoder_ffn_dim=96, decoder_layers=3)),  # the decoder's keys, not the encoder's
])
def test_the_switches_count_exactly(model_type, switches):
    config = {**tiny_config(model_type), **switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config(model_type))


def test_what_is_not_counted_is_refused_in_one_line():
    """Marian's decoder embeddings are decoder_vocab_size rows, its head vocab_size: one v of memplan's cannot say."""
    with pytest.raises(MemplanError, match="decoder_vocab_size") as err:
        registry.memplan_params({**tiny_config("marian"), "decoder_vocab_size": 256})
    assert "\n" not in str(err.value) and "model YAML" in str(err.value)


def test_a_frozen_sinusoidal_table_bounds_s(run_cli, tmp_path):
    """Pegasus looks its sinusoidal table up by position id: s past max_position_embeddings rows fails in
    transformers (an index error), so memplan refuses it in one line; the estimate says how the table is counted."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny_config("pegasus"), "max_position_embeddings": 64}))
    code, out, err = run_cli("estimate", "--hf-config", str(path), "--seq-len", "65", "--impl", "hf-eager")
    assert code == 2 and "frozen sinusoidal position table's 64 rows" in err and len(err.strip().splitlines()) == 1
    notes = " ".join(read_hf_config(str(path)).notes)
    assert "the encoder is left out" in notes and "requires_grad false" in notes and "no gradient or optimizer state" in notes


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_traced_decoder_equals_a_real_cpu_run(model_type):
    """Traced (sdpa: is_causal, no mask, as the real run), read by memplan, bucket by bucket equal to what the real
    model saves on CPU at s = 32, b = 2 (post-LN BART, PLBart (attention dropout 0.1: sdpa's math path), Blenderbot-
    Small, Marian; pre-LN mBART, Pegasus, Blenderbot)."""
    row, config = registry.params_row(model_type, "")
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error


def test_traced_at_another_shape():
    row, config = registry.params_row("mbart", "")
    registry.trace_row(row, config, s=24, b=3)
    assert row.measured


def test_eager_attention_too():
    """--impl hf-eager: eager_mask always builds the mask (allow_is_causal_skip false), in the trace and the real run
    alike; the trace equals the real run at (s, b) = (20, 3)."""
    from validation.trace import trace_hf_config
    from validation.trace_measure import measure_hf_config, predicted_bytes

    config = tiny_config("bart")
    traced = trace_hf_config(config, impl="hf-eager", kernels="cpu", moments=False)
    assert predicted_bytes(traced, 20, 3) == measure_hf_config(config, 20, 3, impl="hf-eager")


def _sdpa_terms(model_type: str) -> list[tuple[str, list[int]]]:
    """The s^2 terms sdpa saves in the trace, with the layers that save them."""
    data = registry._walker().trace(tiny_config(model_type))
    return [(t["bytes"], g["layers"]) for g in data["layer_groups"] for t in g["terms"]
            if "scaled_dot_product" in t["id"] and "s^2" in t["bytes"]]


def test_without_the_mask_fix_the_trace_keeps_a_mask_a_real_run_does_not(monkeypatch):
    """validation/trace_saves.py ``_all_ones_masks`` taken away: transformers' _ignore_causal_mask_sdpa cannot read
    the fake all-ones mask, keeps it, and sdpa saves it in every layer (bf16, s x s per sequence: 2 s^2 b bytes),
    which the real CPU run does not (it drops the mask and passes is_causal)."""
    assert _sdpa_terms("bart") == []
    monkeypatch.setattr(trace_saves, "_all_ones_masks", contextlib.nullcontext)
    assert _sdpa_terms("bart") == [("2 s^2 b", [0, 1])]  # both layers
    row, config = registry.params_row("bart", "")
    registry.trace_row(row, config)
    assert row.traced and row.measured is False


def _causal_mask(make):
    """transformers' create_causal_mask for a tiny BART decoder (sdpa) under fake tensors, the 2-D mask ``make()``
    returns (made inside the fake mode and the fix's patch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import BartConfig
    from transformers.masking_utils import create_causal_mask

    config = BartConfig(d_model=16, decoder_attention_heads=2)
    config._attn_implementation = "sdpa"
    with FakeTensorMode(), trace_saves._all_ones_masks():
        embeds = torch.empty(2, 8, 16)
        return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=make(), past_key_values=None)


def test_only_a_mask_made_of_ones_reads_as_no_padding():
    assert _causal_mask(lambda: torch.ones(2, 8)) is None  # the decoder's own: dropped, as a real run drops it

    def written():
        mask = torch.ones(2, 8)
        mask[:, :3] = 0  # left padding: a real run keeps the mask
        return mask

    assert tuple(_causal_mask(written).shape) == (2, 1, 8, 8)
    assert tuple(_causal_mask(lambda: torch.zeros(2, 8) + 1).shape) == (2, 1, 8, 8)  # values unknown: kept
    assert tuple(_causal_mask(lambda: torch.ones(2, 9)[:, 1:]).shape) == (2, 1, 8, 8)  # a view: not followed
