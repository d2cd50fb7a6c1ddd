import pytest
import torch

from areno.models import fused_ops
from bench import decode_mlp


@pytest.mark.skipif(fused_ops.available(), reason="the refusal is for machines without CUDA and Triton")
def test_refuses_without_cuda_naming_what_it_needs(capsys):
    with pytest.raises(SystemExit):
        decode_mlp.main([])
    assert "CUDA with triton" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_small_case_on_the_gpu():
    rec = decode_mlp.main(["--rows", "4", "--layers", "2", "--dims", "128", "384"])
    case = rec["cases"][0]
    assert rec["figure"] > 0 and rec["baseline"] > 0 and case["rows"] == 4
    # both arms near the float64 MLP: bf16 roundings, not a wrong product
    assert case["rel_error"] < 0.02 and case["cublas_rel_error"] < 0.02
