#!/usr/bin/env python3
"""Writes STEP into a zp trainer's checkpoint as its count of steps done (the first 8 bytes of
the rank-0 file's user/blob) and seals the change: the file's CRC-32C in the manifest, then the
manifest's own. A checkpoint so changed verifies; only the trainer's check of the count can
refuse it.
    seal_user_step.py CHECKPOINT_TAG_DIR STEP"""
import json
import pathlib
import struct
import sys


def crc32c(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def main() -> None:
    tag, step = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    manifest = json.loads((tag / "manifest.json").read_text())
    entry = manifest["files"][0]
    path = tag / entry["name"]
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack_from("<Q", data, 0)
    blob = json.loads(data[8:8 + header_len])["user/blob"]
    at = 8 + header_len + blob["data_offsets"][0]
    struct.pack_into("<q", data, at, step)
    path.write_bytes(data)
    entry["crc32c"] = crc32c(data)
    del manifest["manifest_crc32c"]
    text = json.dumps(manifest, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    manifest["manifest_crc32c"] = crc32c(text.encode())
    (tag / "manifest.json").write_text(json.dumps(manifest))


if __name__ == "__main__":
    main()
