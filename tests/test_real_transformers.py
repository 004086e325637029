"""Real transformer architectures from transformers' own code (issue 28, item 7): a ViT (DeiT-tiny's
layout), a BERT-style encoder and a Llama-style decoder (RMSNorm, rotary, SiLU-gated MLP, grouped-query
attention), built from configs with random seeded weights at small sizes (qdebug.zoo.hf).

For each: prepare reports no float fallback (every op is quantized, folded as a constant, or one of
the documented ops); compare has a row for every quant point; step --drill, suggest and nan-trace run
end to end through the CLI -- and a healthy model raises no NaN alarm.  Skipped without transformers
(``pip install -e ".[models]"``; the README's test command installs it).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qdebug
from qdebug.engine import calibrate, prepare, quant_points

pytest.importorskip("transformers")

from qdebug.zoo.hf import BertClassifier, Llama, ViT  # noqa: E402  (after the skip)

CASES = {
    "vit": (ViT, dict(image_size=16, patch_size=8, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=48, num_classes=5), lambda g, n: torch.randn(n, 3, 16, 16, generator=g)),
    "bert": (BertClassifier, dict(vocab_size=120, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=16, num_classes=3),
             lambda g, n: torch.randint(0, 120, (n, 8), generator=g)),
    "llama": (Llama, dict(vocab_size=96, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
              lambda g, n: torch.randint(0, 96, (n, 8), generator=g)),
}
# Ops each architecture must run quantized (a name fragment of a quant point), not float.
EXPECTED_POINTS = {
    "vit": ("patch_embeddings.projection", "layernorm_before", "q_proj", "matmul", "softmax", "gelu", "classifier"),
    "bert": ("word_embeddings", "LayerNorm", "query", "matmul", "softmax", "intermediate", "pooler", "classifier"),
    "llama": ("embed_tokens", "input_layernorm", "q_proj", "neg", "softmax", "silu", "down_proj", "lm_head"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def arch(request, tmp_path_factory):
    name = request.param
    cls, kwargs, make_inputs = CASES[name]
    torch.manual_seed(0)
    model = cls(**kwargs).eval()
    g = torch.Generator().manual_seed(1)
    x = make_inputs(g, 24)
    with torch.no_grad():
        targets = model(x).argmax(-1)  # the float model scores 1.0: a healthy reference
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm = prepare(model, example_inputs=x[:4])
    calibrate(qm, [x[:12], x[12:]])
    folder = tmp_path_factory.mktemp(name)
    qdebug.save(model, folder / "float.pt", stage="float", model_kwargs=kwargs)
    qdebug.save(qm, folder / "calibrated.pt", stage="calibrated", model_kwargs=kwargs)
    torch.save({"inputs": x, "targets": targets}, folder / "data.pt")
    return name, model, qm, x, folder, [str(w.message) for w in caught]


def test_prepare_reports_no_float_fallback_and_quantizes_the_block(arch):
    name, model, qm, x, _, caught = arch
    assert not [m for m in caught if "no quantized kernel" in m], caught
    points = quant_points(qm)
    assert not [n for n, p in points.items() if p.fallback]
    for fragment in EXPECTED_POINTS[name]:
        assert any(fragment in n for n in points), (fragment, list(points))
    with torch.no_grad():
        ref, got = model(x), qm(x)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean())
    assert 10 < float(sqnr) < 60  # int8 everywhere: a real loss, no silent float path


def test_a_saved_architecture_reloads_and_computes_the_same(arch):
    _, model, qm, x, folder, _ = arch
    loaded, info = qdebug.load(folder / "calibrated.pt")
    assert info.stage == "calibrated"
    with torch.no_grad():
        assert torch.equal(loaded(x), qm(x))


def test_compare_has_a_row_for_every_activation_point(arch, cli):
    _, _, qm, _, folder, _ = arch
    run = cli("compare", folder / "float.pt", folder / "calibrated.pt", "--data", folder / "data.pt", "--format",
              "json")
    assert run.code == 0, run.err
    rows = {r["layer"]: r for r in json.loads(run.out)["rows"]}
    # no row for what an exporter folds: rotary tables, position arithmetic (equal in every stage)
    assert not [n for n, r in rows.items() if n.endswith((".cos", ".sin")) or r["note"] == "no tensor output"]
    for point_name, point in quant_points(qm).items():
        if point.kind == "activation" and point_name != "input":
            assert point_name in rows, point_name
            assert rows[point_name]["sqnr_db"] is not None and rows[point_name]["sqnr_db"] > 10, point_name


def test_step_drill_suggest_and_nan_trace_run_end_to_end(arch, cli):
    name, _, qm, _, folder, _ = arch
    common = ("--data", folder / "data.pt", "--metric", "top1")
    step = cli("step", folder / "float.pt", folder / "calibrated.pt", "--drill", *common, "--format", "json")
    assert step.code in (0, 1), step.err  # 1: the gate failed, a verdict
    steps = json.loads(step.out)["rows"]
    assert max(r["level"] for r in steps) >= 3  # drilled from the model down into its blocks
    suggest = cli("suggest", folder / "float.pt", folder / "calibrated.pt", *common, "--out", folder / "suggest")
    assert suggest.code == 0, suggest.err
    plan = json.loads((folder / "suggest" / "suggest.json").read_text())["plan"]
    assert plan["passed"] and plan["after"]["top1_ratio"] >= 0.99
    points = quant_points(qm)
    assert set(plan["points"]) <= set(points)  # it raises the model's own points, by name
    if plan["points"]:  # the plan it wrote is the one it verified
        assert (folder / "suggest" / "plan.toml").exists()
    trace = cli("nan-trace", folder / "calibrated.pt", "--data", folder / "data.pt", "--steps", 2, "--format",
                "json")
    assert trace.code == 0, trace.err  # a healthy model: no NaN alarm
    assert json.loads(trace.out)["first"] is None
