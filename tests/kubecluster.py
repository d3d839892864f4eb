"""A real Kubernetes control plane on loopback, for tests: etcd and kube-apiserver v1.20.2 (built
by scripts/install-kubernetes.sh from Debian 12's source package), and on demand
kube-controller-manager and kube-scheduler. No kubelet: pods are stored and admitted, never run.

    from kubecluster import KubeCluster, missing                  # tests/ is on sys.path under pytest
    with KubeCluster() as k:                                       # ~4 s on 2 cores
        k.server                                                   # "https://127.0.0.1:PORT"
        k.kubectl("get", "ns")                                     # CompletedProcess, as admin
        k.kubectl("auth", "can-i", "get", "secrets", user=ENGINE)  # as a service account's user
        k.request("GET", "/api/v1/nodes", user=NODE)               # (HTTP status, parsed JSON)
        k.service_account_dir(tmp / "sa", ENGINE)                  # token, ca.crt, namespace files
        k.start_controllers()                                      # kube-controller-manager
        k.start_scheduler()                                        # kube-scheduler

What is real: etcd 3.4 (Debian's etcd-server, its own data dir, client and peer URLs on
127.0.0.1), kube-apiserver with TLS (a CA and serving certificate for 127.0.0.1 made with
``cryptography``), ``--authorization-mode=Node,RBAC``, the default admission plugins,
service-account token signing keys, and a static token file with the identities in
:data:`USERS`: ``admin`` (group ``system:masters``) and service-account users (the user name RBAC
matches a ``ServiceAccount`` subject by, and the groups a real service-account token carries).
The static tokens stand in for the tokens the token controller would mint: RBAC sees the same
user and groups either way.

Processes are children of the caller, get SIGKILL if the thread that started them dies
(``PR_SET_PDEATHSIG``; only from the main thread), and are stopped (SIGTERM, then SIGKILL) and
reaped by :meth:`KubeCluster.stop`, which also removes the working directory (data dir, keys,
certificates, logs). A process that exits or a control plane that is not ready within
``timeout`` raises :class:`KubeStartError` with the tails of the logs.

Binaries: ``etcd`` on PATH (or /usr/bin/etcd); the Kubernetes ones in
``$WARMCTL_KUBE_CACHE/<source version>/bin`` (default cache /var/cache/warmctl/kubernetes);
``kubectl``: ``$WARMCTL_KUBECTL`` or the one on PATH (any client that speaks the v1 APIs).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ports import free_port

#: The Debian source version scripts/install-kubernetes.sh builds by default (the cache key).
SOURCE_VERSION = "1.20.5+really1.20.2-1.1+deb12u1"
DEFAULT_CACHE = Path("/var/cache/warmctl/kubernetes")

ADMIN = "admin"
NODE = "system:serviceaccount:warmctl:warmctl-node"
ENGINE = "system:serviceaccount:warmctl:warmctl-engine"
SNAPSHOT = "system:serviceaccount:warmctl:warmctl-snapshot"
DEFAULT_SA = "system:serviceaccount:default:default"
#: The test node's kubelet (tests/kubenode.py): node ``127.0.0.1``, group ``system:nodes``.
KUBELET = "system:node:127.0.0.1"
#: The second test node's kubelet (tests/kubenode.py, ``KubeNode(..., name="127.0.0.2")``).
KUBELET2 = "system:node:127.0.0.2"


def _sa_groups(user: str) -> list[str]:
    ns = user.split(":")[2]
    return ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]


#: user name -> groups, as written into the apiserver's ``--token-auth-file``.
USERS: dict[str, list[str]] = {
    ADMIN: ["system:masters"],
    **{u: _sa_groups(u) for u in (NODE, ENGINE, SNAPSHOT, DEFAULT_SA)},
    KUBELET: ["system:nodes", "system:authenticated"],
    KUBELET2: ["system:nodes", "system:authenticated"],
}


class KubeStartError(RuntimeError):
    """The control plane did not come up; the message carries the tails of its logs."""


def cache_root() -> Path:
    """``$WARMCTL_KUBE_CACHE``, else /var/cache/warmctl/kubernetes."""
    return Path(os.environ.get("WARMCTL_KUBE_CACHE") or DEFAULT_CACHE)


def bin_dir() -> Path:
    """The cache's bin directory of :data:`SOURCE_VERSION` when it holds a kube-apiserver,
    else that of any other cached version that does, else the default (missing) one."""
    root = cache_root()
    preferred = root / SOURCE_VERSION / "bin"
    if (preferred / "kube-apiserver").is_file():
        return preferred
    others = sorted(p.parent for p in root.glob("*/bin/kube-apiserver"))
    return others[-1] if others else preferred


def etcd_binary() -> str | None:
    """Path of ``etcd`` (PATH, then /usr/bin/etcd), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def kubectl_binary() -> str | None:
    """``$WARMCTL_KUBECTL`` or ``kubectl`` on PATH, or None."""
    return os.environ.get("WARMCTL_KUBECTL") or shutil.which("kubectl")


