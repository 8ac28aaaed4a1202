"""Record megatron-core 0.19.2's MoE measurements (`validate --mcore`'s one-process MoE cases) as the fixture
tests/data/mcore_0_19_2_moe.json that tests/test_mcore_019_moe.py compares memplan with. CI cannot install
0.19.2: its wheel declares Python >= 3.12, and it imports triton (megatron/core/transformer/moe/ops/paged_stash.py
through pipeline_parallel), which the CPU torch wheel does not bring. Run (a few minutes on CPU):

    pip install --no-deps --only-binary=:all: --python-version 3.12 --ignore-requires-python --target /tmp/mc019 megatron-core==0.19.2
    pip install --no-deps --only-binary=:all: --target /tmp/tri triton
    PYTHONPATH=/tmp/mc019:/tmp/tri:. python tests/record_mcore_019.py tests/data/mcore_0_19_2_moe.json
"""

import json
import sys

from memplan.check.cases import mcore_moe_cases
from memplan.check.validate import measured_saved_bytes


def main(path: str) -> None:
    cases = mcore_moe_cases()
    measured = measured_saved_bytes(cases)
    doc = {"command": __doc__.split("Run (a few minutes on CPU):")[1].strip(),
           "measured_with": sorted({note for note, _ in measured}),
           "cases": {c.name: saved for c, (_, saved) in zip(cases, measured)}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
