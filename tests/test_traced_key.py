"""The key a shipped traced inventory is found by (memplan/inventory/traced_file.py, config_sha256): the
architecture fields of the config.json. A Hub config.json carries metadata (transformers_version, the storage
dtype, token ids, use_cache, _name_or_path, auto_map) that the shipped copy may not: with any such metadata the
shipped trace is found, in a process that cannot import torch; a change of an architecture field is another model.
(tests/test_trace.py checks that validation/'s copy of the key agrees.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.inventory.traced_file import config_sha256, inventory_dir
from memplan.presets.files import configs_dir

SHIPPED = configs_dir() / "traced"
DIRS = sorted(p.parent for p in SHIPPED.glob("*/config.json"))

# what the Hub's config.json files add or say differently (e.g. Qwen3-8B's: transformers_version 4.51.0,
# torch_dtype bfloat16, bos 151643, eos 151645; Llama's auto_map-free files, remote-code ones with auto_map)
HUB_METADATA = {"transformers_version": "4.57.1", "torch_dtype": "float32", "dtype": "float16",
                "_name_or_path": "org/some-model", "bos_token_id": 128000, "eos_token_id": [128001, 128009],
                "pad_token_id": None, "use_cache": False, "initializer_range": 0.5, "cache_implementation": "hybrid",
                "auto_map": {"AutoConfig": "configuration_x.XConfig"}}


def hub_file(data: dict) -> dict:
    return {**data, **HUB_METADATA, "architectures": data.get("architectures", []) + ["SomeOtherHead"]}


def test_there_are_shipped_traces():
    assert len(DIRS) >= 10


@pytest.mark.parametrize("directory", DIRS, ids=lambda d: d.name)
def test_hub_metadata_finds_the_shipped_trace_and_an_architecture_change_does_not(directory, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path))
    data = json.loads((directory / "config.json").read_text())
    hub = hub_file(data)
    found, note = inventory_dir(hub, json.dumps(hub), SHIPPED)
    assert found == str(directory) and "shipped" in note
    # a float written as an integer (10000 for 10000.0) is the same rope base
    if isinstance(data.get("rope_theta"), float):
        found, _ = inventory_dir({**hub, "rope_theta": int(data["rope_theta"])}, "{}", SHIPPED)
        assert found == str(directory)
    for field, value in (("hidden_size", data["hidden_size"] + 64), ("num_hidden_layers", 3),
                         ("vocab_size", data["vocab_size"] + 1)):
        other, note = inventory_dir({**hub, field: value}, "{}", SHIPPED)
        assert other != str(directory) and other.startswith(str(tmp_path)), field
        assert "no traced inventory ships" in note
    # every shipped file records the key of its directory's config.json
    for path in directory.glob("hf-*.yaml"):
        assert f"config_sha256: {config_sha256(data)}\n" in path.read_text(), path.name


def test_metadata_keys_do_not_count_architecture_keys_do():
    base = json.loads((SHIPPED / "qwen3-8b" / "config.json").read_text())
    assert config_sha256(base) == config_sha256(hub_file(base))
    nested = {"model_type": "gemma3", "text_config": {**base, "torch_dtype": "float32"}}
    assert config_sha256(nested) == config_sha256({**nested, "text_config": {**base, "use_cache": True}})
    for field in ("hidden_size", "num_attention_heads", "intermediate_size", "rope_theta", "tie_word_embeddings"):
        changed = {**base, field: (not base[field]) if isinstance(base[field], bool) else base[field] * 2}
        assert config_sha256(changed) != config_sha256(base), field
    assert config_sha256({**base, "sliding_window": None}) != config_sha256({k: v for k, v in base.items()
                                                                             if k != "sliding_window"})


_NO_TORCH = """
import json, sys, tempfile
from pathlib import Path
sys.modules["torch"] = None  # import torch fails (ImportError), as on a machine without it
sys.modules["validation.trace"] = None
from memplan.core.errors import MemplanError
from memplan.inventory.traced_file import file_name, load
from memplan.presets.hf_config import read_hf_config
hub, dirs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
tmp = Path(tempfile.mkdtemp())
for d in map(Path, dirs):
    path = tmp / (d.name + ".json")
    data = json.loads((d / "config.json").read_text())
    path.write_text(json.dumps({**data, **hub}))
    preset = read_hf_config(str(path))
    assert preset.model.inventory == str(d), (d, preset.model.inventory)
    assert load(str(d), "hf-eager", "cpu").origin.architecture == data["architectures"][0]  # every dir has it
    path.write_text(json.dumps({**data, **hub, "hidden_size": data["hidden_size"] * 2}))
    other = read_hf_config(str(path)).model.inventory
    assert other != str(d)
    try:
        load(other, "hf-eager", "cpu")
        raise SystemExit("traced without torch?")
    except MemplanError as err:
        assert "no torch" in str(err), err
    print("ok", d.name)
assert sys.modules["torch"] is None
"""


def test_hub_config_uses_the_shipped_trace_without_torch(tmp_path):
    """The real Hub file of each shipped model (its metadata added) estimates with --impl hf-* from the shipped
    trace in a process where `import torch` fails; a wider hidden size finds none and says torch is needed."""
    env = {"MEMPLAN_CACHE": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, json.dumps(HUB_METADATA), json.dumps(list(map(str, DIRS)))],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split().count("ok") == len(DIRS)
