"""FSDP2 as accelerate applies it, measured on CPU: which unsharded parameters are alive at which moment of a step.

The model is wrapped by accelerate's own `fsdp2_prepare_model` (accelerate 1.15, utils/fsdp_utils.py: each decoder
layer a unit, the untied input embedding a unit, the final norm and output layer a "tail" unit with
reshard_after_forward False, the root last) from the plugin an `--emit accelerate` YAML configures, over the current
torch.distributed process group (gloo on CPU). At four moments (the middle layer's MLP forward and backward, after
the forward, after the backward) it sums the bytes of the unsharded storages FSDP2 holds (each parameter's
all-gather output; FSDP2 frees them by resizing the storage to 0, so a storage counts while it has bytes).

On CPU nothing runs ahead of the host, so FSDP2's implicit prefetch (the next layer's all-gather issued while the
current layer computes on the GPU) cannot show here: memplan's second layer and the reduce-scatter input stay
derived (memplan/memory/dp_stack.py). `tune_unsharded_moments` measures torchtune's distributed recipes' wrapping
(training.shard_model) the same way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from validation.torchtune import import_torchtune


def tiny_llama(tied: bool = False) -> Any:
    """A 3-layer Llama (h 64, f 160, 4 heads, 2 K/V heads, v 512) in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def unsharded_moments(tied: bool = False) -> dict[str, int]:
    """Bytes of unsharded parameters alive at each moment of one step (the process group must exist)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    model = tiny_llama(tied)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, cpu_ram_efficient_loading=False)
    # the Accelerator's attributes fsdp2_prepare_model reads (Accelerator(cpu=True) would pick DDP instead)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                  device=torch.device("cpu"), is_main_process=True, mixed_precision="no")
    return step_moments(fsdp2_prepare_model(accelerator, model), lambda m: m.model.layers[1].mlp,
                        lambda m, x: m(input_ids=x, labels=x).loss)


def step_moments(model: Any, mlp_of: Any, loss_of: Any) -> dict[str, int]:
    """The bytes of unsharded parameters FSDP2 holds in `model` (already wrapped) at the middle layer's MLP (`mlp_of`)
    forward and backward, after the forward and after the backward of one step whose loss `loss_of(model, x)` gives."""
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]

    def unsharded() -> int:
        seen, total = set(), 0
        for unit in units:
            group = unit._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else []:
                for t in getattr(param, "all_gather_outputs", None) or []:
                    storage = t.untyped_storage()
                    if storage.nbytes() and storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        total += storage.nbytes()
        return total

    moments: dict[str, int] = {}
    mlp = mlp_of(model)
    mlp.register_forward_hook(lambda *_: moments.__setitem__("layer forward", unsharded()))
    mlp.register_full_backward_hook(lambda *_: moments.__setitem__("layer backward", unsharded()))
    x = torch.randint(0, 512, (1, 16))
    loss = loss_of(model, x)
    moments["after forward"] = unsharded()
    loss.backward()
    moments["after backward"] = unsharded()
    return moments


def tune_unsharded_moments(lora: bool = False) -> dict[str, int]:
    """`step_moments` of torchtune 0.6.1's own shard_model (its distributed recipes' wrapping: a unit per decoder
    layer, reshard_after_forward true, then the root) on a tiny torchtune Llama 3 of the same shapes as `tiny_llama`
    (untied); `lora`: LoRA r 8 on q, v (the recipe's base frozen, adapters trainable, in the same units)."""
    import_torchtune()  # torchao's NF4 module moved (validation/torchtune.py)
    training = tune_distributed()
    from torchtune.models.llama3 import llama3, lora_llama3
    from torchtune.modules import TransformerSelfAttentionLayer

    torch.manual_seed(0)
    shapes = dict(vocab_size=512, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64,
                  intermediate_dim=160)
    model = (lora_llama3(lora_attn_modules=["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **shapes) if lora
             else llama3(**shapes)).to(torch.bfloat16)
    if lora:  # the recipe's set_trainable_params: only the adapters train
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    training.shard_model(model, [lambda n, m: isinstance(m, TransformerSelfAttentionLayer)], cpu_offload=False,
                         reshard_after_forward=True)
    return step_moments(model, lambda m: m.layers[1].mlp,
                        lambda m, x: torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten()))


def rank_moments(rank: int, world: int, tied: bool = False) -> dict[str, int]:
    """validation.ranks.run_ranks entry: `unsharded_moments` on rank `rank` of `world`."""
    return unsharded_moments(tied)


def tune_distributed() -> Any:
    """torchtune's training/_distributed.py (shard_model) loaded on its own: the torchtune.training package's
    __init__ imports its quantization module, which needs a torchao layout class newer torchao dropped."""
    name = "torchtune.training._distributed"
    if name not in sys.modules:
        path = Path(importlib.util.find_spec("torchtune").origin).parent / "training" / "_distributed.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def tune_rank_moments(rank: int, world: int, lora: bool = False) -> dict[str, int]:
    """validation.ranks.run_ranks entry: `tune_unsharded_moments` on rank `rank` of `world`."""
    return tune_unsharded_moments(lora)


if __name__ == "__main__":  # python -m validation.fsdp2: the moments on each of 2 gloo ranks, untied and tied
    from validation.ranks import run_ranks

    for tied in (False, True):
        print(f"tied={tied}:", run_ranks(rank_moments, 2, (tied,)))
    for lora in (False, True):
        print(f"torchtune lora={lora}:", run_ranks(tune_rank_moments, 2, (lora,)))
