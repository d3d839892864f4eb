"""Records: the ``up`` contract, an engine's persisted state, the manifest, profiles, settings, phase timing,
credentials kept out of snapshots, the per-name engine lock. Layer "records" of
docs/design.md.
"""
