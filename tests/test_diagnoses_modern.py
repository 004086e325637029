"""compare's causes that know recurrent layers, attention and norms (issue 28, must-have 8).

Each cause is shown on a small seeded model that has the problem (the cause is named, with
its fix in the summary) and kept silent on healthy models -- a transformer block, an LSTM,
the demo CNN -- even with thresholds that flag every row (a false alarm is a bug).
Rules: docs/compare.md, "Diagnosis".
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from qdebug.engine import QConfig, calibrate, convert, engine_state, prepare, quant_points
from qdebug.engine.ops import register_module_category
from qdebug.tools.compare import compare

NEW_CAUSES = {"shared_scale", "cell_state_range", "softmax_collapse", "logits_clipped", "norm_input_outliers"}
FLAG_EVERYTHING = {"sqnr_db": 200.0, "isolated_sqnr_db": 200.0}


def _calibrated(model: nn.Module, batches: list, qconfig: dict | None = None, plan=None) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are listed by prepare
        prepared = prepare(model, QConfig.from_dict(qconfig or {}), example_inputs=batches[0], plan=plan)
    return calibrate(prepared, batches)


def _diagnoses(reference: nn.Module, model: nn.Module, batches: list, **kw) -> dict[str, str]:
    result = compare([("float", reference), ("q", model)], batches, **kw)
    return dict(zip(result.frame["layer"], result.frame["diagnosis"])), result


def _batches(shape, n=3, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) * scale for _ in range(n)]


# -- a transformer block ----------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, embed: int = 16, heads: int = 2):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed)
        self.attn = nn.MultiheadAttention(embed, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(embed)
        self.fc1, self.act, self.fc2 = nn.Linear(embed, 32), nn.GELU(), nn.Linear(32, embed)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def _massive(x: torch.Tensor) -> torch.Tensor:
    """Channel 3 of every token 300x the others (LLMs' "massive activations")."""
    x = x.clone()
    x[..., 3] *= 300.0
    return x


def _block() -> nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def test_a_healthy_transformer_block_gets_no_layer_specific_cause():
    batches = _batches((4, 10, 16))
    diagnoses, _ = _diagnoses(_block(), _calibrated(_block(), batches), batches, thresholds=FLAG_EVERYTHING)
    assert all(diagnoses.values())  # every row flagged: the rules, not the thresholds, stay silent
    assert not NEW_CAUSES & set(diagnoses.values()), diagnoses


def test_clipped_attention_logits_are_named_and_other_clipping_is_not():
    batches = _batches((4, 10, 16))
    model = _calibrated(_block(), batches)
    points = quant_points(model)
    for name in ("attn.bmm", "fc1"):  # a range 8x too narrow: QK^T, and a layer that feeds no softmax
        points[name].scale.mul_(0.125)
    diagnoses, result = _diagnoses(_block(), model, batches)
    assert diagnoses["attn.bmm"] == "logits_clipped", diagnoses
    assert diagnoses["fc1"] == "clipping", diagnoses
    assert result.meta["findings"]["q"]["at_fault"] == "attn.bmm"
    assert "attention logits clipped" in result.summary


class Attention(nn.Module):
    """Attention written inline: torch's SDPA, or by hand (q kᵀ / 4 -> softmax -> @ v)."""

    def __init__(self, inline: bool):
        super().__init__()
        self.q, self.k, self.v, self.inline = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), inline

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.inline:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / 4.0, -1) @ v


@pytest.mark.parametrize("inline", [True, False], ids=["sdpa", "by_hand"])
def test_clipped_logits_of_inline_attention_are_named(inline):
    def attention():
        torch.manual_seed(0)
        return Attention(inline).eval()

    batches = _batches((4, 10, 16))
    model = _calibrated(attention(), batches)
    quant_points(model)["matmul"].scale.mul_(0.125)  # q kᵀ: a range 8x too narrow
    diagnoses, _ = _diagnoses(attention(), model, batches)
    assert diagnoses["matmul"] == "logits_clipped", diagnoses
    assert "logits_clipped" not in {d for n, d in diagnoses.items() if n != "matmul"}, diagnoses


