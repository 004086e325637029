"""Small zoo configurations shared by the tests (1-channel inputs of 16-28 px, fast on CPU),
and ``randomize_bn``: BN statistics far from (0, 1), so folding them is not a no-op."""

import torch
import torch.nn as nn

RESNET = "qdebug.zoo.resnet:ResNet"
# A two-stage ResNet: conftest's stage fixtures and the compare tests use it.
SMALL_RESNET = {"layers": [1, 1], "widths": [8, 16], "num_classes": 10, "in_channels": 1, "stem": "small"}
SMALL_MOBILENETV2 = {
    "num_classes": 10,
    "in_channels": 1,
    "width_mult": 0.5,
    "setting": [[1, 8, 1, 1], [6, 16, 2, 2], [6, 24, 2, 2]],
    "stem_stride": 1,
    "dropout": 0.1,
    "last_channel": 64,
}
SMALL_SHUFFLENETV2 = {
    "stages_repeats": [2, 2, 1],
    "stages_out_channels": [8, 16, 32, 64, 128],
    "num_classes": 10,
    "in_channels": 1,
    "stem_stride": 1,
}

# 3-channel zoo models the torch.ao import tests prepare with torch (tests/test_interop_*.py).
INTEROP_ZOO = {
    "resnet": {"layers": [1, 1], "widths": [8, 16], "num_classes": 10, "stem": "small"},
    "mobilenetv2": {"num_classes": 10, "width_mult": 0.25, "setting": [[1, 16, 1, 1], [6, 24, 2, 2]],
                    "last_channel": 64, "stem_stride": 1},
    "shufflenetv2": {"stages_repeats": [1, 1], "stages_out_channels": [8, 16, 32, 64], "num_classes": 10,
                     "stem_stride": 1, "stem_pool": False},
    "multitask": {"in_channels": 3, "width": 8},
}


def interop_zoo() -> dict:
    """Name -> a constructor of that small 3-channel zoo model."""
    from qdebug.zoo import MODELS

    return {name: (lambda name=name: MODELS[name](**INTEROP_ZOO[name])) for name in INTEROP_ZOO}


def randomize_bn(model: nn.Module, seed: int, types: tuple = (nn.BatchNorm2d,)) -> nn.Module:
    """Every BatchNorm2d's (every one of ``types``) statistics and affine parameters drawn from a
    generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, types):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.3)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.2)
    return model


def torch_ao_qat(model: nn.Module, batches: list, mapping: dict | None = None) -> nn.Module:
    """torch.ao's eager QAT as a user runs it: the x86 QAT qconfig, ``prepare_qat`` (with ``mapping``
    if given), an SGD step per batch on the (first) output's mean square, observers frozen; eval."""
    import warnings

    import torch.ao.quantization as tq

    model = model.train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare_qat(model, **({"mapping": mapping} if mapping is not None else {}))
    opt = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for x in batches:
        out = prepared(x)
        (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    prepared.apply(tq.disable_observer)
    return prepared.eval()


def torch_ao_ptq(model: nn.Module, batches: list) -> nn.Module:
    """torch.ao's eager PTQ: the x86 qconfig, ``prepare`` (torch's default custom module config swaps
    an LSTM or MultiheadAttention for its quantizable one), the batches observed; not converted."""
    import warnings

    import torch.ao.quantization as tq

    model = model.eval()
    model.qconfig = tq.get_default_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare(model)
    with torch.no_grad():
        for x in batches:
            prepared(x)
    return prepared


def module_io(model: nn.Module, names, x) -> dict[str, tuple]:
    """(first input, output) of the first call of each named module of ``model`` in one forward
    on ``x`` (torch's own modules as oracles: their outputs, quantized ones as they are)."""
    found, handles = {}, []

    def keep(name, args, out):  # returns None: a hook's return value would replace the output
        found.setdefault(name, (args[0] if args else None, out))

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: keep(name, args, out)))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return found
