"""What a training step keeps and creates, as data: the Term / Moment / Inventory types (types.py), one module per
implementation (k22 / megatron: Megatron-LM; mcore: megatron-core's local spec; hf: transformers hand-written;
traced: transformers traced under fake tensors; moe, mla: experts and latent attention), the memory savers (mst,
chunked_loss, fp8), and assemble.py on top, which picks and composes them for a model, implementation and device."""
