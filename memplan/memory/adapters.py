"""Weights, gradients and optimizer states of a LoRA / QLoRA run (peft): the base model frozen (its weights only,
in bf16, or with --qlora its layer linears in bitsandbytes NF4), the adapters trained in fp32 with their own
gradients and optimizer states (memplan/inventory/lora.py has the saved tensors and the target table).

The adapters: r x n_in (lora_A) + n_out x r (lora_B) per target linear and layer, fp32 (peft's
get_peft_model, autocast_adapter_dtype=True, upcasts bf16 adapters), so fp32 gradients, no master copy and
fp32 optimizer moments (torch AdamW keeps its states in the parameter's dtype).

NF4 storage per frozen linear of n weights, read from bitsandbytes' functional.quantize_4bit with
bnb_4bit_use_double_quant (compress_statistics=True), blocksize 64, and measured on CPU with bitsandbytes 0.50.2
(tests/test_lora.py sums every tensor of the QuantState): the packed codes ceil(n/2) uint8; the per-64 absmax
quantised to uint8 (ceil(n/64) bytes) in blocks of 256 with one fp32 absmax each (4 ceil(ceil(n/64)/256)
bytes); per tensor the 16-value NF4 code (fp32, 64 B), the fp32 offset (4 B) and the 256-value dynamic map of
the double quantisation (fp32, 1,024 B; copied to the weight's device for each tensor). 0.516 B per weight
against bf16's 2. transformers keeps lm_head, the embedding and the norms unquantised (bf16).

torchtune's LoRA (training.lora_impl "torchtune", memplan/inventory/lora.py): the adapters in the model's dtype
(bf16: its recipes build the model under set_default_dtype and validate_expected_param_dtype checks the adapters),
so their gradients and torch AdamW's moments are bf16 too. Its QLoRA stores every layer linear as torchao's
NF4Tensor (to_nf4, block_size 64, scaler_block_size 256), measured on CPU with torchao 0.18
(tests/test_torchtune_lora.py): quantized_data ceil(n/2) uint8, quantized_scalers n/64 int8, quantization_factor
n/(64 x 256) bf16, the bf16 scaler_mean and the 16-value bf16 nf4 table (34 B per tensor); torchao asserts that
n/64 is a multiple of 256. The embedding, output projection and norms stay bf16."""

from __future__ import annotations

from typing import Any

from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.core.training import TrainingSpec
from memplan.inventory.lora import LINEARS, targets_of
from memplan.memory.dp_stack import shard_bytes
from memplan.memory.param_group import ParamGroup
from memplan.memory.states import StateBytes

ADAPTER_BYTES = 4  # fp32 adapters, gradients and optimizer moments

NF4_BLOCK, NF4_ABSMAX_BLOCK = 64, 256  # bitsandbytes blocksize (4-bit) and double-quant blocksize
NF4_TENSOR_EXTRA = 16 * 4 + 4 + 256 * 4  # per tensor: the NF4 code, the offset, the double quantisation's map


TORCHAO_NF4_TENSOR_EXTRA = 2 + 16 * 2  # per tensor: the bf16 scaler mean and the bf16 NF4 table


