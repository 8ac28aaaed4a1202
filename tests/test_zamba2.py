"""Issue 22: Zamba 2 (memplan/presets/hf_hybrids.py ``_zamba2``; ModelSpec.layer_pattern Y, shared_blocks,
shared_adapter_rank, shared_attention_adapter; memory/states.py ``_zamba_shared``).

Parameters: the registry walk (tests/test_registry.py) checks the tiny config (a Mamba-2 layer and a hybrid one, its
shared block's adapters rank 8) against transformers' count of the model built on the meta device; here the switches
those defaults leave off (several shared blocks used in turn, more blocks than uses, q / k / v adapters) and the config
class's full-size defaults (Zamba2-2.7B's shapes) against the same count, and the refusals. Activations: a tiny Zamba 2
with two shared blocks, q / k / v adapters and rotary embeddings in the shared attention, traced and compared bucket by
bucket with what a real CPU run saves (s = 32, b = 2: two chunks of the scan's 16)."""

from __future__ import annotations

import json

import pytest

from memplan.core.errors import MemplanError

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memplan.check import registry  # noqa: E402
from memplan.memory.states import counter, layer_params  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation import hf as _hf  # noqa: E402
from validation.registry import architectures, meta_params, tiny_config  # noqa: E402
from validation.trace_config import hf_config  # noqa: E402

# hybrid layers 0, 2 and 3 (ids as the file writes them): blocks 0, 1, 0 in turn
_THREE_USES = dict(layers_block_type=["hybrid", "mamba", "hybrid", "hybrid", "mamba"], hybrid_layer_ids=[0, 2, 3],
                   num_hidden_layers=5)
# q / k / v adapters (2 h wide outputs: K / V heads as many as the query heads, else k + adapter does not add)
_ATTENTION_ADAPTERS = dict(use_shared_attention_adapter=True, num_key_value_heads=4, adapter_rank=4)


@pytest.mark.parametrize("switches", [
    dict(_THREE_USES, num_mem_blocks=2),  # two blocks, each with its uses' MLP adapters (2 + 1)
    dict(_THREE_USES, num_mem_blocks=4),  # more blocks than uses: only three built
    dict(_ATTENTION_ADAPTERS, use_conv_bias=False),  # the mixer's convolution keeps its bias (bias=True in the code)
    dict(_ATTENTION_ADAPTERS, intermediate_size=None, mamba_ngroups=2, mamba_d_conv=3),  # the MLP 4 h wide
])
def test_the_switches_count_exactly(switches):
    config = {k: v for k, v in {**tiny_config("zamba2"), **switches}.items() if v is not None or k not in switches}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config("zamba2"))


def test_the_gathered_layer_is_what_a_hybrid_layers_forward_calls(tmp_path):
    """ZeRO-3 gathers the modules a layer's forward calls: a hybrid layer's mixer, norm and linear, the one shared
    block it uses and its own adapters (of the adapters that block holds, one per use: the others are another use's),
    counted on transformers' model built on the meta device (two blocks over three uses, q / k / v adapters)."""
    config = {**tiny_config("zamba2"), **_THREE_USES, **_ATTENTION_ADAPTERS, "num_mem_blocks": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_hf_config(str(tmp_path / "config.json")).model
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf_config(config))
    uses = {layer: i for i, layer in enumerate(config["hybrid_layer_ids"])}
    called = [sum(p.numel() for name, p in layer.named_parameters()
                  if "adapter_list." not in name or f"adapter_list.{uses.get(j)}." in name)
              for j, layer in enumerate(built.model.layers)]
    assert layer_params(model, counter(model.symbols(t=1))) == max(called) < max(
        sum(p.numel() for p in layer.parameters()) for layer in built.model.layers)


def _defaults(**fields) -> dict:
    config = json.loads(json.dumps(_hf._transformers().CONFIG_MAPPING["zamba2"](**fields).to_dict(), default=str))
    return {**config, "architectures": [architectures()["zamba2"]], "model_type": "zamba2"}


@pytest.mark.parametrize("fields, meta", [
    # transformers' count of the model built on the meta device (validation/registry.py meta_params on these configs,
    # transformers 5.23): Zamba2Config's defaults (Zamba2-2.7B's shapes: 54 layers 2560 wide, 9 uses of one shared
    # block, MLP adapters rank 128), and the same with two blocks and q / k / v adapters
    ({}, 2_481_848_336),
    (dict(num_mem_blocks=2, use_shared_attention_adapter=True), 2_687_639_056),
])
def test_full_size_defaults_count_exactly(fields, meta):
    assert registry.memplan_params(_defaults(**fields)) == meta


@pytest.mark.parametrize("switches, says", [
    (dict(tie_word_embeddings=False), "unties the shared blocks"),  # transformers then ties nothing
    (dict(hybrid_layer_ids=[0]), "hybrid_layer_ids"),  # the adapters are indexed by them: forward's KeyError
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(n_mamba_heads=3), "not divisible by n_mamba_heads"),
])
def test_what_does_not_fit_is_refused_in_one_line(switches, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config("zamba2"), **switches})
    assert "\n" not in str(err.value)


def test_a_traced_zamba2_equals_a_real_cpu_run():
    """Two layers, each a use of its own shared block, with q / k / v adapters and rotary embeddings in the shared
    attention: traced with s a multiple of the scan's chunk (16), read by memplan, bucket by bucket equal to the saved
    bytes of a real CPU run of transformers' torch path at s = 32, b = 2 (the walk's tiny config checks a Mamba-2
    layer beside a hybrid one: `python -m memplan.check.registry zamba2`)."""
    row, config = registry.params_row("zamba2", "")
    config = {**config, **_ATTENTION_ADAPTERS, "layers_block_type": ["hybrid", "hybrid"], "hybrid_layer_ids": [0, 1],
              "num_mem_blocks": 2, "use_mem_rope": True}
    assert config["chunk_size"] == 16
    row.memplan_params, row.meta_params = registry.memplan_params(config), meta_params(config)
    registry.trace_row(row, config)
    assert row.memplan_params == row.meta_params and row.traced and row.measured, row.trace_error
