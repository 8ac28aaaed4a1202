"""The peak of whole training steps on a GPU: memplan's CUDA inventories (bool dropout masks, fp32
layer-norm statistics, 512-byte allocator blocks) against torch.cuda.max_memory_allocated, for the
same grid `memplan validate --peak` runs on CPU. Skipped without CUDA (CI has none)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.check.peak import peak_grid, run_peak  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_peaks_match_max_memory_allocated():
    results = run_peak(peak_grid(fake=True, device="cuda"))
    failed = [(r.case, r.predicted, r.measured, r.error) for r in results if not r.passed]
    assert not failed, failed