def test_norm_input_with_massive_activation_channels_is_named():
    batches = [_massive(b) for b in _batches((4, 10, 16))]
    reference = _block()
    with torch.no_grad():
        reference.ln1.weight[3] = 0.0  # LLMs' norms weigh the massive channel down
    model = _calibrated(reference, batches)
    diagnoses, result = _diagnoses(reference, model, batches)
    assert diagnoses["ln1"] == "norm_input_outliers", diagnoses
    assert result.meta["findings"]["q"]["at_fault"] == "ln1"
    assert "SmoothQuant" in result.summary
    found = result.meta["findings"]["q"]
    assert found["norm_input_channel"] == 3 and found["norm_input_ratio"] >= 100, found
    # The same block on ordinary inputs, every row flagged: no norm input is called an outlier.
    plain = _batches((4, 10, 16))
    diagnoses, _ = _diagnoses(reference, _calibrated(reference, plain), plain, thresholds=FLAG_EVERYTHING)
    assert "norm_input_outliers" not in diagnoses.values(), diagnoses


def test_a_per_token_norm_input_is_not_called_an_outlier_problem():
    batches = [_massive(b) for b in _batches((4, 10, 16))]
    per_token = {"overrides": {"input": {"activation": {"dynamic": True, "per_token": True}}}}
    model = _calibrated(_block(), batches, per_token)
    assert quant_points(model)["input"].spec.per_token
    diagnoses, _ = _diagnoses(_block(), model, batches, thresholds=FLAG_EVERYTHING)
    assert diagnoses["ln1"] and diagnoses["ln1"] != "norm_input_outliers", diagnoses


# -- softmax ----------------------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.fc = nn.Linear(16, classes)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        return self.softmax(self.fc(x))


def _classifier(classes: int) -> nn.Module:
    torch.manual_seed(0)
    return Classifier(classes).eval()


@pytest.mark.parametrize("stage", ["calibrated", "quantized"])
def test_a_softmax_whose_probabilities_round_to_code_0_is_named(stage):
    # 1024 classes: a confident row sets the range to [0, 1] (step 1/255), and the diffuse rows'
    # probabilities (~1/1024) fall below half a step: code 0.
    batches = [torch.cat([b, 60.0 * b[:1]]) for b in _batches((16, 16), scale=0.3)]
    model = _calibrated(_classifier(1024), batches)
    model = convert(model) if stage == "quantized" else model
    diagnoses, result = _diagnoses(_classifier(1024), model, batches)
    assert diagnoses["softmax"] == "softmax_collapse", diagnoses
    assert "1/256" in result.summary
    assert result.meta["findings"]["q"]["zero_code_share"] >= 0.5


def test_a_healthy_softmax_is_not_called_collapsed():
    batches = _batches((16, 16))
    diagnoses, _ = _diagnoses(_classifier(10), _calibrated(_classifier(10), batches), batches,
                              thresholds=FLAG_EVERYTHING)
    assert diagnoses["softmax"] and diagnoses["softmax"] != "softmax_collapse", diagnoses


# -- recurrent layers -------------------------------------------------------------------------
class Speech(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out)


def _speech() -> nn.Module:
    """An LSTM whose cell state accumulates to tens in a few units (forget gate ~1, cell gate
    ~1), as on trained speech models, while the other units' c and every h stay small."""
    torch.manual_seed(0)
    model = Speech().eval()
    with torch.no_grad():
        h = 16
        model.lstm.bias_ih_l0[h: 2 * h] = 6.0  # forget gates open: c accumulates
        model.lstm.bias_ih_l0[2 * h: 2 * h + 4] = 3.0  # four units' cell gate near 1: c grows to ~T
    return model


def test_an_int8_cell_state_is_named_and_the_int16_default_is_not():
    batches = _batches((2, 32, 8), n=2)
    int8_cell = {"overrides": {"lstm.*.cell": {"activation": {"bits": 8}}}}
    model = _calibrated(_speech(), batches, int8_cell)
    assert quant_points(model)["lstm.l0.cell"].spec.bits == 8
    diagnoses, result = _diagnoses(_speech(), model, batches)
    assert diagnoses["lstm:0"] == "cell_state_range", diagnoses
    assert result.meta["findings"]["q"]["at_fault"] == "lstm:0"
    assert "int16 cell points" in result.summary
    # The default (int16 cell state), every row flagged: no cell-state cause; and the fix is one.
    diagnoses, fixed = _diagnoses(_speech(), _calibrated(_speech(), batches), batches, thresholds=FLAG_EVERYTHING)
    assert all(diagnoses.values()) and not NEW_CAUSES & set(diagnoses.values()), diagnoses
    int8_db = float(result.frame.set_index("layer").loc["lstm:0", "isolated_sqnr_db"])
    int16_db = float(fixed.frame.set_index("layer").loc["lstm:0", "isolated_sqnr_db"])
    assert int16_db > int8_db + 3.0, (int8_db, int16_db)


