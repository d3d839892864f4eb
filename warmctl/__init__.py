"""warmctl: snapshot/restore orchestration for LLM inference engines.

Cold-start an engine from a profile once, warm it up, record a canary, checkpoint it with CRIU
into a content-addressed store; later ``warmctl up`` restores it in seconds and opens the
public port only after the canary matches bit for bit.
"""

__version__ = "0.1.0"
