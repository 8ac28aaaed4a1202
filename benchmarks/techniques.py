"""Print the README table "What each technique saves": Llama 3 8B (and Llama 2 7B with MsT) fine-tuned on one
80 GB A100 as transformers runs it, each memory saver alone and the best combination: the step's allocated peak
and the device memory it needs at s = 8192, and the longest sequence that fits (`estimate --max-seq`), beside the
MsT paper's published figures.

    PYTHONPATH=. python benchmarks/techniques.py

Every number comes from memplan (the same functions as `memplan estimate`); the row's command is printed with it.
"""

from __future__ import annotations

from memplan.plan.estimate import estimate
from memplan.plan.limits import max_seq_len
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_gpu, load_model
from memplan.core.units import format_bytes

GPU = load_gpu("a100-80gb")
BASE = "--impl hf-sdpa --precision bf16-true --gpus 1 --global-batch 1 --gpu a100-80gb"
PEAK_AT = 8192

# (row, options, the MsT paper's figure for this row: published, or derived from a published ratio)
ROWS = [
    ("none", "", "~5k (60k / 12: \"12x\")"),
    ("gradient checkpointing", "--recompute full", "~15k (60k / 4: \"4x\")"),
    ("MsT (auto pieces, with checkpointing)", "--recompute full --mst auto", "60k"),
    ("chunked loss (64 chunks)", "--loss-chunks 64", ""),
    ("checkpointing + chunked loss", "--recompute full --loss-chunks 64", ""),
    ("optimizer offload", "--offload optimizer", ""),
    ("8-bit Adam", "--optimizer adam8bit", ""),
    ("optimizer step in the backward", "--optimizer-in-backward", ""),
]
# combinations tried for "best": the longest sequence wins
COMBINATIONS = [
    "--recompute full --mst auto --offload optimizer",
    "--recompute full --loss-chunks 64 --offload optimizer",
    "--recompute full --mst auto --optimizer adam8bit",
    "--recompute full --mst auto --optimizer-in-backward",
]


def _training(options: str) -> dict:
    words = options.split()
    t: dict = dict(micro_batch=1, global_batch=1, precision="bf16-true")
    i = 0
    while i < len(words):
        flag = words[i]
        if flag == "--optimizer-in-backward":
            t["optimizer_in_backward"] = True
            i += 1
            continue
        value = words[i + 1]
        if flag == "--recompute":
            t["recompute"] = value
        elif flag == "--mst":
            t["mst"] = value
        elif flag == "--loss-chunks":
            t["loss_chunks"] = int(value)
        elif flag == "--offload":
            t["offload_optimizer_fraction"] = 1.0
        elif flag == "--optimizer":
            t["optimizer"] = value
        i += 2
    return t


def _config(model: str, options: str, s: int):
    return make_config(load_model(model), training=_training(options), model=dict(seq_length=s), gpus=1,
                       whole_model_per_rank=True)


def row(model: str, options: str) -> tuple[str, str, str]:
    e = estimate(_config(model, options, PEAK_AT), gpu=GPU, impl="hf-sdpa")
    longest = max_seq_len(_config(model, options, PEAK_AT), GPU.memory_bytes, "hf-sdpa", "cuda", GPU)
    return (format_bytes(e.device.allocated_peak, "GB"), format_bytes(e.device.total, "GB"),
            "none fits" if longest is None else f"{longest:,}")


def main() -> None:
    print(f"llama3-8b on one A100 80GB ({format_bytes(GPU.memory_bytes, 'GB')}): `memplan estimate --model llama3-8b "
          f"{BASE} OPTIONS --seq-len {PEAK_AT} --max-seq`\n")
    print(f"| technique | OPTIONS | allocated peak at s = {PEAK_AT} | device memory needed at s = {PEAK_AT} | "
          "longest sequence (tokens) | MsT paper (Llama 3 8B, A100 80GB) |")
    print("|---|---|---|---|---|---|")
    for name, options, paper in ROWS:
        print(f"| {name} | `{options}` | " + " | ".join(row("llama3-8b", options)) + f" | {paper} |")
    best = max(COMBINATIONS, key=lambda o: max_seq_len(_config("llama3-8b", o, PEAK_AT), GPU.memory_bytes,
                                                         "hf-sdpa", "cuda", GPU) or 0)
    print(f"| best combination | `{best}` | " + " | ".join(row("llama3-8b", best)) + " | |")
    print("\nllama2-7b, the same setup with MsT:\n")
    print("| technique | OPTIONS | allocated peak at s = 8192 | device memory needed | longest sequence (tokens) | "
          "MsT paper (Llama 2 7B, A100 80GB) |")
    print("|---|---|---|---|---|---|")
    for name, options, paper in (("gradient checkpointing", "--recompute full", ""),
                                 ("MsT", "--recompute full --mst auto", "84k")):
        print(f"| {name} | `{options}` | " + " | ".join(row("llama2-7b", options)) + f" | {paper} |")


if __name__ == "__main__":
    main()
