"""SmoothQuant-style scaling (qdebug.fix.smooth): the float function is preserved, planted activation
outlier channels (a few LayerNorm gammas x30..x100, the readers' columns compensating, as trained
LLMs have them) move into the weights and per-tensor int8 recovers what they cost, the scales match
a float64 computation done here, and norms that may not be rescaled are left alone with a reason."""

import pytest
import torch
import torch.nn as nn

from qdebug.engine.prepare import calibrate, prepare
from qdebug.engine.spec import QConfig, QuantSpec
from qdebug.errors import QDebugError
from qdebug.fix.smooth import COLUMNS, fake_quant_weight, smooth

OUTLIERS = [(3, 60.0), (11, 30.0), (20, 100.0)]  # (channel, gamma factor)


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (20 * torch.log10(reference.norm() / (reference - other).norm())).item()


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): a transformer's MLP block."""

    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class AttentionBlock(nn.Module):
    """x + o(softmax(q k^T / sqrt(d)) v) with q, k, v Linear layers reading ln(x)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        h = self.ln(x)
        b, t, d = h.shape
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in (self.q(h), self.k(h), self.v(h)))
        attention = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return x + self.o((attention @ v).transpose(1, 2).reshape(b, t, d))


def _block(cls, readers, planted=True):
    """A seeded block whose LayerNorm has gammas near 1; ``planted``: a few gamma (and beta) channels
    scaled by OUTLIERS' factors and the readers' columns divided by them (the same function)."""
    torch.manual_seed(0)
    model = cls().eval()
    with torch.no_grad():
        model.ln.weight.copy_(1 + 0.1 * torch.randn(32))
        model.ln.bias.copy_(0.1 * torch.randn(32))
        for channel, factor in OUTLIERS if planted else []:
            model.ln.weight[channel] *= factor
            model.ln.bias[channel] *= factor
            for reader in readers:
                getattr(model, reader).weight[:, channel] /= factor
    return model


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, 32, generator=g) for _ in range(n)]


def _int8_sqnr(model, reference, batches, x, per_channel=False):
    """Output SQNR vs ``reference``'s float output of ``model`` prepared with int8 per-tensor
    activations (and per-tensor weights unless ``per_channel``), calibrated on ``batches``."""
    prepared = prepare(model, QConfig(weight=QuantSpec(per_channel=per_channel)), example_inputs=batches[0])
    calibrate(prepared, batches)
    with torch.no_grad():
        return sqnr_db(reference(x), prepared(x))


@pytest.mark.parametrize("cls, readers", [(MLPBlock, ["fc1"]), (AttentionBlock, ["q", "k", "v"])])
def test_planted_outliers_move_into_the_weights_and_int8_recovers(cls, readers):
    model, clean = _block(cls, readers), _block(cls, readers, planted=False)
    batches, x = _batches(), torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(7))
    fixed, report = smooth(model, batches)
    assert list(report.columns) == COLUMNS and len(report) == 1
    row = report.iloc[0]
    assert row["applied"] and row["norm"] == "ln" and row["readers"] == ", ".join(readers) and row["channels"] == 32
    assert row["act_ratio_before"] > 10 and row["act_ratio_after"] < 1.5  # 14.2 -> 1.03, 14.0 -> 1.00 measured
    assert row["local_sqnr_after_db"] > row["local_sqnr_before_db"] + 30  # 5.0, 4.6 -> 42.1 dB measured
    with torch.no_grad():
        assert sqnr_db(model(x), fixed(x)) >= 80  # 146.9, 149.2 dB measured
    assert type(fixed) is cls and list(fixed.state_dict()) == list(model.state_dict())
    assert torch.equal(model.ln.weight, _block(cls, readers).ln.weight)  # the input model is untouched
    # The engine, per-tensor int8 activations and weights: measured MLP 18.6 -> 37.4 dB (clean 37.5),
    # attention 24.1 -> 37.8 dB (clean 37.9); per-channel weights: 18.7 -> 37.4 and 24.1 -> 37.7 dB.
    before, after = _int8_sqnr(model, model, batches, x), _int8_sqnr(fixed, model, batches, x)
    assert after >= before + 10
    assert after >= _int8_sqnr(clean, model, batches, x) - 1.5
    assert _int8_sqnr(fixed, model, batches, x, per_channel=True) >= _int8_sqnr(model, model, batches, x, True) + 10


def test_scales_for_a_given_alpha_match_a_float64_computation():
    model = _block(AttentionBlock, ["q", "k", "v"])
    batches = _batches(3)
    fixed, report = smooth(model, batches, alpha=0.5)
    assert report.iloc[0]["alpha"] == 0.5 and report.iloc[0]["applied"]
    ln = model.ln.double()
    amax = torch.stack([nn.functional.layer_norm(b.double(), (32,), ln.weight, ln.bias, ln.eps).abs()
                        .reshape(-1, 32).amax(dim=0) for b in batches]).amax(dim=0)
    wmax = torch.stack([getattr(model, r).weight.double().abs().amax(dim=0) for r in "qkv"]).amax(dim=0)
    s = amax.sqrt() / wmax.sqrt()
    assert s.max() / s.min() > 10  # the outlier channels get large scales
    torch.testing.assert_close(fixed.ln.weight.double(), model.ln.weight.double() / s, rtol=1e-6, atol=0)
    torch.testing.assert_close(fixed.ln.bias.double(), model.ln.bias.double() / s, rtol=1e-6, atol=0)
    for r in "qkv":
        torch.testing.assert_close(getattr(fixed, r).weight.double(), getattr(model, r).weight.double() * s,
                                   rtol=1e-6, atol=0)
        assert torch.equal(getattr(fixed, r).bias, getattr(model, r).bias)
    assert torch.equal(fixed.o.weight, model.o.weight)


class RMSNormMLP(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.up = nn.Linear(32, 48)
        self.down = nn.Linear(48, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class GemmaStyleRMSNorm(nn.Module):
    """(1 + weight) * x / rms(x): recognized as an RMSNorm by its name, but not linear in its weight."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_rmsnorm_is_smoothed_and_a_norm_not_scaling_with_its_weight_is_restored():
    torch.manual_seed(0)
    model = RMSNormMLP(nn.RMSNorm(32)).eval()
    with torch.no_grad():
        model.norm.weight.mul_(1 + 0.1 * torch.randn(32))
        model.norm.weight[5] *= 50
    batches, x = _batches(2), torch.randn(2, 16, 32)
    fixed, report = smooth(model, batches, alpha=0.5)
    assert report.iloc[0]["applied"] and report.iloc[0]["act_ratio_after"] < report.iloc[0]["act_ratio_before"]
    with torch.no_grad():
        assert sqnr_db(model(x), fixed(x)) >= 80

    gemma = RMSNormMLP(GemmaStyleRMSNorm(32)).eval()
    with torch.no_grad():
        gemma.norm.weight.copy_(torch.randn(32))
    fixed, report = smooth(gemma, batches, alpha=0.5)
    row = report.iloc[0]
    assert not row["applied"] and "does not scale with its weight" in row["reason"]
    for name, tensor in gemma.state_dict().items():
        assert torch.equal(fixed.state_dict()[name], tensor), name


