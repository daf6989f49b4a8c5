"""Post-mortems: export and import a log as JSONL, replay it without a server, timelines.

- ``logfile``: the line format (one stored event per line), its writer and its reader.
- ``transfer``: export a store's log to a file, import a file into a store.
- ``replay``: fold a file into job views (up to a position or a time), and the counterfactual
  replay of a file under another policy (the pure part is ``controlplane.core.replay``).
- ``report``: what the CLI prints: JSON objects and rich tables.
- ``commands``: the bodies of ``elasticctl export``, ``import``, ``replay`` and ``timeline``.
"""
