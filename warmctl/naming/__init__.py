"""The one naming layer and trust: the catalog (NAME:TAG per kind of host -> manifest digest) and
which snapshot fits this host, named snapshots between stores (:mod:`.fleet`), signatures
(:mod:`.trust`), stale snapshots (:mod:`.drift`). Layer "naming, trust" of docs/design.md.
"""
