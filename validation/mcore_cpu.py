"""Make megatron-core 0.16.1 run on CPU: the run-time patches its CUDA assumptions need (``apply_cpu_patches``), and
the balanced (or given) MoE routing that stands in for its random logits (``_balanced_routing``, ``LOADS``).

megatron-core assumes CUDA in places that have nothing to do with what a layer saves; they
are patched at run time in the rank processes (``apply_cpu_patches``), never in site-packages:

* ``tensor_parallel/random.py``: the CUDA RNG tracker (``model_parallel_cuda_manual_seed``,
  ``CudaRNGStatesTracker.add`` / ``fork``, ``CheckpointFunction``) reads and sets the CUDA generator:
  routed to the CPU generator (``torch.get_rng_state`` / ``set_rng_state`` / ``manual_seed``);
* ``utils.py``: ``GlobalMemoryBuffer.get_tensor`` (the ``baddbmm`` input buffer of
  ``DotProductAttention``) allocates on ``torch.cuda.current_device()``: answered "cpu"; in 0.16.1 also
  RoPE's ``get_emb`` and SP's all-gather buffers (``tensor_parallel/mappings.py``, ``layers.py``):
  ``CURRENT_DEVICE_MODULES``;
* ``transformer/torch_norm.py``: ``WrappedTorchNorm`` refuses sequence parallelism (it cannot mark
  the norm weights for the SP gradient all-reduce, which a memory measurement does not need):
  built with ``config.sequence_parallel`` seen as False.

validation/mcore.py and validation/mcore_step.py run megatron-core with them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# ---------------------------------------------------------------------------------------------
# the CPU patches


class _Proxy:
    """A stand-in for a module's global ``torch``: everything from torch, except ``torch.cuda``'s
    attributes named in ``cuda``."""

    def __init__(self, **cuda) -> None:
        class _Cuda:
            def __getattr__(self, name):
                return getattr(torch.cuda, name)

        self.cuda = _Cuda()
        for name, fn in cuda.items():
            setattr(self.cuda, name, fn)

    def __getattr__(self, name):
        return getattr(torch, name)


# modules of megatron-core 0.16.1 beside utils.py that allocate on torch.cuda.current_device() in a path the
# cases run: RoPE's inv_freq (rotary_pos_embedding.get_emb), SP's all-gather buffers (tensor_parallel mappings /
# layers)
CURRENT_DEVICE_MODULES = ("models.common.embeddings.rotary_pos_embedding", "tensor_parallel.mappings",
                          "tensor_parallel.layers", "transformer.moe.router", "transformer.moe.token_dispatcher",
                          "transformer.moe.moe_utils", "transformer.moe.experts")


# the output storages megatron-core's CheckpointWithoutOutput frees in this process's current case (selective
# recompute of "layernorm": the norms' outputs, saved by the next linear, resized to 0 once it has run)
DISCARDED: set = set()


def apply_cpu_patches() -> None:
    """Make megatron-core run on CPU (see the module docstring); idempotent, rank processes only."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import torch_norm

    if getattr(random, "_memplan_cpu", False):
        return
    random.torch = _Proxy(get_rng_state=lambda *a, **k: torch.get_rng_state(),
                          set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
                          manual_seed=lambda seed: torch.manual_seed(seed))
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    for module in (utils, *(importlib.import_module(f"megatron.core.{m}") for m in CURRENT_DEVICE_MODULES)):
        module.torch = _Proxy(current_device=lambda: "cpu")
    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, *args, **kwargs):
        return original_new(cls, replace(config, sequence_parallel=False) if config.sequence_parallel else config,
                            *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = norm_new
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    # moe_utils imports te_general_gemm from Transformer Engine and leaves the name undefined without it
    # (0.16.1); RouterGatingLinearFunction then takes its torch.mm path
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    router.apply_random_logits = _balanced_routing
    from megatron.core.transformer import multi_latent_attention

    # without Transformer Engine megatron-core's extensions import stands MagicMocks in for TE's classes, and
    # MLA's isinstance(self.linear_proj, TELinear) refuses one: TE is absent, as HAVE_TE should say
    multi_latent_attention.HAVE_TE = False
    # the alltoall dispatcher copies its split sizes to the host on a side CUDA stream: one stand-in stream
    stream = _NoStream()
    # ... and moves them there only from a CUDA tensor (maybe_move_tensor_to_cpu): on CPU the split sizes
    # stay tensors, which gloo's all_to_all_single refuses; as on CUDA they become numpy arrays
    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda tensor, as_numpy=False, record_stream=False:
        tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor)
    token_dispatcher.torch = _Proxy(current_device=lambda: "cpu", Stream=lambda *a, **k: stream,
                                    current_stream=lambda *a, **k: stream, stream=lambda s: contextlib.nullcontext())
    # CheckpointWithoutOutput (selective recompute of "layernorm") sets its fp8 flag from `fp8 is not None`, so
    # the default fp8=False turns it on and its forward reaches Transformer Engine's FP8GlobalStateManager, an
    # undefined name without TE (0.16.1): the flag as its default means (off); nothing it saves changes
    original_init = random.CheckpointWithoutOutput.__init__

    def checkpoint_init(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = bool(fp8)

    random.CheckpointWithoutOutput.__init__ = checkpoint_init
    original_discard = random.CheckpointWithoutOutput.discard_output_and_register_recompute

    def discard(self, hook_tensor):
        DISCARDED.update(StorageWeakRef(o.untyped_storage()) for o in self.outputs)
        return original_discard(self, hook_tensor)

    random.CheckpointWithoutOutput.discard_output_and_register_recompute = discard
    random._memplan_cpu = True


class _NoStream:
    """A CUDA stream / event stand-in on CPU: work is synchronous, so waiting is nothing."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass


# the current case's uneven routing (McoreCase.loads; empty: balanced), set per case in the rank process
LOADS: list = []


def _balanced_routing(logits: torch.Tensor) -> torch.Tensor:
    """Stands in for megatron-core's ``moe_router_force_load_balancing`` (random logits, balanced only on
    average): token i of the rank's [s, b] tokens (flattened) gets a large bonus on experts (i k + j) mod E,
    j < k, so every expert receives exactly k s b / E of them (when E divides k s b). A constant added to
    the logits: autograd saves nothing more, and the router's own ops (softmax, top-k) run unchanged."""
    from megatron.core.transformer.moe.router import TopKRouter

    frame = sys._getframe(1)
    k = frame.f_locals["self"].topk if isinstance(frame.f_locals.get("self"), TopKRouter) else 1
    E = logits.shape[-1]
    n = logits.numel() // E
    idx = (torch.arange(n).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % E
    if LOADS:  # uneven: expert e receives LOADS[e] of the k n copies; copy j of token i goes to the (i + j n)-th
        # entry of the experts listed in order, each LOADS[e] times (distinct experts per token while LOADS[e] <= n)
        order = torch.repeat_interleave(torch.arange(E), torch.tensor(LOADS))
        idx = torch.stack([order[torch.arange(n) + j * n] for j in range(k)], dim=1)
    bonus = torch.zeros(n, E, dtype=logits.dtype).scatter_(1, idx, 64.0)
    return logits + bonus.view(logits.shape)
