"""Which client for which cloud: the official SDKs against obstore (Rust object_store), on the
emulators the tests use, side by side in one run (docs/storage.md records the results).

    python -m ckptlib.bench.storage_clients --size 64 --reps 3

For each cloud it uploads and downloads the same random bytes with: ckptlib's storage
(open_writer / read), the SDK's own plain transfer (boto3 upload_fileobj / download_fileobj;
google-cloud-storage upload_from_string / download_as_bytes; azure-storage-blob upload_blob /
download_blob), and obstore put / get. Prints MiB/s (median) and the peak thread count.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import threading
import time
import traceback

MiB = 1 << 20


def _timed(fn, reps: int) -> tuple[float, int]:
    times, peak = [], threading.active_count()
    for _ in range(reps):
        stop = threading.Event()

        def watch():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, threading.active_count())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        stop.set()
        watcher.join()
    return statistics.median(times), peak - 2  # minus the main thread and the watcher


def _ckptlib(uri: str, data: bytes):
    from ckptlib.storage import open_storage

    storage = open_storage(uri)

    def up():
        with storage.open_writer("ckptlib.bin") as stream:
            stream.write(data)

    def down():
        assert len(storage.read("ckptlib.bin", 0, len(data))) == len(data)

    return up, down


def run(size_mib: int, reps: int) -> dict:
    from ckptlib.testing.fakes import emulators as em
    from ckptlib.testing.fakes.s3_server import create_bucket, s3_client, start_moto_server

    data = os.urandom(size_mib * MiB)
    results: dict[str, dict] = {}

    def measure(cloud: str, name: str, up, down):
        try:
            (tu, pu), (td, pd) = _timed(up, reps), _timed(down, reps)
            results.setdefault(cloud, {})[name] = {
                "upload_mib_s": size_mib / tu,
                "download_mib_s": size_mib / td,
                "upload_threads": pu,
                "download_threads": pd,
            }
        except Exception as exc:  # noqa: BLE001 - a client that cannot talk to the emulator is a result too
            results.setdefault(cloud, {})[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            traceback.print_exc(limit=1)

    import obstore
    from obstore.store import AzureStore, GCSStore, S3Store

    with start_moto_server() as endpoint:
        from boto3.s3.transfer import TransferConfig

        from ckptlib.storage import s3 as s3mod

        bucket = create_bucket(endpoint)
        client = s3_client(endpoint)
        config = TransferConfig(
            multipart_threshold=s3mod.DEFAULT_MULTIPART_THRESHOLD,
            multipart_chunksize=s3mod.DEFAULT_PART_SIZE,
            max_concurrency=s3mod.DEFAULT_MAX_CONCURRENCY,
        )
        measure("s3", "ckptlib (boto3)", *_ckptlib(f"s3://{bucket}/c", data))
        measure(
            "s3",
            "boto3 upload_fileobj/download_fileobj",
            lambda: client.upload_fileobj(io.BytesIO(data), bucket, "sdk.bin", Config=config),
            lambda: client.download_fileobj(bucket, "sdk.bin", io.BytesIO(), Config=config),
        )
        store = S3Store(
            bucket,
            endpoint=endpoint,
            access_key_id="testing",
            secret_access_key="testing",
            region="us-east-1",
            client_options={"allow_http": True},
        )
        measure(
            "s3",
            "obstore put/get",
            lambda: obstore.put(store, "ob.bin", data, chunk_size=16 * MiB, max_concurrency=8),
            lambda: obstore.get(store, "ob.bin").bytes(),
        )

    with em.start_gcs_server(em.gcs_binary()) as endpoint:
        from google.cloud import storage as gcs

        bucket = em.create_gcs_bucket(endpoint)
        measure("gcs", "ckptlib (google-cloud-storage)", *_ckptlib(f"gs://{bucket}/c", data))
        blob = gcs.Client().bucket(bucket).blob("sdk.bin")
        measure(
            "gcs",
            "google-cloud-storage upload_from_string/download_as_bytes",
            lambda: blob.upload_from_string(data),
            lambda: blob.download_as_bytes(),
        )
        key = json.dumps(
            {
                "gcs_base_url": endpoint,
                "disable_oauth": True,
                "client_email": "",
                "private_key": "",
                "private_key_id": "",
            }
        )
        store = GCSStore(bucket, service_account_key=key)
        measure(
            "gcs",
            "obstore put/get",
            lambda: obstore.put(store, "ob.bin", data, chunk_size=16 * MiB, max_concurrency=8),
            lambda: obstore.get(store, "ob.bin").bytes(),
        )

    with em.start_azurite(em.azurite_binary()) as endpoint:
        container = em.create_azure_container(endpoint)
        measure("azure", "ckptlib (azure-storage-blob)", *_ckptlib(f"az://{container}/c", data))
        sdk = em._azure_service(endpoint).get_container_client(container)
        measure(
            "azure",
            "azure-storage-blob upload_blob/download_blob",
            lambda: sdk.upload_blob("sdk.bin", data, overwrite=True, max_concurrency=8),
            lambda: sdk.download_blob("sdk.bin", max_concurrency=8).readall(),
        )
        os.environ["AZURITE_BLOB_STORAGE_URL"] = endpoint
        store = AzureStore(container, account_name=em.AZURITE_ACCOUNT, access_key=em.AZURITE_KEY, use_emulator=True)
        measure(
            "azure",
            "obstore put/get",
            lambda: obstore.put(store, "ob.bin", data, chunk_size=16 * MiB, max_concurrency=8),
            lambda: obstore.get(store, "ob.bin").bytes(),
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64, help="MiB per object (default 64)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = run(args.size, args.reps)
    print("| cloud | client | upload MiB/s | download MiB/s | threads up/down |")
    print("|---|---|---:|---:|---:|")
    for cloud, rows in results.items():
        for name, r in rows.items():
            if "error" in r:
                print(f"| {cloud} | {name} | failed: {r['error']} | | |")
            else:
                print(
                    f"| {cloud} | {name} | {r['upload_mib_s']:.0f} | {r['download_mib_s']:.0f} | "
                    f"{r['upload_threads']}/{r['download_threads']} |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_mib": args.size, "reps": args.reps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