class TwoRanges(nn.Module):
    """One leaf call, two tensors of two meanings: h in +-1 and c in +-160 (a legacy LSTM's pair)."""

    def forward(self, x):
        return torch.tanh(x), 160.0 * torch.tanh(x / 2)


register_module_category(TwoRanges, "fallback")


class Legacy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cell = TwoRanges()

    def forward(self, x):
        h, c = self.cell(self.fc(x))
        return h, c


def _legacy() -> nn.Module:
    torch.manual_seed(0)
    return Legacy().eval()


def test_a_point_shared_by_tensors_of_different_ranges_is_named():
    batches = _batches((8, 4), scale=3.0)
    fresh = _calibrated(_legacy(), batches)
    plan = engine_state(fresh).plan.to_dict()
    for call in plan["calls"]:  # a plan saved before members existed: one point for (h, c)
        call.pop("members")
    old = _calibrated(_legacy(), batches, plan=plan)
    assert "cell" in quant_points(old) and "cell:0" not in quant_points(old)
    diagnoses, result = _diagnoses(_legacy(), old, batches)
    assert diagnoses["cell:0"] == "shared_scale", diagnoses
    assert diagnoses["cell:1"] != "shared_scale", diagnoses  # the wide member owns the range
    assert "prepare again" in result.summary
    # Prepared again, each member has its own point: nothing is shared.
    diagnoses, _ = _diagnoses(_legacy(), fresh, batches, thresholds=FLAG_EVERYTHING)
    assert all(diagnoses.values()) and "shared_scale" not in diagnoses.values(), diagnoses


# -- the demo CNN -----------------------------------------------------------------------------
def test_the_demo_cnn_gets_no_layer_specific_cause(stages):
    batches = [stages.x]
    models = stages.models
    result = compare([("float", models["float"]), ("calibrated", models["calibrated"]),
                      ("quantized", models["quantized"])], batches, thresholds=FLAG_EVERYTHING)
    assert (result.frame["diagnosis"] != "").any()
    assert not NEW_CAUSES & set(result.frame["diagnosis"]), result.frame[["layer", "diagnosis"]]


def test_ranks_evidence_merges_as_one_run_over_both_shares():
    """Data-parallel compare (docs/scale.md) combines each rank's evidence: counts add, ranges widen."""
    from qdebug.tools.compare import _merge_evidence

    key = ("softmax", "q")
    a = {key: {"softmax": (10, 6), "norm_input": torch.tensor([1.0, 5.0]), "shared": (-1.0, 2.0),
               "shared_grid": (0.5, 0, -128, 127)}}
    b = {key: {"softmax": (4, 1), "norm_input": torch.tensor([3.0, 2.0]), "shared": (-3.0, 1.0),
               "shared_grid": (0.5, 0, -128, 127)}, ("fc", "q"): {"softmax": (1, 1)}}
    merged = _merge_evidence(a, b)
    assert merged[key]["softmax"] == (14, 7) and merged[key]["shared"] == (-3.0, 2.0)
    assert torch.equal(merged[key]["norm_input"], torch.tensor([3.0, 5.0]))
    assert merged[("fc", "q")] == {"softmax": (1, 1)} and a[key]["softmax"] == (10, 6)


@pytest.mark.parametrize("cause, command", [
    ("cell_state_range", "qdebug suggest f.pt q.pt"), ("softmax_collapse", "qdebug suggest f.pt q.pt"),
    ("logits_clipped", "qdebug suggest f.pt q.pt"), ("shared_scale", "qdebug calibrate f.pt"),
])
def test_the_next_command_follows_the_layer_specific_cause(cause, command):
    from types import SimpleNamespace

    from qdebug.cli.compare import _next_command

    found = {"q": {"flagged": 1, "at_fault": "x", "at_fault_diagnosis": cause}}
    result = SimpleNamespace(meta={"findings": found, "reference_stage": "float"})
    _, suggested = _next_command(result, ["float", "q"], ["f.pt", "q.pt"], 0, given=["f.pt", "q.pt"],
                                 options="", sort=None)
    assert suggested.startswith(command), suggested


def test_an_int16_norm_input_keeps_the_typical_channel_and_is_not_named():
    batches = [_massive(b) for b in _batches((4, 10, 16))]
    reference = _block()
    with torch.no_grad():
        reference.ln1.weight[3] = 0.0
    int16_input = {"overrides": {"input": {"activation": {"bits": 16}}}}
    model = _calibrated(reference, batches, int16_input)
    diagnoses, _ = _diagnoses(reference, model, batches, thresholds=FLAG_EVERYTHING)
    assert diagnoses["ln1"] and diagnoses["ln1"] != "norm_input_outliers", diagnoses
