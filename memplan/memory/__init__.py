"""Bytes on one GPU for a plan: parameter and state counts (states), optimizers, the parallel rules (parallel), the
pipeline schedule (pipeline), every term's bytes under a plan (term_bytes), a stage's memory at its first backward
(stage), offload, and the step timeline whose maximum is the step's peak (timeline)."""
