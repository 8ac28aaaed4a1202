"""peft's DoRA (LoraConfig(use_dora=True), peft 0.21.2 tuners/lora/dora.py DoraLinearLayer) measured on CPU against
its LoRA: a transformers Llama in bf16 wrapped by get_peft_model with and without use_dora, one forward + loss,
every distinct storage autograd saves (parameters left out) and the trainable parameters.

DoRA's forward (DoraLinearLayer.forward) builds B A as lora_B(lora_A(eye(in))) (lora_A saves the in x in identity,
lora_B its output), divides the magnitude vector by the detached weight norm (the div saves the norm), and returns
(m / |W| - 1) * base_result + (m / |W|) * lora_result * scaling: the two muls save both scale vectors, the frozen
base linear's output (bf16) and the adapter's output (fp32, peft's fp32 adapters)."""

from __future__ import annotations

import torch

from .instruments import saved_storages


def measure_dora(s: int, b: int, hidden: int, ffn: int, heads: int, kv_heads: int, layers: int, vocab: int,
                 rank: int, targets: tuple[str, ...], dora: bool) -> dict[str, int]:
    """``saved``: bytes of the distinct non-parameter storages one forward + loss saves; ``trainable``: elements of
    the trainable parameters; ``trainable_bytes``: their bytes."""
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab,
                                   max_position_embeddings=s, tie_word_embeddings=False, bos_token_id=0,
                                   eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                               target_modules=list(targets), use_dora=dora))
    model.train()
    saved, pack = saved_storages([*model.parameters(), *model.buffers()])

    tokens = torch.randint(0, vocab, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    del loss
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"saved": sum(saved.values()), "trainable": sum(p.numel() for p in trainable),
            "trainable_bytes": sum(p.untyped_storage().nbytes() for p in trainable)}
