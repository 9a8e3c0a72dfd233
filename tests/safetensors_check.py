"""zp.test.safetensors.python: zp's safetensors files against the reference implementation, the
`safetensors` Python package, both ways and bitwise.

  python safetensors_check.py <safetensors_export program> <work dir>

1. zp writes files of random tensors (tests/safetensors_export.cpp); Python reads them with
   safetensors.numpy.load_file and safe_open, and with safetensors.deserialize (the Rust parser,
   raw bytes) for BF16, which numpy has no type for.
2. Python writes files with safetensors.numpy.save_file and, for BF16, safetensors.serialize_file;
   zp's Reader reads them back and compares bitwise.

ZP_TEST_SEED repeats a run; the seed is printed.
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import safetensors
from safetensors import TensorSpec, deserialize, safe_open, serialize_file
from safetensors.numpy import load_file, save_file

NUMPY_DTYPE = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
               "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def expected(work, manifest_name):
    with open(os.path.join(work, manifest_name)) as f:
        manifest = json.load(f)
    for name, t in manifest["tensors"].items():
        with open(os.path.join(work, t["bin"]), "rb") as f:
            t["bytes"] = f.read()
    return manifest


def check_array(where, name, arr, want):
    check(arr.dtype == NUMPY_DTYPE[want["dtype"]], f"{where}: {name} has numpy dtype {arr.dtype}, want {want['dtype']}")
    check(list(arr.shape) == want["shape"], f"{where}: {name} has shape {list(arr.shape)}, want {want['shape']}")
    check(arr.tobytes() == want["bytes"], f"{where}: {name} differs bitwise from what zp wrote")


def check_raw(path, manifest, names):
    """Every tensor of `names` through the Rust parser's raw bytes (BF16 included)."""
    with open(path, "rb") as f:
        raw = dict(deserialize(f.read()))
    for name in names:
        want = manifest["tensors"][name]
        got = raw.get(name)
        check(got is not None, f"{path}: deserialize has no {name}")
        if got is None:
            continue
        check(got["dtype"] == want["dtype"], f"{path}: {name} is {got['dtype']}, want {want['dtype']}")
        check(list(got["shape"]) == want["shape"], f"{path}: {name} has shape {got['shape']}")
        check(bytes(got["data"]) == want["bytes"], f"{path}: {name} raw bytes differ from what zp wrote")


def read_zp_files(export, work, seed):
    subprocess.run([export, "write", work, str(seed)], check=True)

    # One file: safe_open for metadata and every numpy-typed tensor, the raw parser for all.
    single = expected(work, "single.json")
    path = os.path.join(work, "single.safetensors")
    with safe_open(path, framework="numpy") as f:
        check(f.metadata() == single["metadata"], f"{path}: metadata {f.metadata()}")
        check(sorted(f.keys()) == sorted(single["tensors"]), f"{path}: keys {sorted(f.keys())}")
        for name, want in single["tensors"].items():
            if want["dtype"] == "BF16":
                s = f.get_slice(name)  # numpy cannot hold it, but the header must say so
                check(s.get_dtype() == "BF16" and list(s.get_shape()) == want["shape"], f"{path}: slice of {name}")
            else:
                check_array(path, name, f.get_tensor(name), want)
    check_raw(path, single, single["tensors"])

    # A split model: the index, then each shard loaded whole.
    split = expected(work, "split.json")
    with open(os.path.join(work, "model.safetensors.index.json")) as f:
        index = json.load(f)
    check(index["metadata"]["total_size"] == split["total_size"], f"index total_size {index['metadata']}")
    check(index["weight_map"] == {n: t["file"] for n, t in split["tensors"].items()}, "index weight_map")
    for file in sorted(set(index["weight_map"].values())):
        loaded = load_file(os.path.join(work, file))
        mine = [n for n, t in split["tensors"].items() if t["file"] == file]
        check(sorted(loaded) == sorted(mine), f"{file}: tensors {sorted(loaded)}")
        for name in mine:
            if name in loaded:
                check_array(file, name, loaded[name], split["tensors"][name])
    print(f"python checked {len(single['tensors'])} + {len(split['tensors'])} tensors written by zp")


