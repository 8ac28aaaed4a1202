"""The optimizers memplan models: what each keeps per parameter between steps (its states) and what
its step allocates on top (its temporaries), from the shapes of the parameter tensors.

Sizes are per GPU, before ZeRO sharding (memplan/memory/states.py shards the states, memplan/memory/timeline.py
places the temporaries in the step's optimizer event). `s` is the bytes of one optimizer state value
(`optimizer_state_bytes`: 4 with fp32 master weights, 2 for bf16-true, where torch keeps the states in
the parameters' dtype), `p` the bytes of a stepped parameter (the master copy's, else the weights'),
n = r x c the elements of an r x c matrix (n of a vector).

States (besides the master copy, which every optimizer steps when there is one):

| optimizer      | states per parameter tensor                                   | source                                   |
|----------------|---------------------------------------------------------------|------------------------------------------|
| adamw          | 2 n s (exp_avg, exp_avg_sq)                                   | torch/optim/adam.py `_init_group`        |
| sgd            | n s (momentum_buffer)                                         | torch/optim/sgd.py:361 (momentum != 0)   |
| sgd-nomomentum | none                                                          | torch/optim/sgd.py:357 (momentum == 0)   |
| adafactor      | matrix: (r + c) s (row_var, col_var); vector: n s (variance)  | torch/optim/_adafactor.py:100-113        |
| adam8bit       | n >= 4096: 2 n + 2 x 4 ceil(n / 256) B; smaller: 2 x 4 n B; 2 x 1 KiB quantile maps per optimizer | bitsandbytes optim/optimizer.py:502-529 |
| muon           | hidden matrices: n s (momentum_buffer); the rest AdamW's 2 n s | torch/optim/_muon.py:156; Muon README   |
| lion           | n s (exp_avg)                                                 | lion-pytorch lion_pytorch.py (exp_avg)   |

torch's Adafactor has no first moment (no beta1); transformers' Adafactor keeps one only with beta1 set
(default None). bitsandbytes: blocksize 256 since 0.44.0 (PR #1365, commit aa57bd89; 2048 before),
min_8bit_size 4096, fp32 absmax per block of each state (read at commit 95f9af30); each optimizer's two 256-value fp32
quantile maps (`name2qmap`, shared by its 8-bit tensors: once, or once per 8-bit tensor with the step in the backward,
whose loop makes one optimizer per parameter). bitsandbytes 0.50.2 runs its 8-bit optimizers on CPU: these states
were measured with torchtune's model and optimizer_in_bwd (validation/torchtune.py measure_torchtune_8bit_states,
tests/test_torchtune.py); PagedAdamW8bit keeps the same states in CUDA unified memory (cudaMallocManaged, outside
torch's caching allocator; on CPU it falls back to ordinary tensors). Muon updates only
the 2-D weights inside the layers; embeddings, the LM head and the 1-D gains and biases go to AdamW
(Keller Jordan's MuonWithAuxAdam, KellerJordan/Muon README; torch.optim.Muon refuses non-2-D
parameters, torch/optim/_muon.py:130; Megatron-LM core_v0.16.1 megatron/core/optimizer/muon.py:249-258
does the same).

Temporaries of the step (measured on CPU by validation/step.py where torch runs them; peak_grid):

| optimizer, implementation | temporaries                                                        |
|---------------------------|--------------------------------------------------------------------|
| adamw foreach             | p x stepped parameters (exp_avg_sq_sqrt, adam.py `_multi_tensor_adam`) |
| adamw for-loop            | p x max over consecutive matrices of the previous `denom` + the current sqrt and denom (adam.py `_single_tensor_adam`; torch's default on CPU tensors; in megatron-core's order: the decayed matrices, reversed; measured: validation/mcore_step.py) |
| sgd(-nomomentum) foreach  | p x stepped parameters (grad + weight_decay x param, sgd.py:429)    |
| adafactor foreach         | p x stepped parameters (every matrix's r x c var_estimate, _adafactor.py:564, then the vectors' squared gradients beside them) |
| adafactor for-loop        | p x max over consecutive tensors of the previous var_estimate (the loop's `update` keeps it, _adafactor.py:413) + the current one with its row and column means (402, 393-399) |
| muon                      | max(Newton-Schulz of the largest hidden matrix: p n + 4 n + 4 m^2 B, m = min(r, c), _muon.py:55-66, 333-336; its AdamW's temporaries) |
| lion for-loop             | 2 p x the largest tensor (lion_pytorch.py update_fn: exp_avg.clone() and .add) — not measured |
| adam8bit, any fused       | none (one in-place kernel per tensor; bitsandbytes functional.py:1192) — adam8bit not measured |

With ZeRO the foreach temporaries cover the GPU's shard, the for-loop ones one shard of a tensor; Muon's
Newton-Schulz needs the whole matrix (a sharded Muon gathers it), so it is not divided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from memplan.core.arith import maximum
from memplan.core.training import OPTIMIZER_IMPLS_OF, TrainingSpec


@dataclass(frozen=True)
class Optimizer:
    name: str
    title: str  # how reports name its states: "optimizer (<title>)"
    source: str
    measured: bool  # validation/step.py runs it (torch on CPU) and peak_grid compares the step's peak

    @property
    def impls(self) -> tuple[str, ...]:
        return OPTIMIZER_IMPLS_OF[self.name]


MEASURED = "measured on CPU (memplan validate --peak)"
OPTIMIZER_INFO: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", "AdamW: 2 moments", f"read from torch/optim/adam.py (torch 2.13) and {MEASURED}; Megatron-LM "
              "runs a fused AdamW", True),
    Optimizer("sgd", "SGD: momentum buffer", f"read from torch/optim/sgd.py (torch 2.13) and {MEASURED}", True),
    Optimizer("sgd-nomomentum", "SGD without momentum: no state",
              f"read from torch/optim/sgd.py (torch 2.13: no momentum_buffer when momentum is 0) and {MEASURED}", True),
    Optimizer("adafactor", "Adafactor: factored second moment",
              f"read from torch/optim/_adafactor.py (torch 2.13) and {MEASURED}", True),
    Optimizer("adam8bit", "8-bit Adam: uint8 moments + fp32 absmax per 256",
              "read from bitsandbytes code (bitsandbytes/optim/optimizer.py: blocksize 256 since 0.44.0, "
              "min_8bit_size 4096) and measured on CPU with bitsandbytes 0.50.2 (its states; the CUDA step's "
              "temporaries derived: one in-place kernel)", False),
    Optimizer("muon", "Muon: momentum on hidden matrices, AdamW on the rest",
              f"read from torch/optim/_muon.py (torch 2.13; the rest in torch AdamW, Keller Jordan's "
              f"MuonWithAuxAdam split) and {MEASURED}", True),
    Optimizer("lion", "Lion: 1 moment", "derived from lion-pytorch's code (lion_pytorch/lion_pytorch.py), not "
              "measured (torch has no Lion)", False),
)}


def states_label(training: TrainingSpec) -> str:
    """How reports name the optimizer row: 'optimizer (Adafactor: master + factored second moment)'."""
    name, states = OPTIMIZER_INFO[training.optimizer].title.split(": ", 1)
    if training.lora_rank:  # peft LoRA: the fp32 adapters' states only, no master copy (memplan/memory/adapters.py)
        dtype = 'fp32' if training.lora_impl == 'peft' or training.weight_bytes == 4 else 'bf16'
        return f"optimizer ({name}: LoRA adapters' {states}, {dtype})"
    if training.master_weight_bytes:
        states = "master only" if training.optimizer == "sgd-nomomentum" else f"master + {states}"
    return f"optimizer ({name}: {states})"


def notes(training: TrainingSpec, impl: str, pinned: bool = False) -> list[str]:
    """What a report says about the optimizer: its implementation, where its states and temporaries
    come from (measured or derived from code); `pinned`: a search, which keeps it for every plan."""
    info = OPTIMIZER_INFO[training.optimizer]
    out = []
    if training.optimizer != "adamw":
        how = f"{impl} AdamW for the rest" if training.optimizer == "muon" else impl
        out.append(f"optimizer {info.title} ({how}): states and step temporaries {info.source}"
                   + ("; every plan uses it (search does not vary the optimizer)" if pinned else ""))
    if training.optimizer == "muon":
        out.append("Muon's Newton-Schulz iterations run on whole hidden matrices (a ZeRO-sharded Muon gathers "
                   "them): its step temporaries are not divided by the shard group")
    return out


def resolve_impl(training: TrainingSpec, default: str) -> str:
    """The implementation the optimizer runs: the one asked for (TrainingSpec checks it exists), else
    the training code's default (`Inventory.optimizer_impl`) where the optimizer has it, else the
    optimizer's own first one (Adafactor: for-loop, 8-bit Adam: fused, Lion: for-loop)."""
    impls = OPTIMIZER_IMPLS_OF[training.optimizer]
    if training.optimizer_impl is not None:
        return training.optimizer_impl
    return default if default in impls else impls[0]


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor on one GPU: `rows` x `cols` (cols None: a vector of `rows`), or `batch` such
    matrices stacked in one 3-D tensor (transformers' experts), `hidden`: a weight matrix inside the
    decoder layers. Sizes are scalars or numpy arrays (one per plan)."""

    rows: Any
    cols: Any
    hidden: bool
    batch: Any = 1

    @property
    def numel(self) -> Any:
        return self.rows if self.cols is None else self.batch * self.rows * self.cols


def _ceil(n: Any, d: Any) -> Any:
    return -(-n // d)


def state_bytes(training: TrainingSpec, tensors: Sequence[tuple[Tensor, Any]]) -> Any:
    """Bytes of the optimizer's own states (not the master copy) for `tensors`: (tensor, how many
    the GPU holds), before ZeRO sharding."""
    opt, s = training.optimizer, training.optimizer_state_bytes
    total: Any = 0
    qmaps: Any = 0  # an 8-bit tensor: the one optimizer's quantile maps (per tensor with the step in the backward)
    for t, k in tensors:
        n = t.numel
        if opt == "adamw":
            b = 2 * s * n
        elif opt in ("sgd", "lion"):
            b = s * n
        elif opt == "sgd-nomomentum":
            b = 0 * n
        elif opt == "adafactor":  # a 3-D tensor: row_var and col_var of each of its matrices (the last two dims)
            b = s * (n if t.cols is None else t.batch * (t.rows + t.cols))
        elif opt == "adam8bit":
            big = 1 * (n >= ADAM8BIT_MIN_SIZE)
            b = big * 2 * (n + ABSMAX_BYTES * _ceil(n, ADAM8BIT_BLOCK)) + (1 - big) * 2 * FP32 * n
            qmaps = maximum(qmaps, big)
            b = b + big * QMAP_BYTES * training.optimizer_in_backward
        elif opt == "muon":
            b = s * n * (1 if _is_hidden_matrix(t) else 2)
        else:  # pragma: no cover - TrainingSpec refuses other names
            raise ValueError(opt)
        total = total + b * k
    return total + qmaps * QMAP_BYTES * (not training.optimizer_in_backward)


FP32 = 4
ABSMAX_BYTES = 4  # bitsandbytes: one fp32 absmax per block of each 8-bit state
ADAM8BIT_BLOCK = 256  # bitsandbytes/optim/optimizer.py:524 (`blocksize = 256`, 2048 before 0.44.0)
ADAM8BIT_MIN_SIZE = 4096  # bitsandbytes Optimizer2State min_8bit_size default: smaller tensors keep fp32 states
QMAP_BYTES = 2 * 256 * FP32  # bitsandbytes' "dynamic" and "udynamic" quantile maps (create_dynamic_map), per optimizer


def muon_newton_schulz_bytes(t: Tensor, p: int) -> Any:
    """Peak temporaries of torch's Muon step on one r x c matrix (torch/optim/_muon.py:333-336 and
    `_zeropower_via_newtonschulz` 55-66, nesterov on; measured): the Nesterov update grad.lerp(buf) in
    the parameter's dtype (p n, held by the caller for the whole orthogonalisation), and from the second
    Newton-Schulz iteration on the old and the new bf16 iterate (2 x 2 n: `ortho_grad` is replaced only
    once addmm returns) beside the bf16 m x m Gram matrix and its polynomial (2 x 2 m^2, m = min(r, c))."""
    n = t.rows * t.cols
    m = t.rows - (t.rows - t.cols) * (t.rows > t.cols)
    return p * n + 2 * 2 * n + 2 * 2 * m * m


@dataclass(frozen=True)
class StageTensors:
    """The parameter tensors of one GPU of a stage in the order an optimizer's loop visits them:
    `first` (embeddings, present where `is_first`), one layer's `layer` (repeated `layers` times),
    `last` (final norm, present where `is_last`), the LM head where `has_head`; an MoE model's dense
    layers (`dense`, repeated `dense_layers` times) come before its MoE layers (`layer`)."""

    first: tuple[Tensor, ...]
    layer: tuple[Tensor, ...]
    last: tuple[Tensor, ...]
    head: tuple[Tensor, ...]
    layers: Any
    is_first: Any
    is_last: Any
    has_head: Any
    dense: tuple[Tensor, ...] = ()
    dense_layers: Any = 0

    def largest(self, fn=lambda t: t.numel, only=lambda t: True) -> Any:
        best: Any = 0
        for ts, on in ((self.first, self.is_first), (self.dense, 1 * (self.dense_layers > 0)), (self.layer, 1),
                       (self.last, self.is_last), (self.head, self.has_head)):
            for t in ts:
                if only(t):
                    best = maximum(best, fn(t) * on)
        return best

    def largest_pair(self, kept, own, only=lambda t: True) -> Any:
        """max over consecutive tensors of kept(previous) + own(current), in the order the loop visits them;
        `only`: the loop visits only these tensors (one parameter group)."""
        best: Any = 0

        def pair(a: Tensor, b: Tensor, on: Any = 1) -> None:
            nonlocal best
            best = maximum(best, (kept(a) + own(b)) * on)

        first, dense, layer, last, head = ([t for t in seq if only(t)] for seq in (
            self.first, self.dense, self.layer, self.last, self.head))
        has_dense = 1 * (self.dense_layers > 0)
        for seq, on in ((first, self.is_first), (dense, has_dense), (layer, 1), (last, self.is_last)):
            for a, b in zip(seq, seq[1:]):
                pair(a, b, on)
        if dense:  # dense layers, then the first MoE layer (all on the first stage)
            pair(dense[-1], dense[0], 1 * (self.dense_layers > 1))
            if layer:
                pair(dense[-1], layer[0], has_dense)
            if first:
                pair(first[-1], dense[0], self.is_first * has_dense)
        if layer:
            pair(layer[-1], layer[0], 1 * (self.layers > 1))
            if first:
                pair(first[-1], layer[0], self.is_first * (1 - has_dense))
            if last:
                pair(layer[-1], last[0], self.is_last)
        if head and (last or layer):
            before, on = (last[-1], self.is_last) if last else (layer[-1], 1)
            pair(before, head[0], self.has_head * on)
        return best


def temporaries(training: TrainingSpec, impl: str, params: Any, tensors: StageTensors, shard: Any) -> Any:
    """Bytes the optimizer step allocates on top of the states and gradients on one GPU (module
    docstring's table): `params` the GPU's parameters, `shard` the ranks its optimizer states are split
    over (ZeRO >= 1; else 1): foreach steps the GPU's shard, a for-loop one shard of a tensor at a time."""
    opt = training.optimizer
    p = training.master_weight_bytes or training.weight_bytes
    if opt == "adam8bit" or (impl == "fused" and opt != "muon"):
        return 0 * params
    if opt == "adamw" and impl == "for-loop":  # the previous tensor's denom lives until the current one's exists;
        # megatron-core's order: the weight-decayed group (the matrices), its gradient buffer's reverse order
        # (forward pairs a, b visited b then a: own(a) + kept(b)). A ZeRO shard is a contiguous range of that buffer:
        # it holds whole tensors, so the pair is not divided (the rank that holds it: measured at d = 2)
        return p * tensors.largest_pair(_adamw_own, _adamw_kept, only=_is_matrix)
    if opt in ("adamw", "sgd", "sgd-nomomentum") or (opt == "adafactor" and impl == "foreach"):
        return p * _ceil(params, shard)  # foreach: one temporary per stepped parameter
    if opt == "adafactor":  # for-loop: the previous tensor's var_estimate lives until the current one's exists
        return p * _ceil(tensors.largest_pair(_adafactor_kept, _adafactor_own), shard)
    if opt == "lion":
        return 2 * p * _ceil(tensors.largest(), shard)
    # muon: Newton-Schulz on whole hidden matrices; then its AdamW on the rest (foreach: one temporary each)
    ns = tensors.largest(lambda t: muon_newton_schulz_bytes(t, p), only=_is_hidden_matrix)
    if impl == "fused":
        return ns
    hidden = tensors.layers * sum((t.numel for t in tensors.layer if _is_hidden_matrix(t)), 0) + \
        tensors.dense_layers * sum((t.numel for t in tensors.dense if _is_hidden_matrix(t)), 0)
    return maximum(ns, p * _ceil(params - hidden, shard))


def _adamw_own(t: Tensor) -> Any:
    """torch's for-loop AdamW (adam.py `_single_tensor_adam`, torch 2.13): `exp_avg_sq.sqrt()` and its division by
    the bias correction (`denom`), both of the tensor's size, alive together."""
    return 2 * t.numel


def _adamw_kept(t: Tensor) -> Any:
    """The loop's local `denom` keeps the previous tensor's until the current one's is made."""
    return t.numel


def _is_matrix(t: Tensor) -> bool:
    """What megatron-core decays (its default no_weight_decay_cond leaves biases and 1-D gains out)."""
    return t.cols is not None


def _is_hidden_matrix(t: Tensor) -> bool:
    """A 2-D weight inside the layers (what Muon steps); 3-D expert tensors go to its AdamW, as
    torch.optim.Muon refuses parameters that are not 2-D (torch/optim/_muon.py:130)."""
    return t.hidden and t.cols is not None and isinstance(t.batch, int) and t.batch == 1


def _adafactor_own(t: Tensor) -> Any:
    """What torch's for-loop Adafactor makes for one tensor (_adafactor.py:387-410): a matrix's row and
    column means and its r x c var_estimate; a vector's squared gradient and var_estimate (a clone)."""
    return 2 * t.rows if t.cols is None else t.batch * (t.rows * t.cols + t.rows + t.cols)


def _adafactor_kept(t: Tensor) -> Any:
    """What of one tensor's step is still alive while the next tensor's var_estimate is made (the
    loop's locals `update` and, for a vector, `grad_squared` are replaced only then)."""
    return 2 * t.rows if t.cols is None else t.batch * t.rows * t.cols
