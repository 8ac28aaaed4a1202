"""Bad input gets one line on stderr and exit code 2: never a traceback, never a hang.

A corpus of malformed files (tests/corpus/) and options, each run through the real CLI in a new
process with a time limit (forked from one that imported memplan.cli once: tests/conftest.py forked_cli);
and hypothesis fuzzers feeding arbitrary size strings, YAML text and config.json objects to the
readers, which may only answer with a MemplanError.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.core.errors import MemplanError
from memplan.presets.catalog import load_model
from memplan.presets.hf_config import read_hf_config
from memplan.core.units import parse_size

CORPUS = Path(__file__).parent / "corpus"

CASES = [
    # (arguments, a fragment the one-line error must contain)
    (["estimate", "--model", CORPUS / "nonutf8.yaml"], "not UTF-8"),
    (["estimate", "--hf-config", CORPUS / "nonutf8.json"], "not UTF-8"),
    (["estimate", "--model", CORPUS / "gpu-int.yaml"], "gpu: expected a GPU preset name"),
    (["estimate", "--model", CORPUS / "gpu-list.yaml"], "gpu: expected a GPU preset name"),
    (["estimate", "--model", CORPUS / "hidden-true.yaml"], "hidden_size"),
    (["estimate", "--model", CORPUS / "layers-float.yaml"], "num_layers"),
    (["estimate", "--model", CORPUS / "typo.yaml"], "did you mean 'num_layers'"),
    (["estimate", "--model", CORPUS / "recompute-7.yaml"], "recompute must be one of none, selective, full (got 7)"),
    (["estimate", "--model", CORPUS / "parallel-list.yaml"], "'parallel' must be a mapping"),
    (["estimate", "--hf-config", CORPUS / "attention-dropout-null.json"], "attention_dropout"),
    (["estimate", "--hf-config", CORPUS / "attention-dropout-str.json"], "attention_dropout"),
    (["estimate", "--hf-config", CORPUS / "gpt2-resid-pdrop-null.json"], "resid_pdrop"),
    (["estimate", "--model", CORPUS / "billion-laughs.yaml"], "aliases"),
    (["estimate", "--model", CORPUS / "python-tag.yaml"], "plain YAML data only"),
    (["estimate", "--model", CORPUS / "dir.yaml"], "is a directory"),
    (["estimate", "--model", CORPUS / "attention-dropout-null.json"], "--hf-config"),
    (["estimate", "--model", "gpt-22b", "--gpu", CORPUS / "gpu-memory-no-unit.yaml"], "memory_bytes: give a size"),
    (["estimate", "--hf-config", "/dev/zero"], "larger than"),
    (["estimate", "--model", "gpt-22b", "--mem", "80Gb"], "bits"),
    (["estimate", "--model", "gpt-22b", "--mem", "80"], "give a number and a unit"),
    (["search", "--model", "gpt-22b", "--gpus", "8", "--mem", "0GB"], "must be positive"),
    (["search", "--model", "gpt3-175b", "--gpus", "64", "--seq-len", "300000000", "--mem", "80GB"], "64-bit"),
    (["search", "--model", "gpt3-175b", "--gpus", "12288", "--seq-len", "16000000", "--global-batch", "12288",
      "--mem", "80GB"], "64-bit"),
    (["estimate", "--model", "no-such-model"], "known: deepseek-v3, gemma-7b, gemma2-9b, gemma3-1b, gpt-1t"),
    (["estimate", "--model", "mixtral-8x7b", "--impl", "torch"], "no reference torch layer (--impl torch) MoE inventory"),
    (["estimate", "--model", "llama3-8b", "--moe-imbalance", "1.5"], "moe_imbalance is a mixture-of-experts field"),
    (["estimate", "--model", "mixtral-8x7b", "--moe-pad-to-capacity"], "moe_pad_to_capacity needs moe_capacity_factor"),
    (["estimate", "--model", "mixtral-8x7b", "--impl", "hf-sdpa", "--moe-imbalance", "2"],
     "modelled for --impl megatron / megatron-local"),
    (["estimate", "--hf-config", CORPUS / "moe-topk.json", "--impl", "hf-sdpa"], "moe_top_k=9 exceeds num_experts=8"),
    (["estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--qlora"], "need --lora R"),
    (["estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--lora", "8", "--lora-targets", "c_attn"],
     "unknown --lora-targets c_attn"),
    (["estimate", "--model", "llama3-8b", "--lora", "8"], "modelled for --impl hf-sdpa / hf-eager"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--batch-layout", "packed"],
     "--batch-layout packed is modelled for --impl hf-sdpa / hf-eager"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--ac", "selective-op", "--compile",
      "--float8", "rowwise"], "--compile --float8 with --ac selective-op is not traced"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--ac", "budget:0.5"],
     "needs the blocks compiled"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtune", "--recompute", "none", "--offload", "activations"],
     "torchtune's activation offloading runs with activation checkpointing"),
    (["estimate", "--model", "llama3-8b", "--impl", "torchtune", "--gpus", "2", "--tp", "2"],
     "memplan models its recipes without tensor or pipeline parallelism"),
    (["estimate", "--model", "mixtral-8x7b", "--impl", "torchtune", "--gpus", "1", "--tp", "1", "--pp", "1",
      "--recompute", "none"], "--impl torchtune models torchtune's Llama"),
]


def run(args, timeout=30):
    return subprocess.run([sys.executable, "-m", "memplan.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,fragment", CASES, ids=[" ".join(map(str, a[:3]))[-60:] for a, _ in CASES])
def test_corpus_gives_one_line_and_exit_2(args, fragment, forked_cli):
    p = forked_cli(args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("memplan: error:"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and fragment in lines[0], lines[0]
    assert len(lines[0]) < 400  # echoed values are bounded


def test_deeply_nested_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    p = run(["estimate", "--hf-config", path])
    assert p.returncode == 2 and "nested too deeply" in p.stderr and "Traceback" not in p.stderr


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_size_strings(text):
    try:
        n = parse_size(text)
    except MemplanError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(n, int) and n >= 0


def _refuses_or_reads(read, path):
    try:
        read(str(path))
    except MemplanError as err:
        assert "\n" not in str(err).strip() and len(str(err)) < 1000


yaml_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
MODEL_KEYS = ["name", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "norm",
              "ffn_hidden_size", "num_kv_heads", "attention", "dropout", "mlp"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200) | st.dictionaries(st.sampled_from(["model", "parallel", "training", "gpu", "x"]),
                                                st.dictionaries(st.sampled_from(MODEL_KEYS), yaml_values, max_size=8)
                                                | yaml_values, max_size=4).map(json.dumps))
def test_yaml_reader_fuzz(tmp_path, text):
    # JSON is YAML: structured documents reach the spec checks, raw text the parser
    path = tmp_path / "model.yaml"
    path.write_text(text)
    _refuses_or_reads(load_model, path)


HF_KEYS = ["architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
           "vocab_size", "num_key_value_heads", "max_position_embeddings", "attention_dropout", "hidden_act",
           "tie_word_embeddings", "n_layer", "n_embd", "n_head", "resid_pdrop", "n_inner"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(HF_KEYS), yaml_values, max_size=10),
       st.sampled_from(["LlamaForCausalLM", "GPT2LMHeadModel", "MistralForCausalLM", "Other"]))
def test_hf_config_reader_fuzz(tmp_path, data, arch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**data, "architectures": [arch]}))
    _refuses_or_reads(read_hf_config, path)
