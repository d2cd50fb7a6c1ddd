import pytest
import torch

from bench import paged_decode


def test_the_old_split_rule_is_the_one_rounded_up():
    # the baseline the bench measures: 256 rows of two KV heads on 132 SMs split in two, 64 rows in five
    assert paged_decode.old_num_splits(256, 2, 640, 64, 132) == 2
    assert paged_decode.old_num_splits(64, 2, 640, 64, 132) == 5
    assert paged_decode.old_num_splits(1, 2, 640, 64, 132) == 8
    assert paged_decode.old_num_splits(1, 2, 64, 64, 132) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_naming_what_it_needs(capsys):
    with pytest.raises(SystemExit):
        paged_decode.main([])
    assert "CUDA with triton" in capsys.readouterr().err


@pytest.mark.gpu
def test_one_small_case_on_the_gpu():
    rec = paged_decode.main(["--rows", "8", "--contexts", "40", "--layers", "2", "--width", "8"])
    assert rec["figure"] > 0 and rec["baseline"] > 0
    assert rec["cases"][0]["splits"] == paged_decode.pd.auto_num_splits(8, 2, 128, 64, torch.device("cuda"))
