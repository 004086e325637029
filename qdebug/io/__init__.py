"""Files and the user's code, safely: what qdebug reads and writes, and whose code it runs.

- ``torchfile``: a torch file read weights-only, a refused pickle named for what it is;
- ``usercode``: importing the modules the user named or trusted, and pointing at their line
  when their code raises;
- ``modelspec``: ``package.module:Class`` + kwargs -> an architecture, restricted when a file
  names it;
- ``filesystem``, ``atomic``, ``staged``, ``together``, ``leftovers``: outputs that appear
  complete or not at all (a file, an ``--out`` folder, both at once) and what killed runs left.

Below the data and the checkpoints, above the config: it imports no engine, tool or command.
"""
