"""The input of a norm as a qconfig override can name it: ``@norm_input`` (issue 28, item 4).

A LayerNorm / GroupNorm / RMSNorm / InstanceNorm divides its input by the input's own
spread: mean and variance over the normalized axes, so every value of the input counts.
Its output is quantized by its own point; its *input* is the output of the op before (a
residual add, a conv), quantized by that op's point.  LLMs' "massive activations" -- a few
channels ~100-1000x the others -- make that point's step so coarse that the typical
channels round to a handful of codes before the norm even sees them.  NPUs therefore offer
an int16 input for their norm kernels (the producer writes 16-bit codes, the norm reads
them): with ``b`` bits the typical channel keeps ``2^(b-8)`` times as many codes.

That point is named here, for overrides only, by two aliases besides its own names:
``@norm_input`` (the input of every norm) and ``@norm_input.<norm call>`` (of that norm:
``@norm_input.blocks.0.ln1``; globs work, ``@norm_input.*.ln_f``).  So::

    [overrides."@norm_input"]
    activation = {bits = 16}

gives every point feeding a norm 16 bits and changes nothing else.  ``@`` never starts a
module path or a point name, so an ordinary module glob (``blocks.0.*``) never matches an
alias: it cannot raise the point of an op outside its modules that happens to feed one of
its norms.  Like every override, the matching ones cascade in the order they are written.

The point fed is the producer's output point (its own, or the ReLU's it is fused into).
Not named: a norm whose input comes through a view (``x.permute`` before a ConvNeXt
LayerNorm: the saved plan keeps no views), one of several tensors of a structured output,
or a model input's own point only when the input feeds the norm directly.
"""

from __future__ import annotations

from qdebug.engine.plan import Plan

ALIAS = "@norm_input"
# Op names (module class or function) of the norms, lower case without "_": a model
# library's RMSNorm class (``LlamaRMSNorm``, ``T5LayerNorm``) ends the same way.
_NORM_SUFFIXES = ("layernorm", "groupnorm", "rmsnorm", "instancenorm", "instancenorm1d", "instancenorm2d")


def is_norm_op(op: str) -> bool:
    """Whether a call's op (``LayerNorm``, ``layer_norm``, ``LlamaRMSNorm``, ...) is a norm."""
    return str(op).lower().replace("_", "").endswith(_NORM_SUFFIXES)


def norm_input_aliases(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Activation point name -> its aliases (``@norm_input``, ``@norm_input.<norm>``, one per
    norm it feeds, in execution order), for every point that quantizes a norm's input."""
    found: dict[str, list[str]] = {}
    for rec in plan.calls.values():
        if not is_norm_op(rec.op) or not rec.inputs:
            continue
        producer = plan.calls.get(rec.inputs[0])  # the normalized tensor (weight, bias: parameters)
        if producer is None or producer.members or producer.output_point is None:
            continue
        names = found.setdefault(producer.output_point, [ALIAS])
        norm = f"{ALIAS}.{rec.name.split('#')[0]}"
        if norm not in names:
            names.append(norm)
    return {point: tuple(names) for point, names in found.items()}
