"""Why obstore: put and get of the same object through obstore and through fsspec's s3fs,
against one S3 endpoint (moto's server, a process), in the same run.

s3fs is not a dependency (it pins aiobotocore, which pins botocore: it downgraded the
botocore that boto3 uses when installed beside it), so run it from a scratch environment::

    python -m venv /tmp/s3cmp && /tmp/s3cmp/bin/pip install s3fs obstore "moto[server]" boto3
    /tmp/s3cmp/bin/python bench/store_libraries.py [MIB] [REPS]

Prints GB/s (median / mean / worst) of each library's put and get.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the moto kit

from store_kit import aws_env, create_bucket, moto_endpoint  # noqa: E402

BLOCK = 8 << 20


def main() -> None:
    size = int(sys.argv[1] if len(sys.argv) > 1 else 128) << 20
    reps = int(sys.argv[2] if len(sys.argv) > 2 else 3)
    data = os.urandom(size)
    with moto_endpoint() as url:
        os.environ.update(aws_env(url))
        create_bucket(url, "cmp-bucket")
        import obstore
        import s3fs
        from obstore.store import S3Store

        ob = S3Store.from_url("s3://cmp-bucket", client_options={"allow_http": True})
        fs = s3fs.S3FileSystem(endpoint_url=url, key="testing", secret="testing")
        seconds: dict[str, list[float]] = {k: [] for k in ("obstore put", "s3fs put", "obstore get", "s3fs get")}

        def blocks():
            return (data[i : i + BLOCK] for i in range(0, size, BLOCK))

        def timed(name: str, call) -> object:
            begin = time.perf_counter()
            result = call()
            seconds[name].append(time.perf_counter() - begin)
            return result

        for rep in range(reps):
            timed("obstore put", lambda: obstore.put(ob, f"o/{rep}", blocks(), chunk_size=BLOCK, max_concurrency=8))
            timed("s3fs put", lambda: _s3fs_put(fs, f"cmp-bucket/s/{rep}", blocks()))
            assert timed("obstore get", lambda: bytes(obstore.get_range(ob, f"o/{rep}", start=0, end=size))) == data
            assert timed("s3fs get", lambda: fs.cat_file(f"cmp-bucket/s/{rep}", start=0, end=size)) == data
    for name, values in seconds.items():
        rates = [size / s / 1e9 for s in values]
        print(f"{name}: GB/s {statistics.median(rates):.3f} / {statistics.mean(rates):.3f} / {min(rates):.3f}")


def _s3fs_put(fs, path: str, blocks) -> None:
    with fs.open(path, "wb", block_size=BLOCK) as file:
        for block in blocks:
            file.write(block)


if __name__ == "__main__":
    main()
