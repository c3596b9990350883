#!/bin/sh
# SeaweedFS as one S3 endpoint on :8333 with one identity, and the buckets modelprep needs.
#   S3_ACCESS_KEY, S3_SECRET_KEY   the identity every request must be signed with (required)
#   S3_BUCKETS                     space-separated buckets to create (existing ones are kept)
# The ready file /tmp/objectstore.ready exists once the buckets do (healthcheck.py reads it).
set -eu
: "${S3_ACCESS_KEY:?S3_ACCESS_KEY is required}" "${S3_SECRET_KEY:?S3_SECRET_KEY is required}"
: "${S3_BUCKETS:=}"
rm -f /tmp/objectstore.ready
cd /data
umask 077
cat >/tmp/s3.json <<EOF
{"identities": [{"name": "modelprep",
  "credentials": [{"accessKey": "${S3_ACCESS_KEY}", "secretKey": "${S3_SECRET_KEY}"}],
  "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
EOF
# A bucket is a collection that grows 7 volumes at its first write by default; one is enough.
printf '[master.volume_growth]\ncopy_1 = 1\n' >/data/master.toml
weed server -dir=/data -ip=127.0.0.1 -ip.bind=0.0.0.0 -master.volumeSizeLimitMB=1024 \
    -volume.max=0 -filer -s3 -s3.port=8333 -s3.config=/tmp/s3.json &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
for bucket in $S3_BUCKETS; do
    tries=0
    until echo "s3.bucket.create -name $bucket" | weed shell -master=127.0.0.1:9333 2>&1 \
            | grep -qE "created bucket|already exists"; do
        tries=$((tries + 1))
        if [ "$tries" -ge 120 ] || ! kill -0 "$pid" 2>/dev/null; then
            echo "objectstore: could not create bucket $bucket" >&2
            kill -TERM "$pid" 2>/dev/null || true
            exit 1
        fi
        sleep 1
    done
    echo "objectstore: bucket $bucket ready"
done
touch /tmp/objectstore.ready
wait "$pid"