def test_transformers_layers_built_from_configs():
    """Code qdebug did not write: ViT (pre-LN: both norms read only by Linear layers), BERT (post-LN:
    every norm also feeds a residual add or the output), GPT-2 (Conv1D, read through a view)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = transformers.models.vit.modeling_vit.ViTLayer(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)).eval()
    batches, x = [(torch.randn(2, 5, 32),) for _ in range(2)], torch.randn(2, 5, 32)
    fixed, report = smooth(vit, batches)
    assert report.set_index("norm")["readers"].to_dict() == {
        "layernorm_before": "attention.q_proj, attention.k_proj, attention.v_proj", "layernorm_after": "mlp.fc1"}
    assert report["applied"].all()
    first = (lambda out: out[0] if isinstance(out, tuple) else out)
    with torch.no_grad():
        assert sqnr_db(first(vit(x)), first(fixed(x))) >= 80  # 143 dB measured

    bert = transformers.models.bert.modeling_bert.BertLayer(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)).eval()
    _, report = smooth(bert, batches)
    reasons = report.set_index("norm")["reason"].to_dict()
    assert not report["applied"].any()
    assert "output.add (add) reads the output of attention.output.LayerNorm: not a Linear" in \
        reasons["attention.output.LayerNorm"]
    assert reasons["output.LayerNorm"] == "the output of output.LayerNorm is the model's output"

    gpt2 = transformers.models.gpt2.modeling_gpt2.GPT2Block(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, n_positions=16, vocab_size=50)).eval()
    _, report = smooth(gpt2, batches)
    assert not report["applied"].any()
    assert report.set_index("norm")["reason"]["ln_1"] == \
        "the output of ln_1 is read through a view or passthrough op (view) by attn.c_attn.addmm"


def test_transformers_llama_rmsnorm():
    """transformers' LlamaRMSNorm (a norm recognized by its name, weight only) before q/k/v and gate/up."""
    pytest.importorskip("transformers")
    from qdebug.zoo.hf import Llama

    torch.manual_seed(0)
    model = Llama(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32).eval()
    g = torch.Generator().manual_seed(1)
    batches, x = [torch.randint(0, 96, (2, 8), generator=g) for _ in range(3)], torch.randint(0, 96, (2, 8))
    fixed, report = smooth(model, batches, alpha=0.5)
    layer = "net.model.layers.0."
    rows = report.set_index("norm")
    assert rows.loc[f"{layer}input_layernorm", "readers"] == ", ".join(f"{layer}self_attn.{p}_proj" for p in "qkv")
    assert rows.loc[f"{layer}post_attention_layernorm", "readers"] == f"{layer}mlp.gate_proj, {layer}mlp.up_proj"
    assert rows["applied"].tolist() == [True, True, False]  # the final norm reaches lm_head through a slice
    with torch.no_grad():
        assert sqnr_db(model(x), fixed(x)) >= 80  # 138.8 dB measured


