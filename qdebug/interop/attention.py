"""torch.ao's quantizable MultiheadAttention (eager custom-module flow) -> the engine's ``QMultiheadAttention``.

Eager ``prepare`` swaps an ``nn.MultiheadAttention`` for ``torch.ao.nn.quantizable.MultiheadAttention``
(torch's default custom module config; ``prepare_qat`` too, given a module mapping without
``NonDynamicallyQuantizableLinear``, docs/interop.md).  Its ``from_float`` splits ``in_proj_weight``
into three ``nn.Linear`` (``linear_Q``, ``linear_K``, ``linear_V``: rows [0, E), [E, 2E), [2E, 3E))
and prepares them itself, so every quantizer sits on a child.  The importer puts an
``nn.MultiheadAttention`` back at the module's path -- ``in_proj_weight`` packed again from the
three Linears (they are what QAT trains; the quantizable module's own ``in_proj_weight`` is a
stale copy) -- which ``prepare`` decomposes into ``QMultiheadAttention`` with the same parts,
and maps each torch quantizer onto the engine call at the same site:

    linear_Q/K/V.activation_post_process         -> <path>.linear_Q / _K / _V   (the projections' outputs)
    quant_attn_output.activation_post_process    -> <path>.bmm#2                (attn.V, before the reshape)
    out_proj.activation_post_process             -> <path>.out_proj
    quant_attn_output_weights.activation_post_process -> <path>.quant_attn_output_weights
    q_scaling_product.activation_post_process    -> none: ``FloatFunctional.mul_scalar`` never runs it;
                                                    q c stays on linear_Q's grid scaled by c, as the
                                                    engine's ``q_scaling`` (no point) keeps it

QK^T and the softmax output are float in torch.ao (dequantized between the stubs): those engine
points are float.  Weights: torch's quantizable MHA prepares its Linears itself, with no weight
fake quant, so a QAT run trains float weights (the engine's weight points are float, as the
report says); torch's ``convert`` observes each Linear's weight with ``qconfig.weight()``, and
so does the importer for a PTQ-prepared model (``<path>.linear_Q.weight`` is the engine's
projection weight, rows of ``in_proj_weight``; ``<path>.out_proj.weight`` the out_proj's).
"""

from __future__ import annotations

from typing import Collection

import torch
import torch.nn as nn

from qdebug.interop.source import SourceQuantizer, full_range, read_quantizer

SITES = {  # torch.ao's child -> the engine call whose output its quantizer quantizes
    "linear_Q": "linear_Q", "linear_K": "linear_K", "linear_V": "linear_V", "quant_attn_output": "bmm#2",
    "out_proj": "out_proj", "quant_attn_output_weights": "quant_attn_output_weights",
}
PROJECTIONS = ("linear_Q", "linear_K", "linear_V")
LINEARS = PROJECTIONS + ("out_proj",)
UNOBSERVED = "q_scaling_product"  # FloatFunctional.mul_scalar: torch never runs its quantizer
LAYOUT_NOTE = ("torch.ao's batch_first forward reshapes attn.V (B*H, L, d) straight to (B, L, E), mixing heads "
               "and positions when num_heads > 1; the engine keeps nn.MultiheadAttention's layout, so the outputs "
               "differ from torch's there (not a quantization difference)")


def quantizable_attentions(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> torch.ao quantizable MultiheadAttention."""
    try:
        from torch.ao.nn.quantizable import MultiheadAttention
    except ImportError:  # pragma: no cover - torch without torch.ao
        return {}
    return {path: m for path, m in model.named_modules() if isinstance(m, MultiheadAttention)}


def float_attention(module: nn.Module) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` holding the weights of torch.ao's quantizable one."""
    bias = module.linear_Q.bias is not None
    mha = nn.MultiheadAttention(module.embed_dim, module.num_heads, module.dropout, bias=bias,
                                add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn,
                                kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first)
    with torch.no_grad():
        weights = [getattr(module, name).weight.detach() for name in PROJECTIONS]
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat(weights))
        else:
            for name, weight in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), weights):
                getattr(mha, name).copy_(weight)
        if bias:
            mha.in_proj_bias.copy_(torch.cat([getattr(module, name).bias.detach() for name in PROJECTIONS]))
            mha.out_proj.bias.copy_(module.out_proj.bias.detach())
        mha.out_proj.weight.copy_(module.out_proj.weight.detach())
        for name in ("bias_k", "bias_v"):
            if getattr(module, name) is not None:
                getattr(mha, name).copy_(getattr(module, name).detach())
    return mha.to(module.out_proj.weight.device).train(module.training)