def nf4_bytes(n: Any, lora_impl: str = "peft") -> Any:
    """Bytes of one weight tensor of n elements in bitsandbytes NF4 with double quantisation, or with torchtune in
    torchao's NF4Tensor (module docstring)."""
    blocks = -(-n // NF4_BLOCK)
    if lora_impl == "torchtune":
        return -(-n // 2) + blocks + 2 * (-(-blocks // NF4_ABSMAX_BLOCK)) + TORCHAO_NF4_TENSOR_EXTRA
    return -(-n // 2) + blocks + 4 * (-(-blocks // NF4_ABSMAX_BLOCK)) + NF4_TENSOR_EXTRA


def adapter_bytes(training: TrainingSpec) -> int:
    """Bytes per adapter element of its weight, gradient and each optimizer moment: peft's fp32, torchtune's in the
    model's dtype."""
    return training.weight_bytes if training.lora_impl == "torchtune" else ADAPTER_BYTES


def adapter_groups(model: ModelSpec, training: TrainingSpec) -> dict[str, ParamGroup]:
    """The adapters of one layer by the base parameter group they sit on (their gradients appear with it)."""
    r = training.lora_rank
    counts: dict[str, Poly] = {}
    for name in targets_of(training.lora_targets, training.lora_impl):
        n_in, n_out, group = LINEARS[name]
        poly = Poly.parse_sum(f"{r} {n_in} + {r} {n_out}" + (f" + {n_out}" if training.lora_dora else ""))  # DoRA's m
        counts[group] = counts[group] + poly if group in counts else poly
    return {g: ParamGroup(g, c, False, "layer") for g, c in counts.items()}


def frozen_linear_shapes(model: ModelSpec) -> list[tuple[str, str]]:
    """(rows, cols) of each layer linear bitsandbytes quantises (the Llama layout)."""
    return [(n_out, n_in) for n_in, n_out, _ in LINEARS.values()]


def gathered_base_layer(model: ModelSpec, training: TrainingSpec, values: dict, layer: Any) -> Any:
    """One layer's frozen base as ZeRO 3 all-gathers it, in elements of the weights' dtype (the unit
    memplan/memory/dp_stack.py counts in): `layer` itself, or with QLoRA its linears in NF4 (the quantised storage is
    what is sharded and gathered: torchao's NF4Tensor under torchtune's FSDP2, bitsandbytes' packed uint8 under
    accelerate's), the norms in the weights' dtype. Derived from the storage, not measured gathered."""
    if not training.qlora:
        return layer
    return layer + sum(-(-nf4 // training.weight_bytes) - n for n, nf4 in _nf4_linears(model, training, values))


def _nf4_linears(model: ModelSpec, training: TrainingSpec, values: dict) -> list[tuple[Any, Any]]:
    """(elements, NF4 bytes) of each layer linear QLoRA quantises."""
    out = []
    for rows, cols in frozen_linear_shapes(model):
        n = Poly.parse(rows).evaluate(values) * Poly.parse(cols).evaluate(values)
        out.append((n, nf4_bytes(n, training.lora_impl)))
    return out


def lora_states(model: ModelSpec, training: TrainingSpec, values: dict, params: Any, layers: Any, d: Any,
                zero: Any) -> tuple[StateBytes, Any]:
    """(StateBytes, adapter parameters) of one GPU holding `params` base parameters and `layers` layers."""
    per_layer = sum((g.count.evaluate(values) for g in adapter_groups(model, training).values()), 0)
    adapters = per_layer * layers
    base = params * training.weight_bytes
    if training.qlora:
        base = base + layers * sum(nf4 - n * training.weight_bytes for n, nf4 in _nf4_linears(model, training, values))
    each = adapter_bytes(training)
    weights = shard_bytes(base, d, zero >= 3) + shard_bytes(adapters * each, d, zero >= 3)
    gradients = shard_bytes(adapters * each, d, zero >= 2)
    optimizer = shard_bytes(adapters * training.optimizer_moments * each, d, zero >= 1)
    return StateBytes(weights, gradients, optimizer), adapters


def notes(training: TrainingSpec) -> list[str]:
    """What a LoRA / QLoRA estimate measured and what it derived."""
    if not training.lora_rank:
        return []
    targets = ", ".join(targets_of(training.lora_targets, training.lora_impl))
    if training.lora_impl == "torchtune":
        out = [f"LoRA r = {training.lora_rank} on {targets} (torchtune 0.6.1's LoRALinear): the base frozen, the "
               "adapters in the model's dtype with their gradients and optimizer states; the saved tensors measured "
               "per layer on CPU against torchtune's model (validation/torchtune.py); the adapters' backward "
               "transients not counted"]
        if training.qlora:
            out.append("QLoRA: the layer linears as torchao NF4Tensor (measured with torchao 0.18 on CPU); the "
                       "dequantised weight in each layer's backward derived from torchao's LinearNF4, not measured")
        return out
    out = [f"LoRA r = {training.lora_rank} on {targets} (peft 0.21.2): the base frozen (weights only), fp32 adapters "
           f"with fp32 gradients and optimizer states; the tensors peft's LoRA layers save and those the frozen layers "
           f"no longer save measured per layer on CPU (validation/hf.py); the adapters' backward transients not counted"]
    if training.qlora:
        out.append("QLoRA: the layer linears in bitsandbytes NF4 with double quantisation (0.516 B per weight; measured "
                   "with bitsandbytes 0.50.2 on CPU); the dequantised weight in each layer's backward derived from "
                   "bitsandbytes' code, not measured")
    if training.lora_dora:
        out.append("DoRA (use_dora): an fp32 magnitude vector per target, trained; per target its layer saves an "
                   "in x in fp32 identity (B A is built as lora_B(lora_A(eye))), the weight norm and scale vectors, "
                   "and the base and adapter outputs: measured with peft 0.21.2 on CPU (validation/dora.py); its "
                   "backward transients (the identity's gradient path) not counted")
    return out
