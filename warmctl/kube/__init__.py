"""warmctl in a Kubernetes cluster.

An engine pod's container runs ``warmctl up NAME --foreground``; it is Ready when the gate's
``/health`` answers (the canary passed and the public port is open; the probe asks it through
the supervisor's ``/ready``, :mod:`warmctl.kube.readiness`), and while it works it keeps
a pod condition ``warmctl.io/Restored`` on its own pod (information, never readiness). A node
DaemonSet runs the pre-warm controller, which keeps the snapshots that ``WarmSnapshot`` objects
name pulled on matching nodes and labels each node with what it holds. The manifests are under
``deploy/kubernetes/``; the walk-through is docs/kubernetes.md.

Submodules import the Kubernetes client (``lightkube``) themselves: nothing here is imported on a
host that is not in a cluster.
"""
