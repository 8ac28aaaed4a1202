"""torchtune's distributed recipes' FSDP2 (--impl torchtune --fsdp2; memplan/memory/dp_stack.py): a unit per decoder
layer and the root (input embedding, final norm, output layer) gathered under every layer.

Hand derivation for Llama 3 8B (tests/test_launch_trainer.py: one layer LAYER = 218,112,000 parameters, the final
norm + output layer TAIL = 525,340,672, the untied input embedding EMB = 128256 x 4096 = 525,336,576): FSDP2 holds
3 layers (computing, prefetched, unsharded gradients) + TAIL + EMB, where plain ZeRO 3 counts one layer.

The measurement runs torchtune 0.6.1's own training.shard_model on a tiny torchtune Llama 3 (h 64, f 160, 4 heads of
16, 2 K/V heads, v 512, 3 layers, untied): a layer q, o 2 x 64^2 + k, v 2 x 64 x 32 + gate, up, down 3 x 64 x 160 +
two norms 2 x 64 = 43,136 parameters = 86,272 B in bf16; the root 512 x 64 (embedding) + 64 (norm) + 512 x 64
(output) = 65,600 = 131,200 B; LoRA r 8 on q, v adds per layer q's a + b 64 x 8 + 8 x 64 = 1,024 and v's
64 x 8 + 8 x 32 = 768: 1,792 parameters = 3,584 B."""

from __future__ import annotations

import os

import pytest

import memplan as api
from tests.test_launch_trainer import LAYER, PLAN, TAIL

EMB = 128256 * 4096
TUNE = dict(PLAN, impl="torchtune", tp=1, pp=1)


def _weights(**options) -> int:
    return int(api.estimate("llama3-8b", **TUNE, **options).estimate.stages[0].weights)


def test_tune_fsdp2_gathers_three_layers_and_the_root():
    # ZeRO 3 counts one layer: FSDP2 adds 2 more layers and the root, in bf16
    assert _weights(fsdp2=True) - _weights(zero=3) == (2 * LAYER + TAIL + EMB) * 2


def test_tune_fsdp2_lora_gathers_the_frozen_base():
    # LoRA's states count no gathered copy under ZeRO 3: the frozen base's layers + root gathered with the adapters;
    # 2 layers (computing, prefetched): a frozen base makes no unsharded gradients
    assert _weights(fsdp2=True, lora=8) - _weights(zero=3, lora=8) == (2 * LAYER + TAIL + EMB) * 2


def _torchao_nf4(n: int) -> int:
    # torchao's NF4Tensor (to_nf4, block 64, scaler block 256; measured in tests/test_torchtune_lora.py): n / 2 B of
    # 4-bit codes, one int8 scale per 64 values, one bf16 scaler per 256 blocks, 34 B per tensor
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 2 * -(-blocks // 256) + 34


def test_tune_fsdp2_qlora_gathers_the_nf4_base():
    # QLoRA: each layer's 7 linears are gathered as their NF4 storage (in bf16 elements: ceil(bytes / 2)), the two
    # norms (2 x 4096) in bf16, the root in bf16; before, the base was gathered as bf16 (the 405B row +69 %)
    linears = [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096] + [14336 * 4096] * 3  # q k v o, gate up down
    layer = LAYER - sum(linears) + sum(-(-_torchao_nf4(n) // 2) for n in linears)
    assert _weights(fsdp2=True, lora=8, qlora=True) - _weights(zero=3, lora=8, qlora=True) == (
        2 * layer + TAIL + EMB) * 2


@pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="~5 s of 2 gloo ranks: MEMPLAN_TITAN_SLOW=1")
@pytest.mark.parametrize("lora", [False, True])
def test_tune_shard_model_moments_measured(lora):
    pytest.importorskip("torchtune")
    from validation.fsdp2 import tune_rank_moments
    from validation.ranks import run_ranks

    # a layer while it computes (no prefetch on CPU) plus the root, resharded after the forward (torchtune passes
    # reshard_after_forward=True) and after the backward
    under = 86_272 + 131_200 + 3_584 * lora
    for moments in run_ranks(tune_rank_moments, 2, (lora,)):
        assert moments == {"layer forward": under, "after forward": 0, "layer backward": under, "after backward": 0}
