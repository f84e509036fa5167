"""benchmarks.cuda_determinism: without a GPU it says so and exits 2 (the figures themselves come
from a GPU machine: benchmarks/results/gpu-checks_h100_2026-11-23.txt).

    pytest tests/benchmarks/test_cuda_determinism.py -q
"""

import pytest
import torch

from benchmarks import cuda_determinism


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert cuda_determinism.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
