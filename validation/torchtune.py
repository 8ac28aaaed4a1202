"""Trace what torchtune 0.6.1's Llama saves for backward, with memplan's tracer (validation/trace.py).

torchtune's ``llama3_2`` builder (the same TransformerDecoder as llama3 / 3.1) is built under FakeTensorMode in
bf16 (torchtune's recipes build under ``set_default_dtype(bfloat16)``) and run forward + cross-entropy on the
fp32 logits with symbolic s and b. One change to its code: ``Llama3ScaledRoPE.apply_scaling`` reads the
frequencies' values (a data-dependent branch under fake tensors), so the trace skips the scaling: it changes
the cache's values, not its shape, and the cache is a buffer (never counted as saved).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from validation.trace import poly_text, symbolic_saves


@contextlib.contextmanager
def _bf16_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def trace_torchtune_llama(vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                          checkpoint: bool = False) -> list[dict]:
    """The saved storages of one forward + loss of torchtune's Llama: dicts with module, op, dtype (str) and
    nbytes (memplan's Poly text in s and b). `checkpoint`: its recipes' enable_activation_checkpointing
    (training.set_activation_checkpointing around every TransformerSelfAttentionLayer)."""
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    def build():
        with _bf16_default():
            model = llama3_2(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                             embed_dim=hidden, max_seq_len=4096, intermediate_dim=ffn, tie_word_embeddings=False)
        if checkpoint:
            set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        return model.train()

    def forward(model, tokens, labels):
        logits = model(tokens)  # the recipes' loss on the fp32 logits (torch.nn.CrossEntropyLoss)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))

    def inputs(s, b):
        return torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)

    with mock.patch.object(Llama3ScaledRoPE, "apply_scaling", lambda self, freqs, *a, **k: freqs):
        _, storages, _ = symbolic_saves(build, forward, inputs, s_hint=128, b_hint=3)
    return [{"module": st["module"], "op": st["op"], "dtype": str(st["dtype"]).removeprefix("torch."),
             "nbytes": poly_text(st["nbytes"])} for st in storages]
