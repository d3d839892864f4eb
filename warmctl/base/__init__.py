"""The base every layer may use: process identity and signals, error types, the name rule,
private files, systemd notifications, the phase kill hook, parallel sizes and CPU lists,
free ports, consoles. Layer "base" of docs/design.md.
"""
