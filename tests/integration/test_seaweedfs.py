"""The S3 fixture itself (tests/fixtures/seaweedfs.py): what its configuration claims holds."""

from __future__ import annotations

import obstore
from obstore.store import S3Store

from tests.fixtures.seaweedfs import S3Server, seaweedfs  # noqa: F401  (fixture)


def test_a_bucket_grows_one_volume_at_its_first_write_so_many_buckets_fit(
    seaweedfs: S3Server,  # noqa: F811
) -> None:
    """master.toml's ``copy_1 = 1`` is read (SeaweedFS grows 7 volumes per collection without
    it, and -volume.max=64 would then hold only 9 buckets)."""
    for bucket in ("volumes-one", "volumes-two"):
        seaweedfs.create_bucket(bucket)
        store = S3Store(bucket, endpoint=seaweedfs.endpoint, region="us-east-1",
                        access_key_id=seaweedfs.access_key,
                        secret_access_key=seaweedfs.secret_key,
                        client_options={"allow_http": True})
        obstore.put(store, "object", b"x" * 4096)
    volumes = seaweedfs.volumes()
    assert volumes.get("volumes-one") == 1 and volumes.get("volumes-two") == 1, volumes
