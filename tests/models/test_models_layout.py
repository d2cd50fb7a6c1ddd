"""The decoder's modules depend one way: the model (``decoder``) on the attention dispatch
(``attention``), the inference-only rewrites (``inference``) and the kernels (``fused_ops``,
``fused_linear``, ``cpu_gemm``, ``eager_ops``); none of those imports the model back, and nothing in
``areno.models`` imports ``torch.distributed`` (the model is plain PyTorch)."""

import ast
from pathlib import Path

import pytest
import torch

import areno.models
from areno.models import Decoder, PackedCausalAttention, inference, tiny_config

grimp = pytest.importorskip("grimp")  # import-linter brings it (the test extra)

LOWER = ["attention", "inference", "fused_ops", "fused_linear", "cpu_gemm", "eager_ops"]


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("areno", include_external_packages=False)


@pytest.mark.parametrize("name", LOWER)
def test_the_parts_never_import_the_model(graph, name):
    assert not graph.chain_exists(importer=f"areno.models.{name}", imported="areno.models.decoder")


def test_the_model_imports_its_parts(graph):
    direct = graph.find_modules_directly_imported_by("areno.models.decoder")
    assert {"areno.models.attention", "areno.models.inference", "areno.models.eager_ops"} <= direct


def test_no_model_module_imports_torch_distributed():
    root = Path(areno.models.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not any(n.startswith("torch.distributed") for n in names), f"{path.name}:{node.lineno}"


def test_inference_rewrites_keep_the_model_values():
    """``inference.fuse_projections`` over a model's layers and a ``CpuGemmPacks`` of it change how
    no-grad forwards multiply, not what they compute (fp32 summation order aside)."""

    torch.manual_seed(0)
    config = tiny_config(128, hidden_size=64, layers=2, heads=4, kv_heads=2, initializer_range=0.2)
    model = Decoder(config).eval()
    ids, pos, cu = torch.randint(0, 128, (12,)), torch.arange(12), torch.tensor([0, 12])
    with torch.no_grad():
        ref = model.logits(model(ids, pos, PackedCausalAttention(cu)))
        inference.fuse_projections(model.model.layers)
        assert inference.projections_fused(model.model.layers)
        packs = inference.CpuGemmPacks()
        packs.pack(model, batch_hint=8)
        got = model.logits(model(ids, pos, PackedCausalAttention(cu)))
        packs.unpack()
        inference.unfuse_projections(model.model.layers)
    assert len(packs) == 0 and not inference.projections_fused(model.model.layers)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