class TwiceNorm(nn.Module):
    """One LayerNorm applied twice (a shared module) and a plain one read by a Linear called twice."""

    def __init__(self):
        super().__init__()
        self.shared = nn.LayerNorm(32)
        self.ln = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)
        self.plain = nn.LayerNorm(32, elementwise_affine=False)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        x = self.shared(self.shared(x))
        x = self.fc(self.fc(self.ln(x)))
        return self.head(self.plain(x))


def test_what_is_not_smoothed_says_why():
    _, report = smooth(TwiceNorm().eval(), _batches(1))
    reasons = report.set_index("norm")["reason"].to_dict()
    assert not report["applied"].any() and report["channels"].isna().all()
    assert reasons == {
        "shared": "module shared is called 2 times in one forward (shared)",
        "ln": "module fc is called 2 times in one forward (shared)",
        "plain": "LayerNorm without elementwise affine: no weight to divide by s",
    }

    class Tied(nn.Module):  # two readers holding one weight
        def __init__(self):
            super().__init__()
            self.ln, self.a, self.b = nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.b.weight = self.a.weight

        def forward(self, x):
            h = self.ln(x)
            return self.a(h) * self.b(h)

    _, report = smooth(Tied().eval(), _batches(1))
    assert report.iloc[0]["reason"] == "the weight of a is shared with another module"

    class WideNorm(nn.Module):  # a LayerNorm over (4, 8): its weight is no vector of the Linear's inputs
        def __init__(self):
            super().__init__()
            self.ln, self.fc = nn.LayerNorm((4, 8)), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(self.ln(x))

    _, report = smooth(WideNorm().eval(), [torch.randn(2, 4, 8)])
    assert report.iloc[0]["reason"] == "ln normalizes over several dimensions (weight (4, 8)); a Linear reads one"

    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    _, report = smooth(conv, [torch.randn(1, 3, 8, 8)])
    assert len(report) == 1 and not report.iloc[0]["applied"]
    assert report.iloc[0]["reason"] == "the model has no LayerNorm or RMSNorm: nothing to smooth"