def attention_quantizers(path: str, module: nn.Module, qat: bool,
                         calls: Collection[str]) -> tuple[list[SourceQuantizer], list[tuple[str, str]]]:
    """(the quantizers of torch.ao's quantizable MHA at ``path``, each anchored to its engine call
    (activations) or projection (weights, PTQ only: QAT trains them in float); (source, why) of
    those torch holds but never uses).  ``calls``: the engine plan's call names."""
    from qdebug.engine.attention import decomposable

    found = []
    idle = []
    mul_scalar = getattr(getattr(module, UNOBSERVED, None), "activation_post_process", None)
    if mul_scalar is not None:
        idle.append((f"{path}.{UNOBSERVED}.activation_post_process",
                     "torch's FloatFunctional.mul_scalar never runs this quantizer: q * head_dim^-1/2 stays on "
                     f"{path}.linear_Q's grid scaled by the constant, as the engine's {path}.q_scaling (no point) "
                     "keeps it"))
    kept_float = not decomposable(float_attention(module))
    layout = module.batch_first and module.num_heads > 1
    for site, call in SITES.items():
        quantizer = getattr(getattr(module, site, None), "activation_post_process", None)
        if quantizer is None:
            continue
        anchors: list[str | None] = [None] if kept_float else _calls_of(calls, f"{path}.{call}")
        if not anchors and site == "quant_attn_output_weights":
            # need_weights=False: torch quantizes the weights, then returns None; the engine
            # does not compute what nothing reads.
            idle.append((f"{path}.{site}.activation_post_process",
                         "the forward asks for no attention weights (need_weights=False): torch quantizes them "
                         "and discards them, the engine has no call to quantize"))
            continue
        note = ("the engine keeps an attention with add_bias_kv or add_zero_attn in float" if kept_float
                else LAYOUT_NOTE if layout and site == "quant_attn_output" else "")
        for anchor in anchors or [None]:  # an attention called k times shares its quantizers (torch's modules)
            q = read_quantizer(quantizer, f"{path}.{site}.activation_post_process", "activation", anchor, note=note)
            q.approximate = layout and site == "quant_attn_output"  # torch's own layout differs: not exact
            if not qat:
                full_range(q)
            found.append(q)
    if qat or kept_float:
        return found, idle
    for name in LINEARS:
        linear = getattr(module, name)
        qconfig = getattr(linear, "qconfig", None)
        if qconfig is None:
            continue  # torch's convert leaves it float too
        observer = qconfig.weight()
        observer(linear.weight.detach())
        q = read_quantizer(observer, f"{path}.{name}.qconfig.weight()", "weight", f"{path}.{name}",
                           note="observed on the weight, as torch's convert does")
        if name in PROJECTIONS:  # rows of in_proj_weight: a point inside the attention
            q.point = f"{path}.{name}.weight"
        found.append(q)
    return found, idle


def _calls_of(calls: Collection[str], site: str) -> list[str]:
    """The engine calls at ``site`` (``attn.linear_Q``, ``attn.bmm#2``) over every call of the
    attention, in execution order: ``attn.linear_Q``, ``attn.linear_Q#2``, ...; the attention's
    two bmm calls alternate (QK^T, attn.V), so attn.V's are ``attn.bmm#2``, ``attn.bmm#4``, ..."""
    base, _, index = site.partition("#")
    per_call = {"bmm": 2}.get(base.rpartition(".")[2], 1)
    found = [name for name in calls if name.split("#")[0] == base]
    return found[(int(index or 1) - 1)::per_call]


def attention_points(model: nn.Module) -> dict[str, tuple[str, tuple[str, str], bool]]:
    """The projection weight points ``prepare`` gives the attentions of float ``model``:
    name -> (kind, the names qconfig globs match, "") as ``recurrent_points`` (out_proj is an
    ``nn.Linear`` of the float model: an ordinary weighted layer)."""
    from qdebug.engine.attention import decomposable

    points = {}
    for path, module in model.named_modules():
        if decomposable(module):
            for name in PROJECTIONS:
                layer = f"{path}.{name}" if path else name
                points[f"{layer}.weight"] = ("weight", (layer, f"{layer}.weight"), "")
    return points
