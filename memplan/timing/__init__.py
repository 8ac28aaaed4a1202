"""The step-time model: FLOPs, communication, pipeline bubbles, recompute and offload traffic; estimated step time and
MFU for one plan (scalars) or many (numpy arrays)."""
