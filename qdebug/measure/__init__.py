"""Measuring a running model: ``tap`` hooks every layer and names every call (the engine's names);
``stats`` folds each layer's reference and test outputs into streaming float64 error statistics.

Above the engine (tap reads its calls), below the tools that measure with them.
"""
