"""Interop with the real TensorFlow and `tfrecord` package (in .venv-interop, as subprocesses).

TensorFlow writes, we read; we write, TensorFlow reads; plain, GZIP and ZLIB; multi-valued
features and SequenceExamples; our uncompressed bytes equal TensorFlow's.
"""

import json
import subprocess

import numpy as np
import pytest

from data_tools.example import decode_example, decode_sequence_example, encode_example, encode_sequence_example
from data_tools.index import build_index
from data_tools.tfrecord import read_records, write_records

COMPRESSIONS = [None, "GZIP", "ZLIB"]


def examples():
    """Multi-valued features of every type, with edge values (empty bytes, int64 limits, UTF-8)."""
    out = []
    for i in range(6):
        out.append({
            "blob": [bytes(range(i * 40, i * 40 + 40)), b"", b"\x00\xff" * i],
            "text": ["héllo", f"record {i}"],
            "ints": [i, -i - 1, 2**63 - 1, -(2**63)],
            "floats": [i + 0.5, -1e-3, 3.0e38][: i % 3 + 1],
            "label": [i % 2],
        })
    return out


def sequences():
    return [{"context": {"id": [f"clip-{i}"], "length": [i + 1]},
             "lists": {"tokens": [[t, t * 2] for t in range(i + 1)], "score": [[t / 4] for t in range(i + 1)]}}
            for i in range(3)]


def kind(key):
    return {"blob": "bytes", "text": "bytes", "id": "bytes", "floats": "float", "score": "float"}.get(key, "int64")


def tf_json(values: dict) -> dict:
    """A feature dict as JSON for the TensorFlow script: bytes as hex, each with its list kind."""
    out = {}
    for key, vals in values.items():
        if kind(key) == "bytes":
            vals = [(v.encode() if isinstance(v, str) else v).hex() for v in vals]
        out[key] = [kind(key), vals]
    return out


TF_COMMON = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
def feature(kind, vals):
    if kind == "bytes":
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[bytes.fromhex(v) for v in vals]))
    if kind == "float":
        return tf.train.Feature(float_list=tf.train.FloatList(value=vals))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=vals))
def features(d):
    return tf.train.Features(feature={k: feature(*v) for k, v in d.items()})
def dump_feature(f):
    kind = f.WhichOneof("kind")
    if kind == "bytes_list":
        return [v.hex() for v in f.bytes_list.value]
    return list(getattr(f, kind).value)
def dump_features(fs):
    return {k: dump_feature(v) for k, v in fs.feature.items()}
job = json.loads(sys.argv[1])
"""

TF_WRITE = TF_COMMON + r"""
for path, comp in job["files"]:
    opts = tf.io.TFRecordOptions(compression_type=comp or "")
    with tf.io.TFRecordWriter(path + ".ex", opts) as w:
        for ex in job["examples"]:
            w.write(tf.train.Example(features=features(ex)).SerializeToString())
    with tf.io.TFRecordWriter(path + ".seq", opts) as w:
        for s in job["sequences"]:
            lists = tf.train.FeatureLists(feature_list={
                k: tf.train.FeatureList(feature=[feature(*step) for step in steps]) for k, steps in s["lists"].items()})
            w.write(tf.train.SequenceExample(context=features(s["context"]), feature_lists=lists).SerializeToString())
"""

TF_READ = TF_COMMON + r"""
out = {}
for path, comp in job["files"]:
    exs = [dump_features(tf.train.Example.FromString(r.numpy()).features)
           for r in tf.data.TFRecordDataset(path + ".ex", compression_type=comp or "")]
    seqs = []
    for r in tf.data.TFRecordDataset(path + ".seq", compression_type=comp or ""):
        s = tf.train.SequenceExample.FromString(r.numpy())
        seqs.append({"context": dump_features(s.context), "lists": {
            k: [dump_feature(f) for f in fl.feature] for k, fl in s.feature_lists.feature_list.items()}})
    # TensorFlow's own parsing op, not only its proto classes
    parsed = tf.io.parse_example(
        next(iter(tf.data.TFRecordDataset(path + ".ex", compression_type=comp or "").batch(64))),
        {"ints": tf.io.VarLenFeature(tf.int64), "label": tf.io.FixedLenFeature([], tf.int64)})
    out[path] = {"examples": exs, "sequences": seqs, "labels": parsed["label"].numpy().tolist(),
                 "ints": tf.sparse.to_dense(parsed["ints"]).numpy().tolist()}
