"""Cloud storage in `ckpt bench`: ckptlib save/load against each cloud SDK's own plain
upload/download of the same bytes per rank, on the emulators the tests use (127.0.0.1).

- s3 (moto): boto3 `upload_fileobj` / `download_fileobj` with ckptlib's part size and concurrency.
- gcs (fake-gcs-server): google-cloud-storage `upload_from_string` / `download_as_bytes`.
- azure (Azurite): azure-storage-blob `upload_blob` / `download_blob(...).readall()` with
  ckptlib's concurrency.

ckptlib and the SDK alternate inside each repetition (rotating order) so noise hits both.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Callable

from ckptlib.bench import counted
from ckptlib.bench.rank_ops import make_state, rank_world, same_values, timed_use

BACKENDS = ("s3", "gcs", "azure")
SDK_NAME = {"s3": "boto3", "gcs": "google-cloud-storage", "azure": "azure-storage-blob"}
EMULATOR = {"s3": "moto", "gcs": "fake-gcs-server", "azure": "Azurite"}


def _sdk_transfer(backend: str, container: str, key: str, payload: bytes) -> tuple[Callable, Callable]:
    """(upload, download) of `payload` at `key` with the backend's own SDK, as a user would."""
    if backend == "s3":
        import boto3
        from boto3.s3.transfer import TransferConfig

        from ckptlib.storage import s3 as s3mod

        client = boto3.session.Session().client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        config = TransferConfig(
            multipart_threshold=s3mod.DEFAULT_MULTIPART_THRESHOLD,
            multipart_chunksize=s3mod.DEFAULT_PART_SIZE,
            max_concurrency=s3mod.DEFAULT_MAX_CONCURRENCY,
        )

        def s3_down():
            sink = io.BytesIO()
            client.download_fileobj(container, key, sink, Config=config)
            assert sink.getbuffer().nbytes == len(payload)

        return (lambda: client.upload_fileobj(io.BytesIO(payload), container, key, Config=config)), s3_down
    if backend == "gcs":
        from google.cloud import storage

        blob = storage.Client().bucket(container).blob(key)

        def gcs_down():
            assert len(blob.download_as_bytes()) == len(payload)

        return (lambda: blob.upload_from_string(payload)), gcs_down
    from azure.storage.blob import BlobServiceClient

    from ckptlib.storage.azure import DEFAULTS

    service = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    blob = service.get_blob_client(container, key)
    threads = DEFAULTS.max_concurrency

    def az_down():
        assert len(blob.download_blob(max_concurrency=threads).readall()) == len(payload)

    return (lambda: blob.upload_blob(payload, overwrite=True, max_concurrency=threads)), az_down


def rank_cloud(backend: str, env: dict[str, str], container: str, size_mib: int, reps: int) -> dict[str, Any]:
    """In each rank: time ckptlib.save/load and the SDK's upload/download of the same bytes."""
    import ckptlib

    os.environ.update(env)
    rank, world = rank_world()
    state = make_state(size_mib)
    template = make_state(size_mib, fill=False)
    payload = bytearray()
    for t in state["params"].values():
        payload += memoryview(t.to_local().numpy()).cast("B")
    payload = bytes(payload)
    upload, download = _sdk_transfer(backend, container, f"raw/{size_mib}/{rank}.bin", payload)
    times: dict[str, list[float]] = {}
    ok = True
    # Untimed warm-up of both: client creation (credentials, service models, connection pools)
    # is a once-per-process cost, not a per-checkpoint one.
    warm = f"{backend if backend != 'gcs' else 'gs'}://{container}/{size_mib}/warm".replace("azure://", "az://")
    ckptlib.save(warm, state)
    ckptlib.load(warm, template)
    upload()
    download()
    uses: dict[str, list[dict[str, float]]] = {}

    def rec(name: str, use: dict[str, float]) -> None:
        times.setdefault(name, []).append(use["wall_s"])
        uses.setdefault(name, []).append(use)

    for rep in range(reps):
        uri = f"{backend if backend != 'gcs' else 'gs'}://{container}/{size_mib}/rep{rep}/ckpt".replace(
            "azure://", "az://"
        )
        order = ["ckptlib", "sdk"] if rep % 2 == 0 else ["sdk", "ckptlib"]
        for method in order:
            if method == "ckptlib":
                rec("save_ckptlib", timed_use(lambda: ckptlib.save(uri, state)))
            else:
                rec("save_sdk", timed_use(upload))
        for method in order:
            if method == "ckptlib":
                rec("load_ckptlib", timed_use(lambda: ckptlib.load(uri, template)))
                ok = ok and same_values(state, template)
            else:
                rec("load_sdk", timed_use(download))
    return {"rank": rank, "world": world, "times": times, "usage": uses, "ok": ok, "shard_bytes": len(payload)}