def missing(controllers: bool = False) -> str | None:
    """What is missing to start a cluster (with how to get it), or None when all is there."""
    gone = []
    if not etcd_binary():
        gone.append("etcd")
    b = bin_dir()
    for name in ("kube-apiserver", *(("kube-controller-manager",) if controllers else ())):
        if not os.access(b / name, os.X_OK):
            gone.append(str(b / name))
    if not kubectl_binary():
        gone.append("kubectl")
    if not gone:
        return None
    return f"Kubernetes test cluster binaries missing ({', '.join(gone)}): run scripts/install-kubernetes.sh as root"


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"  ({path}: no such file)"
    return "\n".join(f"  {ln}" for ln in text.splitlines()[-lines:]) or f"  ({path}: empty)"


def _make_pki(d: Path) -> tuple[Path, Path, Path, Path, Path]:
    """A CA, a serving certificate for 127.0.0.1/localhost/kubernetes.default.svc signed by it,
    and an RSA service-account signing key pair, under ``d``. Returns (ca, cert, key, sa_key, sa_pub)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=2))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmctl test kubernetes CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"]
    san = x509.SubjectAlternativeName([*(x509.DNSName(n) for n in names),
                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    out = (d / "ca.crt", d / "apiserver.crt", d / "apiserver.key", d / "sa.key", d / "sa.pub")
    out[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pkcs8 = serialization.PrivateFormat.PKCS8
    out[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption()))
    out[3].write_bytes(sa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                        serialization.NoEncryption()))
    out[4].write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    for p in (out[2], out[3]):
        p.chmod(0o600)
    return out


class Processes:
    """The start/stop plumbing the test cluster and the test node share: child processes by
    name (``procs``), each logging to ``workdir/log/NAME.log``; :meth:`_wait` polls a readiness
    check until it passes, failing fast with the logs' tails when a child exits; ``with`` starts
    (stopping again when the start fails) and stops. Subclasses give :meth:`start`, :meth:`stop`."""

    timeout: float
    workdir: Path
    procs: dict[str, subprocess.Popen]

    def start(self):  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def _spawn(self, name: str, argv: list[str], **popen: object) -> None:
        """Start ``argv`` as child ``name``, stdin closed, stdout and stderr into its log;
        ``popen``: more :class:`subprocess.Popen` arguments."""
        (self.workdir / "log").mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "log" / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                close_fds=True, **popen)  # type: ignore[call-overload]

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise KubeStartError(f"{name} (pid {p.pid}) exited with status {p.returncode} during start-up"
                                     f"{self.tails()}")

    def tails(self, lines: int = 15) -> str:
        """The last ``lines`` lines of each process's log (for error messages)."""
        return "".join(f"\n{p}:\n{_tail(p, lines)}" for p in sorted((self.workdir / "log").glob("*.log")))

    def _wait(self, what: str, ok, deadline: float, period: float = 0.1) -> None:
        """Call ``ok()`` every ``period`` s until it is true (an OSError or a subprocess error
        counts as not yet); :class:`KubeStartError` with the logs' tails when a child exits or
        ``deadline`` (a ``time.monotonic()`` value) passes."""
        while True:
            self._check_alive()
            try:
                if ok():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            if time.monotonic() > deadline:
                raise KubeStartError(f"{what} not ready within {self.timeout:.0f} s{self.tails()}")
            time.sleep(period)

    def _terminate(self, name: str, timeout: float = 10) -> None:
        """SIGTERM child ``name``, SIGKILL when it has not exited ``timeout`` s later; reap it."""
        p = self.procs.pop(name, None)
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class KubeCluster(Processes):
    """etcd + kube-apiserver on 127.0.0.1 (free ports), optionally kube-controller-manager and
    kube-scheduler.

    Attributes once started: ``server`` (``https://127.0.0.1:PORT``), ``ca_file`` (PEM of the CA
    that signed the serving certificate), ``workdir``, ``start_s`` (seconds from spawning etcd to
    ``/readyz`` answering ``ok``).
    """

    def __init__(self, workdir: Path | None = None, timeout: float = 90.0):
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="warmctl-kube-"))
        self.timeout = timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self._tokens = {u: secrets.token_hex(16) for u in USERS}
        self.server = ""
        self.ca_file = self.workdir / "pki" / "ca.crt"
        self.start_s = 0.0
        self._kubeconfigs: dict[str, Path] = {}

    # -- identities ---------------------------------------------------------------------------
    def token(self, user: str = ADMIN) -> str:
        """The bearer token of ``user`` (one of :data:`USERS`; KeyError otherwise)."""
        return self._tokens[user]

    def kubeconfig(self, path: Path, user: str = ADMIN) -> Path:
        """Write a kubeconfig at ``path`` for ``user`` (server, CA, the user's token); returns ``path``."""
        path = Path(path)
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "warmctl-test",
            "clusters": [{"name": "warmctl-test", "cluster": {"server": self.server,
                                                              "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": self.token(user)}}],
            "contexts": [{"name": "warmctl-test", "context": {"cluster": "warmctl-test", "user": user}}],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
        path.chmod(0o600)
        return path

    def service_account_dir(self, path: Path, user: str) -> Path:
        """Write what the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount for a
        pod of service-account ``user`` (``system:serviceaccount:NS:NAME``): ``token``,
        ``ca.crt`` and ``namespace`` under ``path``; returns ``path``. With
        ``KUBERNETES_SERVICE_HOST=127.0.0.1`` and ``KUBERNETES_SERVICE_PORT=``:attr:`port`, a
        client's in-cluster configuration (pointed at ``path``) reaches this cluster."""
        parts = user.split(":")
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
            raise ValueError(f"{user!r} is not a service account's user name (system:serviceaccount:NS:NAME)")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "token").write_text(self.token(user))
        (path / "ca.crt").write_bytes(self.ca_file.read_bytes())
        (path / "namespace").write_text(parts[2])
        return path

    @property
    def port(self) -> int:
        """The apiserver's port on 127.0.0.1."""
        return int(self.server.rsplit(":", 1)[1])

    def _kubeconfig_of(self, user: str) -> Path:
        if user not in self._kubeconfigs:
            self._kubeconfigs[user] = self.kubeconfig(self.workdir / "kubeconfig" / f"{len(self._kubeconfigs)}.yaml", user)
        return self._kubeconfigs[user]

    # -- clients ------------------------------------------------------------------------------
    def kubectl(self, *args: str, user: str = ADMIN, input: str | None = None, check: bool = False,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster as ``user`` (text mode, output captured). ``check``:
        raise AssertionError with the output on a non-zero exit."""
        kubectl = kubectl_binary()
        if not kubectl:
            raise KubeStartError("no kubectl: set WARMCTL_KUBECTL or put one on PATH")
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        argv = [kubectl, f"--kubeconfig={self._kubeconfig_of(user)}", f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]
        r = subprocess.run(argv, input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} (as {user}) exited {r.returncode}\n"
                                 f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        return r

    def request(self, method: str, path: str, body: object = None, user: str = ADMIN,
                content_type: str = "application/json", timeout: float = 30,
                token: str | None = None) -> tuple[int, dict]:
        """One HTTPS request to the apiserver as ``user`` (or with the bearer ``token`` given):
        (HTTP status, JSON body or ``{}``). ``body``: a JSON-able object (sent with
        ``content_type``, e.g. ``application/merge-patch+json`` for PATCH). HTTP errors are
        returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token or self.token(user)}",
                                              "Content-Type": content_type, "Accept": "application/json"})
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:  # noqa: S310 - https to our own server
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"raw": raw.decode(errors="replace")}

    # -- lifecycle ----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], **popen: object) -> None:
        """:meth:`Processes._spawn`, the child killed when the thread that started it dies
        (``PR_SET_PDEATHSIG``; only from the main thread)."""
        main = threading.current_thread() is threading.main_thread()
        super()._spawn(name, argv, preexec_fn=_die_with_parent if main else None, **popen)

    def start(self) -> KubeCluster:
        """Start etcd and kube-apiserver; return once ``/readyz`` answers ``ok``."""
        gone = missing()
        if gone:
            raise KubeStartError(gone)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        ca, cert, key, sa_key, sa_pub = _make_pki(self.workdir / "pki")
        self.ca_file = ca
        self.sa_key = sa_key
        tokens = self.workdir / "tokens.csv"
        tokens.write_text("".join(f'{self._tokens[u]},{u},uid-{i},"{",".join(g)}"\n' for i, (u, g) in enumerate(USERS.items())))
        tokens.chmod(0o600)
        client, peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            str(etcd_binary()), "--name=warmctl-test", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=warmctl-test=http://127.0.0.1:{peer}", "--log-level=warn", "--logger=zap",
        ])
        def etcd_ok() -> bool:
            with urllib.request.urlopen(f"{etcd_url}/health", timeout=1) as r:  # noqa: S310 - our own etcd
                return r.status == 200
        self._wait("etcd", etcd_ok, deadline)
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self._spawn("kube-apiserver", [
            str(bin_dir() / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            "--insecure-port=0", f"--cert-dir={self.workdir / 'certs'}",
            f"--tls-cert-file={cert}", f"--tls-private-key-file={key}", f"--client-ca-file={ca}",
            f"--token-auth-file={tokens}", "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--service-cluster-ip-range=10.96.0.0/24", "--endpoint-reconciler-type=none",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--anonymous-auth=false", "--profiling=false", "--v=1",
        ])

        def ready() -> bool:
            try:
                st, body = self.request("GET", "/readyz", timeout=2)
            except (OSError, ssl.SSLError):
                return False
            return st == 200
        self._wait("kube-apiserver /readyz", ready, deadline)
        self.start_s = time.monotonic() - t0
        return self

    def start_controllers(self) -> None:
        """Start kube-controller-manager (the default controllers but node lifecycle: service
        accounts and their token secrets, namespaces, garbage collection, deployments,
        daemonsets, jobs...; no leader election, no serving port) and wait until the ``default`` namespace has its
        ``default`` service account (the token controller then has run). Idempotent."""
        if "kube-controller-manager" in self.procs:
            return
        gone = missing(controllers=True)
        if gone:
            raise KubeStartError(gone)
        deadline = time.monotonic() + self.timeout
        self._spawn("kube-controller-manager", [
            str(bin_dir() / "kube-controller-manager"), f"--kubeconfig={self._kubeconfig_of(ADMIN)}",
            "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
            f"--service-account-private-key-file={self.sa_key}", f"--root-ca-file={self.ca_file}",
            "--use-service-account-credentials=false", "--v=1",
            # nodes here are API objects without kubelets: no NotReady taints, no evictions
            "--controllers=*,-nodelifecycle",
        ])

        def sa_ready() -> bool:
            st, body = self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=2)
            return st == 200 and bool(body.get("secrets"))
        self._wait("kube-controller-manager (the default service account's token)", sa_ready, deadline)

    def start_scheduler(self) -> None:
        """Start kube-scheduler (the default profile, no leader election, nothing served: it
        binds the pods the controllers create, e.g. a Deployment's or a DaemonSet's, to a node)
        once :meth:`start_controllers` ran; returns once its process has run 1 s without exiting
        (it serves nothing to probe). Idempotent."""
        if "kube-scheduler" in self.procs:
            return
        if not os.access(bin_dir() / "kube-scheduler", os.X_OK):
            raise KubeStartError(f"{bin_dir() / 'kube-scheduler'} missing: run scripts/install-kubernetes.sh as root")
        self._spawn("kube-scheduler", [
            str(bin_dir() / "kube-scheduler"), f"--kubeconfig={self._kubeconfig_of(ADMIN)}",
            "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1", "--v=1",
        ])
        started = time.monotonic()
        self._wait("kube-scheduler", lambda: time.monotonic() - started > 1, started + self.timeout)

    def stop(self) -> None:
        """SIGTERM each process in reverse start order, SIGKILL what has not exited 10 s later,
        reap each; then remove the working directory (when this object made it)."""
        for name in reversed(list(self.procs)):
            self._terminate(name)
        if self._own_dir and os.environ.get("WARMCTL_TEST_KEEP_TMP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

