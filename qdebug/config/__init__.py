"""How a run is set up: the project config (``qdebug.toml`` or ``[tool.qdebug]``), where it computes.

- ``project``: the config file, found upward, validated (``load_config``, ``Config``);
- ``edit``: writing its keys in place (``qdebug init``);
- ``device``: the device a command runs on, checked without torch;
- ``distributed``: the ranks of a data-parallel run under torchrun, and their exact merges;
- ``memory``: glibc's malloc told to keep freed memory for the next tensor (the command line's).

The bottom of the house above ``qdebug.errors``: the engine may read the device and the ranks,
and nothing here imports the engine, the user's code or a file reader.
"""

from qdebug.config.project import DEBUG_ORDER, GATE_ORDER, STAGE_KEYS, Config, find_config, load_config

__all__ = ["Config", "load_config", "find_config", "DEBUG_ORDER", "GATE_ORDER", "STAGE_KEYS"]