@contextlib.contextmanager
def _server(backend: str):
    """(env for the ranks, make_container, remove_container) for the backend's emulator."""
    if backend == "s3":
        from ckptlib.testing.fakes.s3_server import create_bucket, remove_bucket, s3_env, start_moto_server

        with start_moto_server() as endpoint:
            env = {k: v for k, v in s3_env(endpoint).items() if v is not None}
            yield env, (lambda: create_bucket(endpoint, "bench")), (lambda b: remove_bucket(endpoint, b))
        return
    from ckptlib.testing.fakes import emulators as em

    if backend == "gcs":
        binary = em.gcs_binary()
        if binary is None:
            raise RuntimeError(f"fake-gcs-server is not installed ({em.GCS_INSTALL})")
        with em.start_gcs_server(binary) as endpoint:
            env = {k: v for k, v in em.gcs_env(endpoint).items() if v is not None}
            yield env, (lambda: em.create_gcs_bucket(endpoint, "bench")), (lambda b: em.remove_gcs_bucket(endpoint, b))
        return
    binary = em.azurite_binary()
    if binary is None:
        raise RuntimeError(f"Azurite is not installed ({em.AZURITE_INSTALL})")
    with em.start_azurite(binary) as endpoint:
        env = {k: v for k, v in em.azure_env(endpoint).items() if v is not None}
        yield (
            env,
            (lambda: em.create_azure_container(endpoint, "bench")),
            (lambda c: em.remove_azure_container(endpoint, c)),
        )


def run_cloud(args, launch, log) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for backend in args.clouds:
        try:
            with _server(backend) as (env, make, remove):
                for size in args.cloud_sizes:
                    for ws in [w for w in args.world_sizes if w <= 2]:
                        log(f"{backend}: {size} MiB at {counted(ws, 'rank')}")
                        container = make()
                        try:
                            out = launch(ws, rank_cloud, backend, env, container, size, args.reps, timeout=args.timeout)
                        finally:
                            remove(container)
                        row = {
                            "backend": backend,
                            "size_mib": size,
                            "world": ws,
                            "ok": all(r["ok"] for r in out),
                            "times": {},
                            "usage": {key: [r["usage"].get(key, []) for r in out] for key in out[0]["usage"]},
                        }
                        for key in out[0]["times"]:
                            columns = [r["times"][key] for r in out]
                            row["times"][key] = [max(vals) for vals in zip(*columns)]
                        rows.append(row)
        except (ImportError, RuntimeError) as exc:
            log(f"{backend}: skipped ({exc})")
            rows.append({"backend": backend, "skipped": str(exc)})
    return rows


def summarize_cloud(rows: list[dict[str, Any]], aggregate: Callable[[list[float]], float]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if "skipped" in r:
            out.append(r)
            continue
        times = r["times"]
        if "save_boto3" in times:  # an older run's JSON: S3 only
            times = {k.replace("boto3", "sdk"): v for k, v in times.items()}
        t = {k: aggregate(v) for k, v in times.items()}
        size = r["size_mib"]

        def tp(key: str) -> float:
            return size / t[key] if t.get(key) else float("nan")

        row = {"backend": r.get("backend", "s3"), "size_mib": size, "world": r["world"], "ok": r["ok"]}
        for key in ("save_ckptlib", "save_sdk", "load_ckptlib", "load_sdk"):
            row[key] = tp(key)
        row["save_ratio"] = row["save_ckptlib"] / row["save_sdk"]
        row["load_ratio"] = row["load_ckptlib"] / row["load_sdk"]
        out.append(row)
    return out


def markdown_cloud(summary: list[dict[str, Any]], fmt: Callable[..., str]) -> list[str]:
    if not summary:
        return []
    out = [
        "",
        "### Cloud storage (emulators on 127.0.0.1), MiB/s: ckptlib against each SDK's plain transfer",
        "| backend (SDK, emulator) | state MiB | ranks | ckptlib save | SDK upload | ratio | ckptlib load "
        "| SDK download | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        backend = r.get("backend", "s3")
        label = f"{backend} ({SDK_NAME.get(backend, '?')}, {EMULATOR.get(backend, '?')})"
        if "skipped" in r:
            out.append(f"| {label} | skipped: {r['skipped']} ||||||||")
            continue
        out.append(
            f"| {label} | {r['size_mib']} | {r['world']} | {fmt(r['save_ckptlib'])} | {fmt(r['save_sdk'])} | "
            f"{fmt(r['save_ratio'], 2)} | {fmt(r['load_ckptlib'])} | {fmt(r['load_sdk'])} | "
            f"{fmt(r['load_ratio'], 2)} |"
        )
    return out
