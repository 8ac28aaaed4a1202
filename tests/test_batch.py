"""The global batch in sequences and in tokens: --global-batch-tokens, tokens per step kept when s
changes, the unit in every output. Expected values are derived by hand in the comments."""

import json

import pytest

from memplan.core.errors import MemplanError
from memplan.core.units import parse_tokens


@pytest.mark.parametrize("text, tokens", [
    ("4194304", 4_194_304), ("4,194,304", 4_194_304), ("4M", 4_000_000), ("4Mi", 4 * 2**20),
    ("0.5B", 500_000_000), ("16Ki", 16_384), ("4M tokens", 4_000_000), ("2k", 2_000),
])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["abc", "4X", "0", "-3", "4MB", ""])
def test_parse_tokens_refuses(text):
    with pytest.raises(MemplanError):
        parse_tokens(text)


def plan(run_cli, *args):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_global_batch_tokens_exact(run_cli):
    # 4Mi tokens at s = 8192: 4,194,304 / 8,192 = 512 sequences
    p = plan(run_cli, "--global-batch-tokens", "4Mi")["plan"]
    assert (p["global_batch"], p["global_batch_tokens"]) == (512, 4_194_304)


def test_global_batch_tokens_rounded_to_what_b_d_divides(run_cli):
    # 4M tokens at s = 8192 = 488.28 sequences; llama3-8b's plan has b*d = 1*4: 122 x 4 = 488
    data = plan(run_cli, "--global-batch-tokens", "4M")
    assert data["plan"]["global_batch"] == 488
    assert any("nearest to the 4,000,000 tokens" in n for n in data["notes"])


def test_new_seq_len_keeps_the_presets_tokens_per_step(run_cli):
    # llama3-8b preset: 512 sequences x 8,192 = 4,194,304 tokens; at s = 4096 that is 1,024 sequences
    data = plan(run_cli, "--seq-len", "4096")
    assert (data["plan"]["global_batch"], data["plan"]["global_batch_tokens"]) == (1024, 4_194_304)
    assert any("kept in tokens" in n for n in data["notes"])


def test_explicit_global_batch_stays_sequences(run_cli):
    data = plan(run_cli, "--seq-len", "4096", "--global-batch", "64")
    assert (data["plan"]["global_batch"], data["plan"]["global_batch_tokens"]) == (64, 64 * 4096)


def test_both_batch_options_refused(run_cli):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--global-batch", "8", "--global-batch-tokens", "4M")
    assert code == 2 and "not both" in err and len(err.strip().splitlines()) == 1


def test_bad_token_count_is_one_line(run_cli):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--global-batch-tokens", "lots")
    assert code == 2 and "token count" in err and len(err.strip().splitlines()) == 1


def test_search_global_batch_tokens(run_cli):
    # 1Mi tokens at s = 8192 = 128 sequences, whatever the GPU count
    code, out, err = run_cli("search", "--model", "llama3-8b", "--gpus", "16", "--mem", "80GB",
                             "--global-batch-tokens", "1Mi", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["global_batch"] == 128
    assert all(p["global_batch_tokens"] == 2**20 for p in data["plans"])