print(json.dumps(out))
"""


def run_tf(interop_python, script, job):
    done = subprocess.run([str(interop_python), "-c", script, json.dumps(job)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout) if done.stdout.strip() else None


def seq_job(s):
    return {"context": tf_json(s["context"]), "lists": {k: [[kind(k), step] for step in steps] for k, steps in s["lists"].items()}}


def assert_decoded(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        if kind(key) == "bytes":
            assert got[key] == [v.encode() if isinstance(v, str) else v for v in want], key
        elif kind(key) == "float":
            assert got[key].dtype == np.float32 and np.array_equal(got[key], np.float32(want)), key
        else:
            assert got[key].dtype == np.int64 and got[key].tolist() == want, key


def test_tensorflow_writes_we_read(tmp_path, interop_python):
    files = [(str(tmp_path / f"tf-{c or 'plain'}"), c) for c in COMPRESSIONS]
    run_tf(interop_python, TF_WRITE, {"files": files, "examples": [tf_json(e) for e in examples()],
                                      "sequences": [seq_job(s) for s in sequences()]})
    for path, compression in files:
        got = [decode_example(r) for r in read_records(path + ".ex", strict=True)]
        assert len(got) == len(examples())
        for g, want in zip(got, examples()):
            assert_decoded(g, want)
        seqs = [decode_sequence_example(r) for r in read_records(path + ".seq", strict=True)]
        for (context, lists), want in zip(seqs, sequences(), strict=True):
            assert_decoded(context, want["context"])
            assert [v.tolist() for v in lists["tokens"]] == want["lists"]["tokens"]
            assert [v.tolist() for v in lists["score"]] == want["lists"]["score"]
    # Our writer reproduces TensorFlow's uncompressed file byte for byte.
    plain = files[0][0] + ".ex"
    ours = tmp_path / "ours.tfrecord"
    write_records(ours, read_records(plain))
    assert ours.read_bytes() == open(plain, "rb").read()


def test_we_write_tensorflow_reads(tmp_path, interop_python):
    files = [(str(tmp_path / f"ours-{c or 'plain'}"), c) for c in COMPRESSIONS]
    for path, compression in files:
        write_records(path + ".ex", [encode_example(e) for e in examples()], compression)
        write_records(path + ".seq", [encode_sequence_example(s["context"], s["lists"]) for s in sequences()], compression)
    result = run_tf(interop_python, TF_READ, {"files": files})
    for path, _ in files:
        got = result[path]
        for g, want in zip(got["examples"], examples(), strict=True):
            for key, values in want.items():
                if kind(key) == "bytes":
                    assert g[key] == [(v.encode() if isinstance(v, str) else v).hex() for v in values]
                elif kind(key) == "float":
                    assert np.array_equal(np.float32(g[key]), np.float32(values))
                else:
                    assert g[key] == values
        assert got["labels"] == [e["label"][0] for e in examples()]
        assert got["ints"] == [e["ints"] for e in examples()]
        for g, want in zip(got["sequences"], sequences(), strict=True):
            assert g["context"]["length"] == want["context"]["length"]
            assert g["lists"]["tokens"] == want["lists"]["tokens"]
            assert np.allclose(g["lists"]["score"], want["lists"]["score"])


def test_tfrecord_package_reads_our_index(tmp_path, interop_python):
    """The `tfrecord` package (DALI's index format) reads our file through our index."""
    path = tmp_path / "d.tfrecord"
    write_records(path, [encode_example({"i": i, "name": f"n{i}"}) for i in range(50)])
    index = build_index(path)
    script = (
        "import sys, json\n"
        "from tfrecord.reader import tfrecord_loader\n"
        "rows = [[int(r['i'][0]), bytes(r['name']).decode()] for r in "
        "tfrecord_loader(sys.argv[1], sys.argv[2], {'i': 'int', 'name': 'byte'}, shard=(1, 2))]\n"
        "print(json.dumps(rows))\n"
    )
    done = subprocess.run([str(interop_python), "-c", script, str(path), str(index)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert rows == [[i, f"n{i}"] for i in range(25, 50)]  # the second half: shard 1 of 2 by index


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_output_is_smaller_and_valid(tmp_path, compression):
    path = tmp_path / "d"
    write_records(path, [b"x" * 1000] * 10, compression)
    assert path.stat().st_size < 1000 and list(read_records(path)) == [b"x" * 1000] * 10
