"""One way to reach the Kubernetes API server: a ``lightkube`` client built from the settings.

Where the credentials come from, first match wins:

1. ``settings.kube_config`` (``WARMCTL_KUBECONFIG``): a kubeconfig file (a test cluster, an
   operator's workstation); its current context;
2. the pod's service account (``/var/run/secrets/kubernetes.io/serviceaccount/token`` and
   ``ca.crt``, with ``$KUBERNETES_SERVICE_HOST``/``$KUBERNETES_SERVICE_PORT``, which the kubelet
   sets in every container): the in-cluster case.

Neither present raises :class:`KubeError`. The identity the process then acts as is the pod's
service account: deploy/kubernetes/rbac.yaml gives each its least rights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.base.errors import WarmctlError

if TYPE_CHECKING:
    import lightkube

    from warmctl.records.config import Settings

#: Where the kubelet mounts a pod's service-account token and the cluster's CA
#: (Kubernetes documentation, "Accessing the Kubernetes API from a Pod").
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(WarmctlError):
    """The Kubernetes API server cannot be reached, refused a request, or no credentials to
    reach it were found (no ``kube_config`` and not in a pod)."""


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    """True inside a pod with a service-account token mounted (``sa_dir/token``) and the
    kubelet's ``KUBERNETES_SERVICE_HOST`` set."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (sa_dir / "token").is_file()


def connect(settings: Settings, *, timeout_s: float = 10.0) -> lightkube.Client:
    """:func:`client_for` the settings' ``kube_config``."""
    return client_for(settings.kube_config, timeout_s=timeout_s)


def client_for(kube_config: Path | None, *, timeout_s: float = 10.0) -> lightkube.Client:
    """A ``lightkube.Client`` for the cluster of the kubeconfig file ``kube_config`` or, when
    None, of the pod's service account (see the module's list), each request bounded by
    ``timeout_s`` seconds. Raises :class:`KubeError` when there is no kubeconfig and this is not
    a pod, or the kubeconfig cannot be read."""
    import httpx
    import lightkube
    from lightkube.config.kubeconfig import KubeConfig

    try:
        if kube_config is not None:
            config = KubeConfig.from_file(str(kube_config))
        elif in_cluster():
            config = KubeConfig.from_service_account(str(SERVICE_ACCOUNT_DIR))
        else:
            raise KubeError("no Kubernetes API server to talk to: set kube_config (WARMCTL_KUBECONFIG) "
                            "to a kubeconfig file, or run inside a pod with a service account")
    except KubeError:
        raise
    except Exception as e:  # noqa: BLE001 - lightkube raises several types for a bad file
        raise KubeError(f"cannot read the kubeconfig {kube_config}: {e}") from e
    return lightkube.Client(config, timeout=httpx.Timeout(timeout_s), field_manager="warmctl")