def read_engine_export(export, work):
    """A live engine's export (zp::export_safetensors): bf16 parameters in one file, read raw
    (numpy has no bfloat16), and fp32 master weights split with an index, loaded whole."""
    subprocess.run([export, "engine", work], check=True)
    params = expected(work, "engine.json")
    path = os.path.join(work, "engine", "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        check(f.metadata() == params["metadata"], f"{path}: metadata {f.metadata()}")
        check(sorted(f.keys()) == sorted(params["tensors"]), f"{path}: keys {sorted(f.keys())}")
    check_raw(path, params, params["tensors"])
    master = expected(work, "engine-master.json")
    d = os.path.join(work, "engine-master")
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    check(sorted(index["weight_map"]) == sorted(master["tensors"]), "engine-master index names")
    files = sorted(set(index["weight_map"].values()))
    check(len(files) > 1, f"engine-master was not split: {files}")
    total = 0
    for file in files:
        loaded = load_file(os.path.join(d, file))
        for name, arr in loaded.items():
            check(index["weight_map"].get(name) == file, f"{file}: {name} is not mapped to it")
            check_array(file, name, arr, master["tensors"][name])
            total += arr.nbytes
    check(index["metadata"]["total_size"] == total, f"engine-master index total_size {index['metadata']}")
    print(f"python checked a live engine's export: {len(params['tensors'])} bf16 tensors, "
          f"{len(master['tensors'])} fp32 tensors in {len(files)} files")


def random_array(rng, dtype, shape):
    """Random bits of every pattern (NaN payloads, subnormals, negative zero) for floats."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def zp_reads(export, path, manifest):
    r = subprocess.run([export, "verify", path, manifest])
    check(r.returncode == 0, f"{path}: zp's Reader did not read it back bitwise (exit code {r.returncode})")


def write_python_files(export, work, seed):
    rng = np.random.default_rng(seed)
    out = os.path.join(work, "from_python")
    os.makedirs(out, exist_ok=True)

    def manifest_for(name, tensors, metadata, dtypes):
        m = {"metadata": metadata, "tensors": {}}
        for k, a in tensors.items():
            with open(os.path.join(out, k + ".bin"), "wb") as f:
                f.write(a.tobytes())
            m["tensors"][k] = {"dtype": dtypes[k], "shape": list(a.shape), "bin": k + ".bin"}
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(m, f)
        return os.path.join(out, name + ".json")

    # save_file: the numpy front end, every dtype numpy and zp share, plus U8, BOOL, a scalar
    # and an empty tensor.
    kinds = {"F64": (2, 3), "F32": (3, 5), "F16": (2, 2, 3), "I64": (4,), "I32": (11,), "U8": (5,), "BOOL": (3,)}
    tensors = {f"np.{k.lower()}": random_array(rng, NUMPY_DTYPE[k], s) for k, s in kinds.items()}
    tensors["np.scalar"] = random_array(rng, np.float32, ())
    tensors["np.empty"] = np.zeros((0, 4), dtype=np.float32)
    dtypes = {f"np.{k.lower()}": k for k in kinds} | {"np.scalar": "F32", "np.empty": "F32"}
    metadata = {"format": "np", "written_by": "safetensors " + safetensors.__version__}
    save_file(tensors, os.path.join(out, "numpy.safetensors"), metadata=metadata)
    m = manifest_for("numpy", tensors, metadata, dtypes)
    zp_reads(export, os.path.join(out, "numpy.safetensors"), m)

    # serialize_file: BF16 (as its uint16 bits), which the numpy front end cannot save.
    bf = {"bf16.a": random_array(rng, np.uint16, (7,)), "bf16.b": random_array(rng, np.uint16, (3, 4)),
          "f32": random_array(rng, np.float32, (5,))}
    specs = {k: TensorSpec(dtype="float32" if k == "f32" else "bfloat16", shape=list(a.shape),
                           data_ptr=a.ctypes.data, data_len=a.nbytes) for k, a in bf.items()}
    serialize_file(specs, os.path.join(out, "bf16.safetensors"), metadata={"format": "pt"})
    m = manifest_for("bf16", bf, {"format": "pt"}, {"bf16.a": "BF16", "bf16.b": "BF16", "f32": "F32"})
    zp_reads(export, os.path.join(out, "bf16.safetensors"), m)


def main():
    export, work = sys.argv[1], sys.argv[2]
    seed = int(os.environ.get("ZP_TEST_SEED", random.getrandbits(63)))
    print(f"seed {seed} (safetensors {safetensors.__version__}, numpy {np.__version__})")
    read_zp_files(export, work, seed)
    read_engine_export(export, work)
    write_python_files(export, work, seed)
    if failures:
        sys.exit(f"{len(failures)} differences between zp and the safetensors package (seed {seed})")
    print("zp and the safetensors package read each other's files bitwise")


if __name__ == "__main__":
    main()