@pytest.mark.parametrize("alpha", [1.5, -0.1, True, "0.5", float("nan")])
def test_a_bad_alpha_is_refused(alpha):
    with pytest.raises(QDebugError, match="alpha must be a number in"):
        smooth(MLPBlock().eval(), _batches(1), alpha=alpha)


def test_a_prepared_model_and_no_batches_are_refused():
    model = MLPBlock().eval()
    prepared = prepare(model, example_inputs=_batches(1)[0])
    with pytest.raises(QDebugError, match="prepared by qdebug"):
        smooth(prepared, _batches(1))
    with pytest.raises(QDebugError, match="needs batches"):
        smooth(model, [])
    with pytest.raises(QDebugError, match="not one tensor"):
        smooth(model, _batches(1)[0])
    with pytest.raises(QDebugError, match="qconfig must be a QConfig"):
        smooth(model, _batches(1), qconfig=[8])
    with pytest.raises(QDebugError, match="unknown qconfig key"):  # a dict is read as prepare reads it
        smooth(model, _batches(1), qconfig={"weights": {}})


def test_the_proxy_quantizes_weights_as_torch_does():
    """The proxy's weight grids against torch's own fake-quant kernels (an independent computation)."""
    weight = torch.randn(6, 16, dtype=torch.float64)
    per_tensor = QuantSpec(per_channel=False)
    scale = weight.abs().max().item() / 127
    expected = torch.fake_quantize_per_tensor_affine(weight.float(), scale, 0, -128, 127)
    torch.testing.assert_close(fake_quant_weight(weight, per_tensor).float(), expected, rtol=0, atol=1e-6)
    scales = (weight.abs().amax(dim=1) / 127).float()
    expected = torch.fake_quantize_per_channel_affine(weight.float(), scales, torch.zeros(6, dtype=torch.int32),
                                                      0, -128, 127)
    torch.testing.assert_close(fake_quant_weight(weight, QuantSpec(per_channel=True)).float(), expected,
                               rtol=0, atol=1e-6)
    grouped = fake_quant_weight(weight, QuantSpec(per_channel=True, group_size=8))
    first_group = fake_quant_weight(weight[:, :8].contiguous(), QuantSpec(per_channel=True))
    torch.testing.assert_close(grouped[:, :8], first_group)  # a group is quantized as a row of its own
    assert torch.equal(fake_quant_weight(weight, None), weight)


def test_no_change_wins_when_no_alpha_beats_it():
    """With every point left float by the qconfig, every candidate's proxy is exact: no change wins."""
    model = _block(MLPBlock, ["fc1"])
    qconfig = QConfig(overrides={"*": {"weight": None, "activation": None}})
    fixed, report = smooth(model, _batches(1), qconfig=qconfig)
    row = report.iloc[0]
    assert not row["applied"] and row["reason"] == "no alpha improves the local proxy: left unchanged"
    assert row["local_sqnr_before_db"] == row["local_sqnr_after_db"] == float("inf")
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in fixed.state_dict().items())


def test_a_dynamic_per_token_qconfig_runs_the_proxy():
    model = _block(MLPBlock, ["fc1"])
    qconfig = QConfig(activation=QuantSpec(symmetric=False, dynamic=True, per_token=True))
    fixed, report = smooth(model, _batches(2), qconfig=qconfig)
    row = report.iloc[0]
    assert row["local_sqnr_before_db"] > 0 and row["local_sqnr_after_db"] >= row["local_sqnr_before_db"]
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert sqnr_db(model(x), fixed(x)) >= 80
