"""``/v1/snapshots``: the local store's named snapshots, making one, removing a name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path

from warmctl.agent.jobs import Conflict, Job, JobReporter
from warmctl.base.errors import WarmctlError

from ..deps import Agent, Protected
from ..errors import CONFLICT, ERRORS, NOT_FOUND, ApiError, accepted
from ..models import NAME_PATTERN, TAG_PATTERN, Deleted, SnapshotRequest, SnapshotView

router = APIRouter(tags=["snapshots"], dependencies=Protected, responses=ERRORS)


@router.get("/v1/snapshots", response_model=list[SnapshotView])
def snapshots(agent: Agent) -> list[SnapshotView]:
    """Snapshots named in the local store's catalog (``warmctl ls``), each with whether it was
    made from the profile now on disk (``profile_current``) and, when not, which fields
    changed (``profile_changes``)."""
    from warmctl.naming.drift import DriftCache
    from warmctl.naming.fleet import snapshots as named
    from warmctl.host import HostFingerprint

    s = agent.settings
    cache = DriftCache(s.profile_dirs)
    out = []
    for e, m in named(s):
        try:
            hs = HostFingerprint.model_validate(e.host).summary()
        except ValueError:
            hs = "(unreadable fingerprint)"
        manifest = None if isinstance(m, str) else m  # a str: why the manifest cannot be read
        d = cache.drift(e.name, e.profile_digest, manifest.profile if manifest else None)
        out.append(SnapshotView(name=e.name, tag=e.tag, digest=e.manifest, size=e.size, created=e.created.isoformat(),
                                profile_digest=e.profile_digest, host=hs, profile_current=d.current,
                                profile_changes=d.as_json()["changes"],
                                layout=None if manifest is None or manifest.restore.layout is None
                                else manifest.restore.layout.model_dump(mode="json")))
    return out


@router.post("/v1/snapshots", status_code=202, response_model=Job, responses=CONFLICT)
def snapshot_create(req: SnapshotRequest, agent: Agent) -> Any:
    """Start a job that snapshots profile ``profile`` (cold start, warm-up, canary, CRIU
    dump, store) as ``profile:tag`` and, with ``push`` (default: when the agent has a
    remote store), publishes it there. 409 while a job works on that engine or its port."""
    from warmctl.records.profile import ProfileError, load_profile

    s = agent.settings
    try:
        prof = load_profile(req.profile, s.profile_dirs)
    except ProfileError as e:
        raise ApiError(404, "not_found", str(e)) from None
    resources = [f"engine:{prof.name}", f"port:{prof.engine.port}"]

    def run(rep: JobReporter, job: Job) -> dict:
        from warmctl.pipelines.snapshot import snapshot as run_snapshot

        push_to = s.remote_store if req.push is not False else None
        if req.push and not push_to:
            raise WarmctlError("push: the agent has no remote store configured (remote_store)")
        res = run_snapshot(prof, s, rep, tag=req.tag, push_to=push_to)
        return {"name": prof.name, "tag": req.tag, "digest": res.digest, "size": res.size, "pushed_to": push_to}

    return accepted(agent.submit("snapshot", prof.name, resources, run, req.model_dump()))


@router.delete("/v1/snapshots/{name}/{tag}", response_model=Deleted, responses={**NOT_FOUND, **CONFLICT})
def snapshot_delete(agent: Agent, name: str = Path(..., pattern=NAME_PATTERN),
                    tag: str = Path(..., pattern=TAG_PATTERN)) -> Deleted:
    """Remove ``name:tag`` from the catalog (``warmctl rm``): every kind of host's entry, in
    the local store and in the catalog ``up`` reads (the remote store on a fleet node), so
    no node's ``up`` finds it any more; the data stays until ``warmctl gc``. 404 when no
    catalog names it; 409 while a job works on engine ``name``."""
    from warmctl.naming.fleet import remove_snapshot

    holder = agent.live_job(name)
    if holder is not None:
        raise ApiError(409, "conflict", str(Conflict(f"engine:{name}", holder)), holder.id)
    removed = remove_snapshot(agent.settings, name, tag)
    digests = sorted({d for ds in removed.values() for d in ds})
    if not digests:
        raise ApiError(404, "not_found", f"no snapshot {name}:{tag} in the catalog at {', '.join(removed)}")
    return Deleted(name=name, tag=tag, digests=digests, catalogs=[k for k, v in removed.items() if v])
