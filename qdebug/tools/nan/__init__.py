"""``qdebug nan-trace``: the first non-finite value of a run, where and why.

- ``detect``: watching a model step by step for its first NaN/Inf (forward, backward, update);
- ``causes``: the documented rules that say why (``diagnose``);
- ``trace``: the training (or inference) loop ``nan-trace`` runs, with snapshots to replay;
- ``guard``: ``qdebug.nan_trace(model)``, the same watch inside the user's own loop.
"""
