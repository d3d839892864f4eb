"""The two pipelines: ``snapshot`` (:mod:`.snapshot`) and ``up``/``down``/``status``
(:mod:`.lifecycle`, with ``up``'s writing of a snapshot back in place, :mod:`.materialize`,
and its streamed restore, :mod:`.restore_stream`); each a top-down list of short phase
functions. Layer "pipelines" of docs/design.md.
"""
