"""The ``builtin:`` models warmctl builds itself (no model hub): :mod:`.builtinmodels` by name,
:mod:`.tinymodel`, :mod:`.randmodel`. In the "engine" layer of docs/design.md.
"""
